"""Stage configs: one model per stage `kind`, joined in a discriminated union.

Every stage has an `id`, a `kind`, optional `needs` and `resources`, and kind-specific fields.
Fields listed in a kind's `refs` name other stages by id (or `base`, the recipe's model); the
validator checks that the named stage produces what the field needs (`refs` value).

To add a kind: write its model here (subclass `StageBase`, set `kind`, `produces`, `refs`), add it to
`STAGE_TYPES`, and add its runner to `alignpipe.stages.RUNNERS` and its task to `tasks/`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from alignpipe.engine.sampling import SamplingParams
from alignpipe.recipe.specs import Resources
from alignpipe.strict import Strict
from alignpipe.trainers.configs import DPOConfig, GRPOConfig, PPOConfig, RewardConfig, SFTConfig

# What a stage produces; a reference field accepts only stages producing what it asks for.
CAUSAL_LM = "causal_lm"
DATASET = "dataset"
REWARD_MODEL = "reward_model"
EVALUATION = "evaluation"
PUBLICATION = "publication"

STAGE_ID_PATTERN = r"^[a-z][a-z0-9_-]{0,63}$"
BASE = "base"  # reserved reference: the recipe's `model`


class StageBase(Strict):
    """Fields every stage has."""

    id: str = Field(pattern=STAGE_ID_PATTERN)
    """Unique name of the stage; other stages refer to its outputs by this id."""
    needs: list[str] = Field(default_factory=list)
    """Extra stages that must finish first (stages named in reference fields are implied)."""
    resources: Resources = Field(default_factory=Resources)
    """Where and how the stage runs (work pool, processes, retries)."""
    description: str = ""
    """Free text shown in `alignpipe show` and the model card."""

    produces: ClassVar[str] = ""
    refs: ClassVar[dict[str, str]] = {}

    def reference_fields(self) -> list[tuple[tuple, str, str]]:
        """(field path within the stage, stage id or `base` it names, product it needs) per reference."""
        return [((name,), getattr(self, name), wanted) for name, wanted in self.refs.items() if getattr(self, name) is not None]

    def references(self) -> dict[str, str]:
        """Reference field (dotted path) → stage id (or `base`) it names."""
        return {".".join(map(str, path)): target for path, target, _ in self.reference_fields()}

    def dependencies(self) -> list[str]:
        """Stages that must finish before this one: `needs` plus referenced stages."""
        deps = list(self.needs)
        for target in self.references().values():
            if target != BASE and target not in deps:
                deps.append(target)
        return deps


class FormatStage(StageBase):
    """Turn a raw dataset into a canonical training format with a train/eval split."""

    kind: Literal["format"] = "format"
    dataset: str
    """Name of an entry in the recipe's `datasets`."""
    format: Literal["language_modeling", "prompt_completion", "prompt_only", "preference"]
    """Canonical format to produce. language_modeling: `text`; prompt_completion: `prompt`,
    `completion`; prompt_only: `prompt`; preference: `prompt`, `chosen`, `rejected`."""
    chat_template: bool = False
    """Render rows as conversations with the tokenizer's chat template (plain strings become a
    user turn and an assistant turn; `messages` columns are used as they are)."""
    system_prompt: str | None = None
    """System message prepended to conversations (with `chat_template`)."""
    max_length: int | None = Field(512, gt=0)
    """Drop rows whose prompt + longest completion exceed this many tokens; null keeps all."""
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    """Fraction of rows held out as the eval split."""
    max_rows: int | None = Field(None, gt=0)
    """Use only the first N rows (after shuffling)."""
    shuffle: bool = True
    """Shuffle rows (with the recipe seed) before splitting."""

    produces: ClassVar[str] = DATASET


class SFTStage(StageBase, SFTConfig):
    """Supervised fine-tuning of a causal LM (full or LoRA)."""

    kind: Literal["sft"] = "sft"
    model: str = BASE
    """Model to start from: `base` or the id of a stage that produces a causal LM."""
    data: str
    """Id of a `format` stage with language_modeling or prompt_completion data."""

    produces: ClassVar[str] = CAUSAL_LM
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM, "data": DATASET}


class RewardStage(StageBase, RewardConfig):
    """Train a reward model (a one-output sequence classifier) on preference pairs."""

    kind: Literal["reward"] = "reward"
    model: str = BASE
    """Model to initialise from: `base` or a stage producing a causal LM (usually the SFT stage)."""
    data: str
    """Id of a `format` stage with preference data."""

    produces: ClassVar[str] = REWARD_MODEL
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM, "data": DATASET}


class DPOStage(StageBase, DPOConfig):
    """Align a causal LM on preference pairs with DPO (or IPO, hinge, RPO)."""

    kind: Literal["dpo"] = "dpo"
    model: str = BASE
    """Policy to start from (and reference): `base` or a stage producing a causal LM (usually `sft`)."""
    data: str
    """Id of a `format` stage with preference data."""

    produces: ClassVar[str] = CAUSAL_LM
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM, "data": DATASET}


class RewardFunctionSpec(Strict):
    """One reward function of an RL stage; exactly one of `function`, `reward_model`, `url`."""

    function: str | None = None
    """A built-in (`exact_match`, `keyword`, `regex`, `length_penalty`, `sentiment_lexicon`, `length`) or
    `module:function` taking (prompts, completions, **columns, **kwargs) → [float | None]."""
    reward_model: str | None = None
    """Id of a `reward` stage whose model scores prompt + completion."""
    url: str | None = None
    """A remote scorer: POST {"prompts", "completions", "columns"} → {"rewards": [...]}."""
    weight: float = 1.0
    """Weight in the summed reward."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for `function` (e.g. `{words: [great]}` for keyword)."""
    name: str | None = None
    """Label in metrics (rewards/<name>/mean); defaults to the function or stage name."""

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("function", "reward_model", "url") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of function, reward_model, url (got {given or 'none'})")
        return self


class _RLStage(StageBase):
    """Wiring shared by the online RL stages."""

    model: str = BASE
    """Policy to start from (and reference): `base` or a stage producing a causal LM (usually `sft`)."""
    data: str
    """Id of a `format` stage whose prompts are used (prompt_only, or any format with a prompt)."""
    rewards: list[RewardFunctionSpec] = Field(min_length=1)
    """Reward functions, summed with their weights."""

    produces: ClassVar[str] = CAUSAL_LM
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM, "data": DATASET}

    def reference_fields(self) -> list[tuple[tuple, str, str]]:
        own = super().reference_fields()
        return own + [(("rewards", i, "reward_model"), r.reward_model, REWARD_MODEL)
                      for i, r in enumerate(self.rewards) if r.reward_model]


class GRPOStage(_RLStage, GRPOConfig):
    """Online RL with group-relative advantages (GRPO / Dr. GRPO / DAPO variants)."""

    kind: Literal["grpo"] = "grpo"


class PPOStage(_RLStage, PPOConfig):
    """Online RL with PPO: policy, reference, value model and reward model(s)."""

    kind: Literal["ppo"] = "ppo"
    value_model: str | None = None
    """Id of a `reward` stage whose model initialises the value head; null uses the first reward model in `rewards`."""

    def reference_fields(self) -> list[tuple[tuple, str, str]]:
        own = super().reference_fields()
        return own + ([(("value_model",), self.value_model, REWARD_MODEL)] if self.value_model else [])

    @model_validator(mode="after")
    def _value_source(self):
        if not self.value_model and not any(r.reward_model for r in self.rewards):
            raise ValueError("PPO needs a value model: set `value_model:` to a reward stage id, "
                             "or include a `reward_model:` entry in `rewards`")
        return self


class JudgeStage(StageBase):
    """Generate from a candidate and a baseline on eval prompts and report the candidate's win rate."""

    kind: Literal["judge"] = "judge"
    candidate: str
    """Model to evaluate: a stage id (or `base`)."""
    baseline: str = BASE
    """Model to compare against: a stage id or `base`."""
    prompts: str
    """Id of a `format` stage whose prompts are used."""
    split: Literal["eval", "train"] = "eval"
    """Which split of `prompts` to judge on."""
    num_prompts: int = Field(64, gt=0)
    """Judge at most this many prompts."""
    reward: str = "sentiment_lexicon"
    """Scoring function: a built-in name (`sentiment_lexicon`, `length`, `exact_match`) or
    `module:function` taking (prompts, completions, **columns) and returning one float per completion."""
    reward_model: str | None = None
    """Id of a `reward` stage whose model scores the completions instead of `reward`."""
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=0.7))
    """Sampling used for both models."""
    batch_size: int = Field(32, gt=0)
    """Prompts per generation batch."""

    produces: ClassVar[str] = EVALUATION
    refs: ClassVar[dict[str, str]] = {"candidate": CAUSAL_LM, "baseline": CAUSAL_LM, "prompts": DATASET,
                                      "reward_model": REWARD_MODEL}


class PushStage(StageBase):
    """Publish a model (or LoRA adapter) with its tokenizer and a generated model card."""

    kind: Literal["push"] = "push"
    model: str
    """Id of the stage whose model is published."""
    target: Literal["hub", "local"] = "hub"
    """`hub`: upload to the Hugging Face Hub (token from HF_TOKEN; HF_ENDPOINT respected);
    `local`: write the same folder to `path`."""
    repo_id: str | None = None
    """Hub repository, e.g. `my-org/my-model` (target hub)."""
    path: str | None = None
    """Destination directory (target local); null means `<workdir>/<recipe name>/published/<stage id>`."""
    private: bool = False
    """Create the Hub repository as private."""
    revision: str | None = None
    """Hub branch to push to (created if missing); null pushes to main."""
    merge_adapter: bool = False
    """For a LoRA model, merge the adapter into the base weights and publish the full model."""
    license: str = "apache-2.0"
    """License in the model card's metadata."""
    tags: list[str] = Field(default_factory=list)
    """Extra tags for the model card's metadata."""

    produces: ClassVar[str] = PUBLICATION
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM}

    @model_validator(mode="after")
    def _target_fields(self):
        if self.target == "hub" and not self.repo_id:
            raise ValueError("target 'hub' needs `repo_id` (e.g. my-org/my-model); or set `target: local`")
        return self


STAGE_TYPES: tuple[type[StageBase], ...] = (FormatStage, SFTStage, RewardStage, DPOStage, GRPOStage, PPOStage, JudgeStage,
                                             PushStage)
STAGE_KINDS: dict[str, type[StageBase]] = {t.model_fields["kind"].default: t for t in STAGE_TYPES}

Stage = Annotated[Union[FormatStage, SFTStage, RewardStage, DPOStage, GRPOStage, PPOStage, JudgeStage, PushStage],
                  Field(discriminator="kind")]
