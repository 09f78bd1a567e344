"""Hyperparameters of our trainers, as typed models. No torch import here: recipes validate fast.

Each trainer takes its own config (`SFTConfig`, ...). A recipe stage of that kind *is* that config
plus the stage's wiring (id, needs, which model and data it reads), see `alignpipe.recipe.stages`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignpipe.strict import Strict


class LoraSpec(Strict):
    """Train a LoRA adapter (peft) instead of all weights."""

    r: int = Field(8, gt=0)
    """Rank of the update matrices."""
    alpha: float = Field(16.0, gt=0)
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt, or "all-linear" for every linear layer except the output head."""


class TrainingArgs(Strict):
    """Optimization knobs shared by every trainer."""

    learning_rate: float = Field(2e-4, gt=0)
    """Peak learning rate of AdamW."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the training split (fractions allowed). Ignored when `max_steps` is set."""
    max_steps: int | None = Field(None, gt=0)
    """Optimizer steps to run; overrides `epochs`."""
    batch_size: int = Field(8, gt=0)
    """Rows per forward pass on each process."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Forward passes per optimizer step. Global batch = batch_size × accumulation × processes."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate decay after warmup."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Fraction of steps spent warming the learning rate up linearly from 0."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (not applied to biases and norms)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW β1, β2."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; null disables clipping."""
    max_length: int = Field(512, gt=0)
    """Longest tokenized sequence (prompt + completion); longer rows are truncated."""
    logging_every: int = Field(10, gt=0)
    """Log metrics every N optimizer steps."""
    eval_every: int | None = Field(None, gt=0)
    """Evaluate on the eval split every N steps (always once at the end when an eval split exists)."""
    save_every: int | None = Field(None, gt=0)
    """Write a resumable checkpoint every N steps; a re-run resumes from the newest."""
    save_total_limit: int = Field(2, gt=0)
    """Checkpoints kept on disk (oldest deleted first)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (slower)."""
    lora: LoraSpec | None = None
    """Train a LoRA adapter instead of the full model; the stage then saves only the adapter."""
    seed: int | None = None
    """Seed for this stage; null uses the recipe's `seed`."""


class SFTConfig(TrainingArgs):
    """Supervised fine-tuning (the design of TRL's SFTTrainer)."""

    completion_only_loss: bool = True
    """For prompt-completion data, compute the loss on completion tokens only."""
    packing: bool = False
    """Concatenate rows into full `max_length` blocks (no padding waste). Rows keep their own loss
    masks; attention is not reset at row boundaries."""


class RewardConfig(TrainingArgs):
    """Reward-model training (the design of TRL's RewardTrainer): Bradley-Terry on preference pairs."""

    learning_rate: float = Field(1e-4, gt=0)
    """Peak learning rate of AdamW (TRL's RewardTrainer default)."""
    center_rewards_coefficient: float | None = Field(None, ge=0)
    """Adds coefficient × mean((r_chosen + r_rejected)²), keeping rewards centred on 0 (Eisenstein et al. 2023)."""
    use_margin: bool = True
    """Subtract a per-row `margin` column from the reward difference when the data has one."""


class DPOConfig(TrainingArgs):
    """Direct Preference Optimization (the design of TRL's DPOTrainer)."""

    learning_rate: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW (TRL's default; LoRA usually wants ~10× more)."""
    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL constraint to the reference (IPO: the regularisation τ)."""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid: DPO (Rafailov et al. 2023); ipo: IPO (Azar et al. 2023), length-normalised as TRL;
    hinge: SLiC (Zhao et al. 2023)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO (cDPO): assumed probability that a preference label is flipped (sigmoid only)."""
    rpo_alpha: float | None = Field(None, ge=0)
    """Adds rpo_alpha × NLL of the chosen completion (RPO, Pang et al. 2024); null disables."""
    reference_free: bool = False
    """Use no reference model (log-ratios against a uniform reference)."""
    precompute_ref_logps: bool = False
    """Compute the reference log-probs once before training and cache them on disk (a re-run reuses
    them); frees the reference model during training."""
    max_prompt_length: int | None = Field(None, gt=0)
    """Keep only the last N prompt tokens; null keeps the whole prompt (then `max_length` truncates)."""

    @model_validator(mode="after")
    def _check(self):
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"label_smoothing applies to loss_type 'sigmoid' only (got {self.loss_type!r}); set it to 0")
        if self.reference_free and self.precompute_ref_logps:
            raise ValueError("reference_free and precompute_ref_logps exclude each other: a reference-free run has no reference")
        return self
