"""Hyperparameters of our trainers, as typed models. No torch import here: recipes validate fast.

Each trainer takes its own config (`SFTConfig`, ...). A recipe stage of that kind *is* that config
plus the stage's wiring (id, needs, which model and data it reads), see `alignpipe.recipe.stages`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from alignpipe.engine.sampling import SamplingParams
from alignpipe.judges.http_endpoints import variable_name
from alignpipe.strict import Strict
from alignpipe.tool_calls import ToolCallFormat


class LoraSpec(Strict):
    """Train a LoRA adapter (peft) instead of all weights."""

    r: int = Field(8, gt=0)
    """Rank of the update matrices."""
    alpha: float = Field(16.0, gt=0)
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt, or "all-linear" for every linear layer except the output head. The LM head cannot
    be adapted: the trainers compute it from its weight chunk by chunk, where an adapter would never train."""

    @field_validator("target_modules")
    @classmethod
    def _not_the_head(cls, value):
        if isinstance(value, list) and "lm_head" in value:
            raise ValueError(
                "lm_head cannot be a LoRA target: the trainers compute the LM head from its weight chunk by chunk, "
                "so an adapter on it would never train; remove lm_head from target_modules (all-linear leaves it out)"
            )
        return value


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
    shuffle: bool = True
    """Draw the training rows in a new random order each epoch (from the stage's seed); false keeps the data's
    order, e.g. a curriculum sorted easy to hard (TRL's `shuffle_dataset`). Several processes take turns at the
    rows either way."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate decay after warmup."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Fraction of steps spent warming the learning rate up linearly from 0."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (not applied to biases and norms)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW β1, β2."""
    low_precision_updates: Literal["kahan", "stochastic", "nearest"] = "kahan"
    """How AdamW adds its update to weights trained in bf16 or fp16 (`model.dtype`). kahan: with Kahan
    compensation, what each rounding drops carried into the next update, so small updates accumulate as in float32
    (+2 bytes a trained parameter). stochastic: each new bf16 weight rounded up or down at random, unbiased, no
    memory (fp16 weights take kahan). nearest: each update rounded to the nearest value, as torch's AdamW (and TRL
    on a bf16-loaded model) does: an update under ~1/512 of a weight is lost, which at 1e-6 learning rates (DPO,
    GRPO, PPO) leaves most weights where they started. Float32 weights (and LoRA adapters) are unaffected
    (`alignpipe/low_precision_adamw.py`)."""
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
    checkpoint_every_n_layers: int = Field(1, gt=0)
    """With `gradient_checkpointing`, checkpoint only decoder layers 0, N, 2N, …; the others keep their activations
    (lean ones, with `lean_activations`). About (N−1)/N of the recomputation saved for (N−1)/N of the memory
    checkpointing frees given back: the knob between the two when memory is left over (torchtitan's selective
    checkpointing per layer). 1 checkpoints every layer."""
    activation_offloading: bool = False
    """Keep the tensors the decoder saves for backward in pinned host memory until the backward needs them (TRL's
    `activation_offloading`): device memory for longer sequences, paid by copies over the host link, about
    `offloaded_gb` (logged per step) / its bandwidth more per step. With `gradient_checkpointing` only each layer's
    input moves, the pairing for long contexts. Needs a GPU (on the CPU it does nothing; `alignpipe/offload.py`)."""
    dataloader_workers: int | None = Field(None, ge=0)
    """Processes that tokenize and collate the next batches beside training (PyTorch's `DataLoader(num_workers=...)`,
    TRL's `dataloader_num_workers`). None: 1 on a CUDA device, whose step waits for its host wherever the host cannot
    stay ahead of the GPU (a DPO batch of 8 pairs of ~1,000 tokens takes ~20 ms to tokenize and ~4 to collate on one
    core of these machines, which TRL pays once before training instead), and 0 elsewhere (on a CPU the worker would
    take cores from the step itself). The batches and their order are the same either way."""
    disable_dropout: bool = True
    """Train with every dropout probability at 0 (dropout layers, LoRA's included, attention dropout, OPT's
    layerdrop), so the policy's log-probs are deterministic and equal the reference's at the start. TRL's default
    for reward, DPO, KTO and online DPO (and what its PPO always does); GRPO and RLOO default to false as TRL's;
    SFT keeps dropout. Models without dropout (Llama, Qwen2: 0 in their configs) are unaffected."""
    lean_activations: bool = True
    """Llama-, Qwen- and Mistral-shaped decoders keep fewer tensors for backward: each RMSNorm only its input (not
    a float32 copy), each SwiGLU MLP gate and up (silu(gate) recomputed). The same outputs and gradients
    (`alignpipe/lean_activations.py`). At Qwen2-0.5B's shape that is about 6.7 GB less per 16k-token micro-batch.
    Off under `compile` (inductor chooses what to keep) and `gradient_checkpointing` of every layer (nothing is
    kept)."""
    fused_kernels: bool = True
    """On a CUDA device, run the element-wise work between the matmuls as kernels `torch.compile` fuses while the
    layers stay eager: each SwiGLU product and rotary embedding (with `lean_activations`), the LM head's softmax
    and gradient per chunk (SFT's loss, DPO's and KTO's fused head) and its log-softmax per chunk in the
    reference's and old policy's scoring passes, one pass each instead of several over (tokens × intermediate) and
    (tokens × vocabulary) tensors. A few seconds of compilation in the first step; no effect on CPU
    (`alignpipe/fused_kernels.py`)."""
    compile: bool = False
    """`torch.compile` each decoder layer: fused element-wise kernels and fewer launches per step on a GPU, paid for
    by compilation in the first steps (offline trainers: SFT, reward, DPO, KTO). SFT also compiles its loss's
    softmax and gradient into one kernel per chunk of the LM head, DPO and KTO their fused head's log-sum-exp and
    gradient per group of answers (with `fused_loss: false`, their LM head's log-softmax chunks).
    docs/benchmarks.md has what it costs and buys."""
    lora: LoraSpec | None = None
    """Train a LoRA adapter instead of the full model; the stage then saves only the adapter."""
    seed: int | None = None
    """Seed for this stage; null uses the recipe's `seed`."""

    @model_validator(mode="after")
    def _layers_to_checkpoint(self):
        if self.checkpoint_every_n_layers > 1 and not self.gradient_checkpointing:
            raise ValueError(
                f"checkpoint_every_n_layers {self.checkpoint_every_n_layers} chooses which layers activation "
                "checkpointing recomputes, and gradient_checkpointing is off; set gradient_checkpointing: true, or "
                "drop checkpoint_every_n_layers"
            )
        return self


class RouterAuxArgs(Strict):
    """The load-balancing loss of Mixture-of-Experts models, for the stages TRL adds it in (SFT, DPO, KTO, GRPO,
    RLOO)."""

    router_aux_loss_coef: float | None = Field(None, ge=0)
    """Weight of a Mixture-of-Experts model's load-balancing loss (Switch Transformer's, as transformers computes
    it from each MoE layer's router logits) added to the training loss, logged as `aux_loss`. Null takes the
    model's own (its config's `router_aux_loss_coef`: 0.001 for Qwen3-MoE and Mixtral, 0.01 for OLMoE), so an MoE
    model trains with it by default, as in TRL; 0 turns it off. A dense model has none: a non-zero value fails
    there. Evaluation losses leave it out."""


class SFTConfig(TrainingArgs, RouterAuxArgs):
    """Supervised fine-tuning (the design of TRL's SFTTrainer)."""

    disable_dropout: bool = False
    """Train with every dropout probability at 0; SFT keeps the model's dropout by default (TRL's SFTTrainer)."""

    completion_only_loss: bool = True
    """For prompt-completion data, compute the loss on completion tokens only."""
    loss_type: Literal["nll", "dft"] = "nll"
    """nll: the usual cross-entropy; dft: Dynamic Fine-Tuning (Wu et al. 2025), each token's cross-entropy weighted by
    its probability (held constant), as TRL's `loss_type: dft`: tokens the model already finds likely lead the
    gradient. Also the eval loss's form."""
    assistant_only_loss: bool = False
    """For conversations (`language_modeling` data formatted from a `messages` column), compute the loss on the
    assistant replies only, each with the end-of-turn its template writes after it: every reply of a multi-turn
    conversation trains, no user or system turn does (TRL's `assistant_only_loss`). Needs a fast tokenizer."""
    neftune_noise_alpha: float | None = Field(None, gt=0)
    """NEFTune: uniform noise of magnitude alpha / sqrt(length × hidden) on the input embeddings in training only
    (Jain et al. 2023 use 5); null disables."""
    packing: bool = False
    """Put several rows into each `max_length` block (fewer padding tokens, fewer forward passes)."""
    packing_strategy: Literal["bfd", "wrapped"] = "bfd"
    """bfd: whole rows, best-fit decreasing, positions restarting at every row so each row attends to itself only
    and trains exactly as it would alone; wrapped: the rows concatenated and cut every `max_length` tokens (no
    padding at all, but attention crosses row boundaries and rows are split)."""


class RewardConfig(TrainingArgs):
    """Reward-model training (the design of TRL's RewardTrainer): Bradley-Terry on preference pairs."""

    learning_rate: float = Field(1e-4, gt=0)
    """Peak learning rate of AdamW (TRL's RewardTrainer default)."""
    center_rewards_coefficient: float | None = Field(None, ge=0)
    """Adds coefficient × mean((r_chosen + r_rejected)²), keeping rewards centred on 0 (Eisenstein et al. 2023)."""
    use_margin: bool = True
    """Subtract a per-row `margin` column from the reward difference when the data has one."""


DPOLossType = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "sigmoid_norm",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
]

F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
"""The loss types built on the chosen − rejected score difference: those `f_divergence_type` can change (TRL's)."""


class ReferenceSyncArgs(Strict):
    """A reference model that follows the policy (TR-DPO, Gorbatovski et al. 2024; TRL's `sync_ref_model`), for the
    stages that keep a frozen copy of the starting model as their reference (DPO, KTO, GRPO and RLOO)."""

    sync_ref_model: bool = False
    """Every `ref_model_sync_steps` optimizer steps, move the reference towards the policy:
    π_ref ← α·π_θ + (1 − α)·π_ref. The synced reference is saved in each checkpoint, so a resumed run continues from
    it. Needs a full-model stage with a reference copy (not `lora`, whose reference is the base weights under the
    adapter)."""
    ref_model_mixup_alpha: float = Field(0.6, gt=0, le=1)
    """α of the update (TRL's default; the TR-DPO paper finds 0.5–0.6 best for soft updates); 1 copies the policy."""
    ref_model_sync_steps: int = Field(512, gt=0)
    """Optimizer steps between two updates of the reference (TRL's default; the paper uses 256–512 for α = 1 and
    ~8–32 for soft ones)."""

    def _no_reference_copy(self) -> str | None:
        """Why this stage keeps no frozen reference copy to sync, if it keeps none."""
        if getattr(self, "lora", None):
            return "lora is set: the reference is the base model under the adapter"
        if getattr(self, "beta", None) == 0:
            return "beta is 0, so no reference model is loaded"
        return None

    @model_validator(mode="after")
    def _sync_needs_a_copy(self):
        why = self._no_reference_copy() if self.sync_ref_model else None
        if why:
            raise ValueError(
                f"sync_ref_model mixes the policy into a frozen copy of the starting model, and this stage keeps "
                f"none ({why}); drop sync_ref_model or change that setting"
            )
        return self


class DPOConfig(TrainingArgs, ReferenceSyncArgs, RouterAuxArgs):
    """Direct Preference Optimization (the design of TRL's DPOTrainer)."""

    learning_rate: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW (TRL's default; LoRA usually wants ~10× more)."""
    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL constraint to the reference (IPO: the regularisation τ)."""
    loss_type: DPOLossType | list[DPOLossType | Literal["sft"]] = "sigmoid"
    """The pair's loss, or a list of losses summed with `loss_weights` (MPO, Wang et al. 2024: e.g. [sigmoid,
    bco_pair, sft]; `sft` is the NLL of the chosen completions, per token over the batch), each as TRL 1.16 computes
    it (tested against TRL's): sigmoid: DPO (Rafailov et al. 2023);
    hinge: SLiC (Zhao et al. 2023); ipo: IPO (Azar et al. 2023), log-ratios per completion token as TRL;
    sigmoid_norm: DPO on those per-token log-ratios; robust: rDPO (Chowdhury et al. 2024), unbiased under
    `label_smoothing` flipped labels; exo_pair: EXO (Ji et al. 2024), needs `label_smoothing` > 0 (the paper uses
    1e-3); nca_pair: NCA (Chen et al. 2024); bco_pair: BCO's pairwise form (Jung et al. 2024); sppo_hard: SPPO with
    hard labels (Wu et al. 2024); apo_zero / apo_down: APO (D'Oosterlinck et al. 2024), for chosen answers better /
    worse than the model's own; discopop: DiscoPOP (Chris Lu et al. 2024), see `discopop_tau`. TRL's batch-sorted
    `aot` losses are not offered: they couple the pairs of a batch, and the fused head computes a few pairs at a time."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Assumed probability that a preference label is flipped: conservative DPO (cDPO) with sigmoid, rDPO's
    correction with robust, EXO's ε with exo_pair; other loss types take none."""
    loss_weights: list[float] | None = None
    """Weights of a list of `loss_type`s, one each; null: 1 each."""
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    """The divergence that regularises the policy towards the reference (f-DPO, Wang et al. 2023): each completion's
    log-ratio u enters the loss as f'(e^u): reverse_kl u (DPO), forward_kl 1 − e^−u, js_divergence log 2 + log σ(u),
    alpha_divergence (e^((α−1)u) − 1)/(α−1). For the loss types built on the score difference only: sigmoid,
    sigmoid_norm, hinge, ipo, exo_pair, robust, discopop (and sft, which it does not touch)."""
    f_alpha_divergence_coef: float = 0.5
    """α of `alpha_divergence` (TRL's default); 1 is reverse_kl's limit."""
    use_weighting: bool = False
    """WPO (Zhou et al. 2024): weigh each pair's loss by how likely the policy finds both answers, each answer's
    exp(mean over its tokens of log p − log Σ_v p_v²), detached, so that off-policy preference data counts as if
    sampled from the policy (TRL's option). Runs the chunked LM head."""
    ld_alpha: float | None = Field(None, ge=0, le=1)
    """LD-DPO (Liu et al. 2024): of each pair, the tokens past the shorter completion's length count α times in both
    log-probs (policy and reference), damping the length bias of DPO; 1 weighs them fully (plain DPO), 0 ignores them.
    Runs the chunked LM head (the fused one sums whole completions). null: off."""
    discopop_tau: float = Field(0.05, gt=0)
    """DiscoPOP's temperature: how fast the loss blends from logistic to exponential as the margin grows (TRL's
    default)."""
    rpo_alpha: float | None = Field(None, ge=0)
    """Adds rpo_alpha × NLL of the chosen completion (RPO, Pang et al. 2024); null disables."""
    reference_free: bool = False
    """Use no reference model (log-ratios against a uniform reference)."""
    precompute_ref_logps: bool = False
    """Compute the reference log-probs once before training and cache them on disk (a re-run reuses
    them); frees the reference model during training."""
    precompute_ref_batch_size: int | None = Field(None, gt=0)
    """Pairs per batch of that pass (it keeps nothing for backward, so larger batches than `batch_size` fit);
    null uses `batch_size`."""
    max_prompt_length: int | None = Field(None, gt=0)
    """Keep only the last N prompt tokens; null keeps the whole prompt (then `max_length` truncates)."""
    fused_loss: bool = True
    """Form the LM head's gradients in the forward, a group of chosen/rejected pairs at a time
    (`alignpipe/linear_sequence_loss.py`): 3 head matmuls per answer token instead of the recomputing chunked head's
    4. Taken where the batch's logits are too large to keep for backward (over 256 MB of float32, as at GPU batch
    sizes; smaller ones run whole, 3 matmuls as well). Holds one pair's float32 logits at once (2 × 512 answer
    tokens × a 152k vocabulary: 0.6 GB); a pair over 1 GB of them takes the chunked head. false: the chunked head
    always (its chunks compiled under `compile`)."""

    @property
    def loss_types(self) -> list[str]:
        return list(self.loss_type) if isinstance(self.loss_type, list) else [self.loss_type]

    @property
    def weighted_losses(self) -> list[tuple[str, float]]:
        """The pair losses and their weights (`sft` left out: see `nll_weight`)."""
        weights = self.loss_weights or [1.0] * len(self.loss_types)
        return [(t, w) for t, w in zip(self.loss_types, weights, strict=True) if t != "sft"]

    @property
    def nll_weight(self) -> float | None:
        """The weight of the chosen completions' NLL in the loss: `rpo_alpha`, or the `sft` loss type's."""
        if self.rpo_alpha is not None:
            return self.rpo_alpha
        weights = self.loss_weights or [1.0] * len(self.loss_types)
        return next((w for t, w in zip(self.loss_types, weights, strict=True) if t == "sft"), None)

    @model_validator(mode="after")
    def _check(self):
        types = self.loss_types
        if not types or len(set(types)) != len(types):
            raise ValueError(f"loss_type lists each loss once, and at least one (got {types})")
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} weights for {len(types)} loss types {types}: one each"
            )
        if "sft" in types and self.rpo_alpha is not None:
            raise ValueError("rpo_alpha and the `sft` loss type both add the chosen NLL: keep one of them")
        if self.f_divergence_type != "reverse_kl" and not set(types) <= set(F_DIVERGENCE_LOSS_TYPES):
            raise ValueError(
                f"f_divergence_type {self.f_divergence_type!r} changes the loss types built on the score difference "
                f"only ({', '.join(F_DIVERGENCE_LOSS_TYPES)}); got {types}: use reverse_kl with these"
            )
        smoothed = {"sigmoid", "robust", "exo_pair"}
        if self.label_smoothing and not set(types) & smoothed:
            raise ValueError(
                f"label_smoothing applies to loss_type sigmoid, robust and exo_pair only (got {self.loss_type!r}); "
                "set it to 0"
            )
        if "exo_pair" in types and not self.label_smoothing:
            raise ValueError(
                "loss_type 'exo_pair' needs label_smoothing > 0 (its ε; log ε is infinite at 0); the EXO paper uses 1e-3"
            )
        if self.reference_free and self.precompute_ref_logps:
            raise ValueError(
                "reference_free and precompute_ref_logps exclude each other: a reference-free run has no reference"
            )
        return self

    def _no_reference_copy(self) -> str | None:
        if self.reference_free:
            return "reference_free is set"
        if self.precompute_ref_logps:
            return "precompute_ref_logps computes the reference's log-probs once, before training"
        return super()._no_reference_copy()


class KTOConfig(TrainingArgs, ReferenceSyncArgs, RouterAuxArgs):
    """Kahneman-Tversky Optimization on unpaired thumbs-up/down data (the design of TRL's KTOTrainer)."""

    learning_rate: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW (TRL's default; LoRA usually wants ~10× more)."""
    batch_size: int = Field(8, gt=0)
    """Completions per micro-batch; at least 2 with loss_type kto, whose KL reference point is estimated from the
    batch's completions paired with the other prompts of the same batch."""
    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL constraint to the reference."""
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: KTO (Ethayarajh et al. 2024) against a KL reference point; apo_zero_unpaired: APO-zero (D'Oosterlinck
    et al. 2024) without one, for desirable data believed better than the model's own outputs."""
    desirable_weight: float = Field(1.0, gt=0)
    """Weight of the desirable (label true) completions' losses; raise it when they are the minority (the KTO paper
    keeps desirable_weight × desirable rows / (undesirable_weight × undesirable rows) within [1, 4/3])."""
    undesirable_weight: float = Field(1.0, gt=0)
    """Weight of the undesirable (label false) completions' losses."""
    max_prompt_length: int | None = Field(None, gt=0)
    """Keep only the last N prompt tokens; null keeps the whole prompt (then `max_length` truncates)."""
    precompute_ref_logps: bool = False
    """Compute the reference's log-probs of every completion, and of its KL partner, once before training and cache
    them on disk (a re-run reuses them): no reference pass per step and, for a full model, no reference copy in
    memory. Each row's KL partner is then fixed as TRL fixes it: the completion of the row before it in its chunk of
    `batch_size` rows, in the data's order; without it the partners are the shuffled batch's, rotated by one."""
    precompute_ref_batch_size: int | None = Field(None, gt=0)
    """Rows per batch of that pass (it keeps nothing for backward, so larger batches than `batch_size` fit); null
    uses `batch_size`. The KL partners stay those of `batch_size` chunks."""
    fused_loss: bool = True
    """Form the LM head's gradients in the forward, completions grouped up to 256 MB of float32 logits
    (`alignpipe/linear_sequence_loss.py`; each completion's loss depends on its own log-prob, the KL reference point
    being detached): 3 head matmuls per completion token instead of the recomputing chunked head's 4. Taken where
    the batch's logits are too large to keep for backward, as at GPU batch sizes. false: the chunked head always."""

    def _no_reference_copy(self) -> str | None:
        if self.precompute_ref_logps:
            return "precompute_ref_logps computes the reference's log-probs once, before training"
        return super()._no_reference_copy()

    @model_validator(mode="after")
    def _check_kto(self):
        if self.loss_type == "kto" and self.batch_size < 2:
            raise ValueError(
                f"loss_type 'kto' needs batch_size >= 2 (got {self.batch_size}): its KL reference point pairs each "
                "completion with another prompt of the same batch; raise batch_size or use apo_zero_unpaired"
            )
        return self


class RolloutSpec(Strict):
    """Which generation engine produces rollouts."""

    backend: Literal["hf", "vllm"] = "hf"
    """hf: transformers `generate` on the policy itself (CPU or GPU); vllm: a vLLM engine."""
    mode: Literal["colocate", "server"] = "colocate"
    """vllm only. colocate: a vLLM `LLM` inside the training process, weights pushed after each
    optimizer step; server: completions from a running `vllm serve` (OpenAI-compatible) endpoint."""
    server_url: str | None = None
    """vllm server mode: base URL, e.g. http://127.0.0.1:8000 (the model served there is what samples)."""
    api_key_env: str | None = Field(None, json_schema_extra={"may_hold_a_secret": True})
    """vllm server mode: the name of the environment variable holding the key the server was started with
    (`vllm serve --api-key`), sent as `Authorization: Bearer`. Read where the stage runs; the key itself is never in
    the recipe, a log or MLflow. null: no key."""
    sync: Literal["none", "adapter"] = "none"
    """vllm server mode: how the server's sampler follows the policy. none: the served weights sample as they are
    (the server's own business: a judge, or a run that reloads them itself); adapter: a LoRA policy's adapter is
    saved before each rollout and loaded into the server through vLLM's runtime LoRA API (`/v1/load_lora_adapter`),
    and the rollout asks for it by name, so every rollout samples from the policy being trained. The server serves
    the stage's starting model with `--enable-lora --max-lora-rank` ≥ `lora.r` and
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in its environment; it reads the adapter from `adapter_dir`."""
    adapter_dir: str | None = None
    """vllm server mode with `sync: adapter`: the folder the adapter is saved to and the server reads it from (by
    the same path). Null: `rollout-adapter/` in the stage's folder, which a server on the same machine reads; a server
    on another machine needs a folder both mount at the same path. Only the adapter loaded last is kept there."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """vllm server mode: the `--logprobs-mode` the server was started with (vLLM's default is raw_logprobs: the raw
    model's, before temperature and filters). processed_logprobs: each sampled token's log-prob under the
    distribution it was drawn from, which `sampling_correction` and `off_policy_mask_threshold` use (and `auto`
    then corrects, as with the colocate engine); `validate` asks the server whether its log-probs follow the
    temperature. Needs a server that returns the sampled token ids (vLLM ≥ 0.10.2)."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """vllm colocate: fraction of GPU memory vLLM may take."""
    sleep_between_rollouts: bool = True
    """vllm colocate: put vLLM to sleep during training steps to free its memory (vLLM ≥ 0.7)."""
    max_model_len: int | None = Field(None, gt=0)
    """vllm colocate: the longest sequence (prompt + completion) vLLM sizes its KV cache for (TRL's
    `vllm_max_model_length`). Null: the stage's longest prompt (cut to `max_prompt_length`) plus
    `max_completion_length`, within the model's positions; with tools, whose turns grow a completion, the model's own
    context. The model's whole context (128k for Llama 3.1) may need more KV cache than `gpu_memory_utilization`
    leaves, which vLLM refuses at start."""
    batch_size: int = Field(64, gt=0)
    """hf: prompts per `generate` call."""
    static_cache: bool = False
    """hf: decode with a KV cache of fixed size and the same shapes at every step (transformers' StaticCache): nothing
    re-allocated per token; the same tokens as the default loop (tested). Like it, it prefills each prompt once for
    its `num_generations` samples. (Both loops ask the GPU every 4 steps whether every row has ended and read each
    answer at the next ask, so a check does not leave the GPU idle.) On a GPU `cuda_graphs` implies it."""
    cuda_graphs: bool = True
    """hf on a CUDA device: the static-cache decode step recorded as a CUDA graph (`torch.cuda.CUDAGraph`) at each
    rollout and replayed for every token: one launch per token instead of a few hundred kernels issued from Python
    (~8 ms of host work per token for a 24-layer model, more than a 0.5B model's GPU work). A recording costs about
    two eager steps of host time and no compilation, so each rollout records its own and frees its static KV cache
    and graph when it ends (the training step gets the memory back). Same tokens as the eager loop (the recording's
    plumbing is tested on CPU; `bench.gpu_checks` compares it on a GPU). A step that cannot be recorded, or whose first replay's logits are off from the eager step's, warns once
    and the eager static step runs from then on. Needs a model whose decode steps take a ready padding mask (SDPA or
    `varlen` attention, no sliding-window layers); others decode eagerly. No effect on CPU."""
    compile: bool = False
    """hf: the static-cache decode step compiled with `torch.compile(mode="reduce-overhead")` (inductor's fused
    kernels, on a GPU recorded as a CUDA graph) instead of `cuda_graphs`' recording of the eager step. Implies
    `static_cache`. The first rollout of each shape pays the compilation (tens of seconds or more on a GPU); prompts
    are left-padded to a power of two (64 at least) never below the widest so far, so a run compiles for a few
    shapes, and their static caches stay allocated between rollouts. Same tokens as the eager loop (tested on CPU),
    with the same fallback as `cuda_graphs`. Its GPU speed is not measured yet."""

    _a_variable_s_name = field_validator("api_key_env")(variable_name)

    @model_validator(mode="after")
    def _check(self):
        if self.backend == "vllm" and self.mode == "server" and not self.server_url:
            raise ValueError("rollout mode 'server' needs `server_url` (e.g. http://127.0.0.1:8000)")
        if self.max_model_len is not None and (self.backend != "vllm" or self.mode != "colocate"):
            raise ValueError(
                "rollout `max_model_len` sizes a vLLM colocate engine's KV cache; the hf engine and a vLLM server "
                "size their own: remove it, or set `backend: vllm` with `mode: colocate`"
            )
        if self.sync != "none" and (self.backend, self.mode) != ("vllm", "server"):
            raise ValueError(
                f"rollout `sync: {self.sync}` keeps a vLLM server's sampler on the policy; the hf engine samples from "
                "the policy itself and a colocate engine gets its weights pushed after every step: remove `sync`, or "
                "set `backend: vllm` with `mode: server`"
            )
        if self.api_key_env is not None and (self.backend, self.mode) != ("vllm", "server"):
            raise ValueError(
                "rollout `api_key_env` is a vLLM server's key (`mode: server`); the hf and colocate engines run in "
                "the stage's process: remove it"
            )
        if self.logprobs_mode != "raw_logprobs" and (self.backend, self.mode) != ("vllm", "server"):
            raise ValueError(
                "rollout `logprobs_mode` is what a vLLM server was started with (`vllm serve --logprobs-mode`); the hf "
                "and colocate engines give the sampler's log-probs themselves: remove it"
            )
        if self.adapter_dir is not None and self.sync != "adapter":
            raise ValueError("rollout `adapter_dir` is where `sync: adapter` saves the adapter: set `sync: adapter`")
        if self.backend == "vllm" and (self.compile or self.static_cache):
            raise ValueError(
                "rollout `compile` and `static_cache` are options of the hf engine; vLLM captures its own CUDA graphs"
            )
        return self


class OnlineRLArgs(TrainingArgs):
    """Knobs GRPO and PPO share."""

    compares_samples: ClassVar[bool] = False
    """Whether the trainer learns from differences between several completions of one prompt (GRPO, RLOO, online
    DPO): greedy sampling makes them identical."""

    @model_validator(mode="after")
    def _no_compile(self):
        if self.compile:
            raise ValueError(
                "compile: true is for offline stages (sft, reward, dpo, kto): rollouts run the same layers with a "
                "KV cache that grows every token, which would recompile them; for faster rollouts set "
                "`rollout: {static_cache: true}` or `rollout: {backend: vllm}`"
            )
        return self

    @model_validator(mode="after")
    def _adapter_sync_needs_an_adapter(self):
        if self.rollout.sync == "adapter" and self.lora is None:
            raise ValueError(
                "rollout `sync: adapter` loads the policy's LoRA adapter into the vLLM server, and this stage trains "
                "every weight (no `lora`): set `lora: {r: 16, alpha: 32}` to train an adapter, or sample with "
                "`mode: colocate`, which takes the full weights after every step"
            )
        return self

    @model_validator(mode="after")
    def _sampling_fits_rollouts(self):
        s = self.sampling
        # Compared with the default, not with the fields the user set: a stage process validates the recipe again
        # from its dump, where every field is set.
        default = SamplingParams.model_fields["max_new_tokens"].default
        if s.max_new_tokens not in (default, self.max_completion_length):
            raise ValueError(
                f"sampling.max_new_tokens ({s.max_new_tokens}) is not what rollouts use: their length is "
                f"max_completion_length ({self.max_completion_length}); set max_completion_length and drop "
                "sampling.max_new_tokens"
            )
        if s.greedy and self.compares_samples:
            raise ValueError(
                "sampling.temperature: 0 decodes greedily, so a prompt's completions are all the same and there is "
                "no difference between them to learn from (every advantage or preference is void); use a "
                "temperature above 0 (TRL's default is 1.0)"
            )
        return self

    max_prompt_length: int | None = Field(256, gt=0)
    """Keep only the last N prompt tokens."""
    max_completion_length: int = Field(64, gt=0)
    """Most tokens generated per completion."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling for rollouts; the same temperature divides the logits in training."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Generation engine."""
    sample_every: int = Field(10, gt=0)
    """Every N steps, log a table of (prompt, completion, reward) and print it."""
    logprob_chunk_tokens: int = Field(4096, gt=0)
    """Tokens per chunk when computing log-probs (bounds the full-vocabulary logits held at once)."""


class GenerationBatchArgs(OnlineRLArgs):
    """Knobs GRPO and RLOO share: how many optimizer steps one generation batch feeds (TRL's `steps_per_generation`
    / `generation_batch_size`)."""

    steps_per_generation: int | None = Field(None, gt=0)
    """Micro-batches (forward/backward passes of `batch_size` completions) each generation batch is cut into, as TRL
    counts them: a multiple of `gradient_accumulation_steps`, so a generation batch feeds whole optimizer steps.
    Larger generation batches keep the engine busier (fewer, bigger rollouts); the steps after the first train
    off-policy, corrected by importance ratios against the log-probs taken at generation. null: one optimizer
    step per generation batch (= gradient_accumulation_steps)."""
    generation_batch_size: int | None = Field(None, gt=0)
    """The same in completions per process: steps_per_generation × batch_size. Set one of the two."""
    num_generations_eval: int | None = Field(None, gt=0)
    """How the held-out prompts are scored (at `eval_every` and at the end). null: one greedy completion each, its
    reward as eval/reward. N: N completions each, sampled with the training `sampling` as TRL's evaluation samples
    them; eval/reward is their mean, with eval/reward_std and eval/rewards/<fn>/mean."""
    max_tool_calling_iterations: int | None = Field(None, gt=0)
    """With tools (listed on the data's format stage): the most rounds of tool calls per completion (TRL's); null:
    until the model answers without a call or the completion reaches max_completion_length."""
    tool_call_format: ToolCallFormat = "auto"
    """How a turn's tool calls are read. hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
    (Hermes, Qwen2.5, Qwen3 and most tool-tuned open models); tokenizer: the tokenizer's own response parser
    (transformers' `parse_response`); auto: the tokenizer's where it has one, else hermes."""

    @model_validator(mode="after")
    def _generation_batch(self):
        batch, accumulation = self.batch_size, self.gradient_accumulation_steps
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ValueError("steps_per_generation and generation_batch_size say the same thing: set one of them")
        if self.generation_batch_size is not None and self.generation_batch_size % batch:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be a multiple of batch_size ({batch}): "
                "a generation batch is cut into micro-batches of batch_size completions"
            )
        micro = self.micro_batches_per_generation
        if micro % accumulation:
            raise ValueError(
                f"a generation batch of {micro} micro-batches (steps_per_generation, or generation_batch_size / "
                f"batch_size) does not feed whole optimizer steps of gradient_accumulation_steps = {accumulation}: "
                f"use a multiple of {accumulation}"
            )
        return self

    @property
    def micro_batches_per_generation(self) -> int:
        if self.generation_batch_size is not None:
            return self.generation_batch_size // self.batch_size
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps each generation batch feeds (before `num_iterations` repeats them)."""
        return self.micro_batches_per_generation // self.gradient_accumulation_steps


class GRPOConfig(GenerationBatchArgs, ReferenceSyncArgs, RouterAuxArgs):
    """Group Relative Policy Optimization (the design of TRL's GRPOTrainer)."""

    compares_samples: ClassVar[bool] = True
    disable_dropout: bool = False
    """Train with every dropout probability at 0 (see `TrainingArgs.disable_dropout`); off by default, as TRL's."""

    learning_rate: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW (TRL's default)."""
    batch_size: int = Field(8, gt=0)
    """Completions per forward pass on each process (= prompts × num_generations, as in TRL)."""
    num_generations: int = Field(8, ge=2)
    """Completions sampled per prompt (the group)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """With several reward functions: sum_then_normalize weighs and sums them, then forms group advantages
    (`scale_rewards`); normalize_then_sum (GDPO) normalises each function within each group first, so one with a
    large scale does not drown the others, sums them with their weights and whitens the sum over the batch
    (`scale_rewards` does not apply)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """The policy loss and how its tokens are aggregated, as TRL 1.16 (tested against TRL's). The clipped surrogate
    with grpo: per-sequence mean, then mean; bnpo: mean over the micro-batch's tokens; dr_grpo: sum / (sequences ×
    max_completion_length); dapo: sum / tokens of the whole accumulated batch; luspo (needs
    `importance_sampling_level: sequence`): each completion's sum, then mean. cispo (MiniMax-M1): the importance
    ratio clipped at `epsilon_high` (required; ScaleRL recommends 5.0) and detached, weighting A·log π, aggregated as
    dapo. sapo (Soft Adaptive Policy Optimization): a soft gate (4/τ)·σ(τ(ρ − 1)) instead of the clip, τ =
    `sapo_temperature_pos` / `_neg` by the sign of the advantage, aggregated as grpo. vespo (VESPO): no clip; each
    completion's policy gradient A·∇log π weighted by a smooth gamma function φ(w) = e^λ·w^k·e^(−λw) of its
    sequence importance weight w (`vespo_k_*`, `vespo_lambda_*` by the sign of the advantage), aggregated as dapo."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: an importance ratio per token; sequence: one per completion, the exponential of its mean token
    log-ratio (GSPO, Zheng et al. 2025; with `loss_type: grpo` as in the paper, or `luspo`)."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """sapo: the gate's temperature for tokens with a positive advantage (TRL's default)."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """sapo: the gate's temperature for tokens with a non-positive advantage (TRL's default)."""
    vespo_k_pos: float = Field(2.0, ge=0)
    """vespo: the power k for non-negative advantages: how fast weights below 1 are damped (TRL's default)."""
    vespo_lambda_pos: float = Field(3.0, ge=0)
    """vespo: the decay λ for non-negative advantages: how fast weights above 1 are damped (TRL's default)."""
    vespo_k_neg: float = Field(3.0, ge=0)
    """vespo: k for negative advantages (TRL's default)."""
    vespo_lambda_neg: float = Field(2.0, ge=0)
    """vespo: λ for negative advantages (TRL's default)."""
    delta: float | None = Field(None, gt=1)
    """Cap the unclipped ratio at `delta` too (two-sided clipping, INTELLECT-2; above 1 + `epsilon_high`), so a token
    with a negative advantage cannot pull with an unbounded ratio; null: the usual one-sided clip."""
    cast_lm_head_to_fp32: bool = False
    """Keep the LM head of the policy and its reference in float32 (the ScaleRL recipe, Khatri et al. 2025; TRL's
    option): the head's weight is trained in float32 and its logits computed from the decoder's output cast up,
    in the rollouts and in the loss alike, which narrows the gap between the probabilities tokens were sampled
    with and those the loss reads in a bf16 model. Nothing changes for a float32 model. A head tied to the input
    embeddings (Qwen2.5 up to 3B) is cast with them, and the saved model keeps the head in float32."""
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)
    """Train the policy term on the highest-entropy tokens only: this fraction of the micro-batch's completion tokens
    by entropy (Wang et al. 2025 recommend 0.2; TRL's ρ); 1 keeps all. The KL term stays on every token."""
    epsilon: float = Field(0.2, gt=0)
    """Lower clipping range of the importance ratio."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clipping range (DAPO's clip-higher); null uses `epsilon`."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient (k3 estimator against the reference); 0 loads no reference model."""
    kl_importance_correction: bool = True
    """Weight the per-token KL by the importance ratio π/π_old, which makes its gradient unbiased for
    samples drawn from π_old (TRL's `use_bias_correction_kl`, on by default there too)."""
    num_iterations: int = Field(1, gt=0)
    """Optimizer steps per generation batch (μ); > 1 reuses rollouts with importance ratios."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_completion_length without EOS from the loss."""
    sampling_correction: Literal[
        "auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "auto"
    """Correct for the engine sampling from a slightly different distribution than the trainer's forward computes
    (other kernels, bf16 rounding, a KV cache): weigh the policy term by π_old/π_sampler, the trainer's log-probs at
    generation against the engine's (TRL's `vllm_importance_sampling_correction` / `_mode`). token_*: a weight per
    token; sequence_*: one per completion, from its summed log-ratio; *_truncate clamps weights into
    [`sampling_correction_min`, `sampling_correction_max`] (TIS), *_mask zeroes those outside it (MIS). Costs one
    forward of the rollout under the current policy when no other setting takes it. auto: TRL's default,
    sequence_mask, with the vLLM colocate engine and a vLLM server of `logprobs_mode: processed_logprobs`; none with
    the hf engine (the trainer's own forward samples) and a server of raw log-probs (vLLM's default), which the
    correction cannot use."""
    sampling_correction_min: float | None = Field(None, ge=0)
    """Lower bound of the correction's weights (TRL's `vllm_importance_sampling_clip_min`); null: none."""
    sampling_correction_max: float | None = Field(3.0, gt=0)
    """Upper bound of the correction's weights (TRL's `vllm_importance_sampling_clip_max`, 3.0); null: none."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: subtract this × the mean entropy of the trained tokens from the loss, keeping the policy from
    collapsing to near-deterministic outputs (the same for every loss type, as TRL's); 0: none. With
    `use_adaptive_entropy`, the starting coefficient."""
    use_adaptive_entropy: bool = False
    """Adapt the bonus each optimizer step (Skywork-OR1; TRL's): raise the coefficient by `entropy_coef_delta` while
    the step's mean entropy is at or below `entropy_target`, lower it otherwise, within [`entropy_coef_min`,
    `entropy_coef_max`]; the bonus applies only while the last step's entropy is at or below the target."""
    entropy_coef_min: float = Field(0.0, ge=0)
    """Lower bound of the adaptive coefficient."""
    entropy_coef_max: float = Field(1.0, ge=0)
    """Upper bound of the adaptive coefficient."""
    entropy_coef_delta: float = Field(0.005, gt=0)
    """Step of the adaptive coefficient per optimizer step."""
    entropy_target: float = Field(0.2, ge=0)
    """The mean per-token entropy (nats) the adaptive control holds the policy above (TRL's default; language
    models sample at 2-10 nats, so it acts only on a collapsing policy)."""
    off_policy_mask_threshold: float | None = Field(None, ge=0)
    """Drop completions with a negative advantage whose mean per-token KL from the sampling distribution to the
    current policy exceeds this (DeepSeek-V3.2's off-policy sequence mask; TRL's name); needs the engine's sampling
    log-probs (a vLLM server only with `logprobs_mode: processed_logprobs`). null: off."""

    @property
    def correction(self) -> str:
        """The sampling correction this run applies (`sampling_correction` with auto resolved)."""
        if self.sampling_correction != "auto":
            return self.sampling_correction
        return "sequence_mask" if self.rollout.backend == "vllm" and self.engine_gives_sampling_logprobs else "none"

    @property
    def engine_gives_sampling_logprobs(self) -> bool:
        """Whether the rollout engine can give each sampled token's log-prob under the distribution it was drawn
        from: the hf and colocate engines always, a vLLM server started with `--logprobs-mode processed_logprobs`."""
        r = self.rollout
        return (r.backend, r.mode) != ("vllm", "server") or r.logprobs_mode == "processed_logprobs"

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss has an entropy bonus (an adaptive one may start at 0)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    @property
    def needs_sampling_logprobs(self) -> bool:
        return self.correction != "none" or self.off_policy_mask_threshold is not None

    @model_validator(mode="after")
    def _sampling_correction(self):
        if self.needs_sampling_logprobs and not self.engine_gives_sampling_logprobs:
            raise ValueError(
                "sampling_correction and off_policy_mask_threshold need the log-prob of each sampled token under the "
                "distribution it was drawn from, and a vLLM server gives the raw model's unless started with "
                "`--logprobs-mode processed_logprobs`: start it so and set rollout `logprobs_mode: processed_logprobs`, "
                "use rollout mode 'colocate' or backend 'hf', or set sampling_correction: none and "
                "off_policy_mask_threshold: null"
            )
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({self.entropy_coef_min}) is above entropy_coef_max ({self.entropy_coef_max})"
            )
        low, high = self.sampling_correction_min, self.sampling_correction_max
        if low is not None and high is not None and low >= high:
            raise ValueError(f"sampling_correction_min ({low}) must be below sampling_correction_max ({high})")
        if self.correction.endswith("truncate") and low is None and high is None:
            raise ValueError(
                f"sampling_correction {self.correction!r} clamps the weights into [min, max] and both are null: "
                "set sampling_correction_max (TRL uses 3.0) or sampling_correction_min"
            )
        return self

    @model_validator(mode="after")
    def _loss_needs(self):
        if self.multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards != "group":
            raise ValueError(
                "multi_objective_aggregation 'normalize_then_sum' normalises each reward within its group and the sum "
                f"over the batch; scale_rewards ({self.scale_rewards!r}) does not apply: leave it at 'group'"
            )
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise ValueError(
                "loss_type 'vespo' forms each completion's importance weight itself from its token log-ratios: leave "
                "importance_sampling_level at 'token'"
            )
        if self.loss_type == "vespo" and self.correction.startswith("sequence"):
            raise ValueError(
                f"loss_type 'vespo' folds the sampling correction into its sequence weights token by token: use "
                f"sampling_correction token_truncate or token_mask (or none), not {self.correction!r} (with the vLLM "
                "colocate engine, `auto` means sequence_mask)"
            )
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise ValueError("loss_type 'luspo' is GSPO's sequence-level loss: set importance_sampling_level: sequence")
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ValueError(
                "loss_type 'cispo' clips the importance ratio at epsilon_high, an absolute bound rather than 1 + ε: "
                "set epsilon_high (ScaleRL recommends 5.0)"
            )
        return self


class RLOOConfig(GenerationBatchArgs, ReferenceSyncArgs, RouterAuxArgs):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024; the design of TRL 1.16's RLOOTrainer): k completions per prompt,
    each one's baseline the mean reward of its k − 1 siblings, no value model."""

    compares_samples: ClassVar[bool] = True
    disable_dropout: bool = False
    """Train with every dropout probability at 0 (see `TrainingArgs.disable_dropout`); off by default, as TRL's."""

    learning_rate: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW (TRL's default)."""
    batch_size: int = Field(8, gt=0)
    """Completions per forward pass on each process (= prompts × num_generations)."""
    num_generations: int = Field(4, ge=2)
    """k, the completions sampled per prompt; the leave-one-out baseline needs at least 2."""
    beta: float = Field(0.05, ge=0)
    """Coefficient of the KL penalty subtracted from each completion's reward: beta × Σ_t (log π_old − log π_ref)
    over its tokens (first-order, as the RLOO paper and TRL); 0 loads no reference model."""
    epsilon: float = Field(0.2, gt=0)
    """Lower clipping range of the sequence-level importance ratio."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clipping range; null uses `epsilon`."""
    normalize_advantages: bool = False
    """Whiten the advantages over the batch (mean 0, std 1)."""
    reward_clip_range: tuple[float, float] | None = None
    """Clip rewards to [low, high] before the KL penalty and the baseline; null disables."""
    num_iterations: int = Field(1, gt=0)
    """Optimizer steps per generation batch; > 1 reuses rollouts with importance ratios."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_completion_length without EOS from the loss."""

    @model_validator(mode="after")
    def _check_rloo(self):
        if self.reward_clip_range is not None and self.reward_clip_range[0] >= self.reward_clip_range[1]:
            raise ValueError(
                f"reward_clip_range must be [low, high] with low < high (got {list(self.reward_clip_range)})"
            )
        return self


class PPOConfig(OnlineRLArgs):
    """PPO for RLHF with the "N+ implementation details" (the design of TRL ≤ 1.12's PPOTrainer), with the
    controls of TRL 0.7's `PPOConfig` under their names there: adaptive KL control (`adap_kl_ctrl`, `target`,
    `horizon`), `kl_penalty`, score scaling / normalisation / clipping, `ratio_threshold` and
    `early_stopping` on `target_kl`. Each new control is off by default (a run behaves as before)."""

    learning_rate: float = Field(3e-6, gt=0)
    """Peak learning rate of AdamW (TRL's PPO default)."""
    batch_size: int = Field(8, gt=0)
    """Episodes (prompt + response) per forward pass on each process."""
    num_mini_batches: int = Field(1, gt=0)
    """Mini-batches per PPO epoch; rollout batch = batch_size × accumulation × num_mini_batches."""
    num_ppo_epochs: int = Field(4, gt=0)
    """Passes over each rollout batch (TRL 0.7's `ppo_epochs`)."""
    kl_coef: float = Field(0.05, ge=0)
    """Coefficient of the per-token KL penalty in the reward; with `adap_kl_ctrl` its starting value
    (TRL 0.7's `init_kl_coef`)."""
    kl_penalty: Literal["kl", "abs", "mse", "k3", "full"] = "kl"
    """Per-token KL penalty, with r = log π(token) − log π_ref(token) of the sampled token: `kl` r (Schulman's k1,
    unbiased, can be negative); `abs` |r|; `mse` ½ r² (k2); `k3` exp(−r) − 1 + r (unbiased, ≥ 0, lower variance);
    `full` Σ_v π(v)·(log π(v) − log π_ref(v)), the exact KL of the two next-token distributions from the logits
    (one more head pass per token). kl/abs/mse/full are TRL 0.7's `kl_penalty` values; `k3` is TRL 1.x's."""
    adap_kl_ctrl: bool = False
    """Adapt `kl_coef` after every rollout batch toward the KL `target` (Ziegler et al. 2019):
    kl_coef ×= 1 + clip(KL / target − 1, −0.2, 0.2) · episodes / horizon, KL being `objective/kl` (summed over a
    response, averaged over the batch). TRL 0.7 defaults to on; here off, so `kl_coef` stays fixed."""
    target: float = Field(6.0, gt=0)
    """KL per response the adaptive controller steers toward (nats; `adap_kl_ctrl` only)."""
    horizon: float = Field(10000.0, gt=0)
    """Episodes over which the adaptive controller closes a proportional error (`adap_kl_ctrl` only): each batch of N
    episodes moves `kl_coef` by at most a factor 1 ± 0.2·N/horizon."""
    use_score_scaling: bool = False
    """Divide each score by the running standard deviation of all scores seen so far (TRL 0.7's RunningMoments,
    eps = float32 epsilon); applied after `missing_eos_penalty`, before `score_clip`."""
    use_score_norm: bool = False
    """With `use_score_scaling`, also subtract the running mean: scores become (s − mean) / std."""
    score_clip: float | None = Field(None, gt=0)
    """Clip (scaled) scores to [−score_clip, score_clip]; null disables."""
    ratio_threshold: float | None = Field(None, gt=1)
    """Skip a micro-batch whose mean importance ratio π/π_old over its response tokens exceeds this (its loss is
    zeroed, as TRL 0.7 does; an optimizer step whose every micro-batch was skipped is not taken). Logged as
    `policy/skipped_batches`. TRL 0.7 used 10; null disables."""
    early_stopping: bool = False
    """Stop a rollout batch's PPO epochs once the policy KL to the rollout policy, mean(log π_old − log π) over the
    last mini-batch of an epoch, exceeds 1.5 × `target_kl` (TRL 0.7's rule). Logged as `policy/ppo_epochs` and
    `policy/early_stopped`."""
    target_kl: float | None = Field(None, gt=0)
    """The policy-KL bound of `early_stopping` (TRL 0.7's default was 1)."""
    cliprange: float = Field(0.2, gt=0)
    """Policy ratio clipping."""
    cliprange_value: float = Field(0.2, gt=0)
    """Value prediction clipping around the rollout values."""
    vf_coef: float = Field(0.1, ge=0)
    """Value-loss coefficient."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE λ."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards over response tokens (keeping their mean) before GAE."""
    missing_eos_penalty: float | None = Field(None, ge=0)
    """Subtract this from the score of responses that never produced EOS."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "kl_estimator" in data:
            old = data["kl_estimator"]
            new = {"k1": "kl", "k3": "k3"}.get(old, "kl")
            raise ValueError(
                f"`kl_estimator` was merged into `kl_penalty`: replace `kl_estimator: {old}` with "
                f"`kl_penalty: {new}` (k1 is `kl`, k2 is `mse`)"
            )
        return data

    @model_validator(mode="after")
    def _check(self):
        if self.early_stopping and self.target_kl is None:
            raise ValueError(
                "`early_stopping: true` needs `target_kl` (the policy KL above which, ×1.5, a batch's "
                "PPO epochs stop; TRL 0.7 used 1): add e.g. `target_kl: 1.0`, or set `early_stopping: false`"
            )
        if self.use_score_norm and not self.use_score_scaling:
            raise ValueError(
                "`use_score_norm` applies only with `use_score_scaling: true` (the running mean is subtracted "
                "from scaled scores): add `use_score_scaling: true`, or remove `use_score_norm`"
            )
        return self


class OnlineDPOConfig(OnlineRLArgs):
    """Online DPO (Guo et al. 2024; the design of TRL's OnlineDPOTrainer): each step samples two completions per
    prompt from the current policy, a ranker picks the better one, and the DPO loss trains on that fresh pair."""

    compares_samples: ClassVar[bool] = True

    learning_rate: float = Field(5e-7, gt=0)
    """Peak learning rate of AdamW (TRL's default)."""
    batch_size: int = Field(8, gt=0)
    """Prompts per micro-batch (each sampled twice, as TRL's `per_device_train_batch_size`)."""
    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL constraint to the reference (IPO: the regularisation τ)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO; ipo: IPO on the summed log-ratios (as TRL's OnlineDPOTrainer)."""
    missing_eos_penalty: float | None = Field(None, ge=0)
    """Subtracted from the score of a completion that hit `max_completion_length` without EOS (reward ranking)."""
