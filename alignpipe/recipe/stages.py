"""Stage configs: one model per stage `kind`, joined in a discriminated union.

Every stage has an `id`, a `kind`, optional `needs` and `resources`, and kind-specific fields.
Fields listed in a kind's `refs` name other stages by id (or `base`, the recipe's model); the
validator checks that the named stage produces what the field needs (`refs` value).

To add a kind: write its model here (subclass `StageBase`, set `kind`, `produces`, `refs`), add it to
`STAGE_TYPES`, write its runner as `alignpipe/stages/<kind>.py` (a `run(ctx)` function, listed in
`alignpipe.stages.KINDS`), and give it Prefect-side hooks in `tasks/hooks.py` if it needs any (the task itself is
made for every kind).
"""

from __future__ import annotations

import re
from itertools import combinations
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from alignpipe.engine.sampling import SamplingParams
from alignpipe.judges.http_endpoints import variable_name
from alignpipe.judges.pairwise import DEFAULT_TEMPLATE as DEFAULT_JUDGE_TEMPLATE
from alignpipe.judges.rewards import BUILTIN_OPTIONS, TOKEN_REWARDS, check_builtin_kwargs, check_reward_name
from alignpipe.recipe.specs import Resources
from alignpipe.strict import Strict
from alignpipe.tool_calls import ToolCallFormat
from alignpipe.trainers.configs import (
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    OnlineDPOConfig,
    PPOConfig,
    RewardConfig,
    RLOOConfig,
    SFTConfig,
)
from alignpipe.user_code import check_callable_name

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
    kind: str
    """What the stage does: format, sft, reward, dpo, kto, grpo, rloo, ppo, online_dpo, judge or push (each kind's model fixes it)."""
    needs: list[str] = Field(default_factory=list)
    """Extra stages that must finish first (stages named in reference fields are implied)."""
    resources: Resources = Field(default_factory=Resources)
    """Where and how the stage runs (work pool, processes, retries)."""
    description: str = ""
    """Free text shown in `alignpipe show` and the model card."""
    when: str | None = None
    """Promotion gate on upstream metrics, e.g. `judge.win_rate >= 0.55 and judge.ci_low > 0.5`; when it is
    false the stage (and what depends on it) is skipped, not failed. Operators: < <= > >= == != and or not ( )."""

    produces: ClassVar[str] = ""

    @field_validator("when")
    @classmethod
    def _parse_when(cls, value):
        if value is not None:
            from alignpipe.gates import GateError, parse

            try:
                parse(value)
            except GateError as e:
                raise ValueError(f"bad condition: {e}") from None
        return value

    def gate_stages(self) -> set[str]:
        """Stages whose metrics the `when` condition reads."""
        return {stage for stage, _ in self.gate_refs()}

    def gate_refs(self) -> list[tuple[str, str]]:
        """(stage id, metric) of each reference in the `when` condition."""
        if not self.when:
            return []
        from alignpipe.gates import parse, refs_in

        return [(ref.stage, ref.metric) for ref in refs_in(parse(self.when))]

    refs: ClassVar[dict[str, str]] = {}

    def reference_fields(self) -> list[tuple[tuple, str, str]]:
        """(field path within the stage, stage id or `base` it names, product it needs) per reference."""
        return [
            ((name,), getattr(self, name), wanted)
            for name, wanted in self.refs.items()
            if getattr(self, name) is not None
        ]

    def named_models(self) -> list[tuple[tuple, str]]:
        """(field path within the stage, value) of the fields that name a causal LM by a stage id, `base`, a path or
        a Hub id (a judge's models); the first two are references, the others are loaded as they are."""
        return []

    def references(self) -> dict[str, str]:
        """Reference field (dotted path) → stage id (or `base`) it names."""
        return {".".join(map(str, path)): target for path, target, _ in self.reference_fields()}

    def dependencies(self) -> list[str]:
        """Stages that must finish before this one: `needs` plus referenced stages."""
        deps = list(self.needs)
        for target in [*self.references().values(), *sorted(self.gate_stages())]:
            if target != BASE and target not in deps:
                deps.append(target)
        return deps


class FormatStage(StageBase):
    """Turn a raw dataset, or a mixture of several, into a canonical training format with a train/eval split."""

    kind: Literal["format"] = "format"
    dataset: str | list[str]
    """Name of an entry in the recipe's `datasets`, or a list of names to mix: each dataset's columns are mapped by
    its own `columns`, and their rows are concatenated (all of each, or `dataset_weights`' shares) before
    `shuffle`, `max_rows` and the train/eval split. A column other than the format's that only some of them have is
    dropped, with a warning."""
    dataset_weights: list[float] | None = None
    """With a list of datasets, each one's share of the mixture, in their order (normalised to sum to 1): the mixture
    is the largest one that takes no dataset's row twice, each dataset giving round(share × size) rows, drawn at
    random with the recipe's seed (its first rows with `shuffle: false`), as TRL's dataset mixtures' `fraction`.
    null: every row of every dataset."""
    format: Literal["language_modeling", "prompt_completion", "prompt_only", "preference", "unpaired"]
    """Canonical format to produce. language_modeling: `text`; prompt_completion: `prompt`,
    `completion`; prompt_only: `prompt`; preference: `prompt`, `chosen`, `rejected`; unpaired: `prompt`,
    `completion`, `label` (true/false; preference rows split into chosen → true, rejected → false)."""
    chat_template: bool = False
    """Render rows as conversations with the tokenizer's chat template (plain strings become a
    user turn and an assistant turn; `messages` columns are used as they are)."""
    system_prompt: str | None = None
    """System message prepended to conversations (with `chat_template`)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Variables of the chat template, passed to every rendering (TRL's `chat_template_kwargs`), e.g.
    `{enable_thinking: false}` for Qwen3's template to leave reasoning out of prompts and replies."""
    tools: list[str] = Field(default_factory=list)
    """Functions the model may call, `package.module:function` each (type hints on every parameter and a docstring
    with an `Args:` section: the chat template renders them into every prompt as JSON schemas). Needs
    `chat_template: true` and a template that renders tool calls (`model.chat_template`, e.g. Qwen2.5/Qwen3's).
    `grpo` and `rloo` stages trained on these prompts run the model's calls during rollouts and feed the results
    back (`max_tool_calling_iterations`, `tool_call_format`); the tool results do not train."""
    max_length: int | None = Field(512, gt=0)
    """Drop rows whose prompt + longest completion exceed this many tokens; null keeps all."""
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    """Fraction of rows held out as the eval split."""
    max_rows: int | None = Field(None, gt=0)
    """Use only the first N rows (after shuffling)."""
    shuffle: bool = True
    """Shuffle rows (with the recipe seed) before splitting."""
    truncate_prompts: int | None = Field(None, gt=0)
    """prompt_only: cut each prompt to its first N tokens (the text up to the end of token N, as written), before
    `max_length`. For prompts that are the openings of longer texts, as in TRL's IMDB sentiment examples; without
    it, `max_length` drops every prompt longer than itself. Plain prompts only (not `chat_template`)."""

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, tools: list[str]) -> list[str]:
        for spec in tools:
            check_callable_name(spec, "tool")
        if len(set(tools)) != len(tools):
            raise ValueError(f"each tool is listed once, got {tools}")
        return tools

    @property
    def dataset_names(self) -> list[str]:
        """The datasets this stage reads, in their order (one, or a mixture's)."""
        return [self.dataset] if isinstance(self.dataset, str) else list(self.dataset)

    @model_validator(mode="after")
    def _mixture(self):
        names = self.dataset_names
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a dataset mixture lists each dataset once, and at least one (got {names})")
        weights = self.dataset_weights
        if weights is None:
            return self
        if isinstance(self.dataset, str):
            raise ValueError(
                f"dataset_weights gives each dataset of a mixture its share, and `dataset` names one ({names[0]!r}): "
                "list the datasets to mix, or drop dataset_weights"
            )
        if len(weights) != len(names):
            raise ValueError(
                f"dataset_weights gives each dataset of the mixture its share, one each in the order of `dataset`: "
                f"got {len(weights)} weight(s) for {names}"
            )
        if any(w <= 0 for w in weights):
            raise ValueError(f"dataset_weights must all be above 0 (got {weights}); leave a dataset out to skip it")
        return self

    @model_validator(mode="after")
    def _tools_in_chat(self):
        if self.tools and not self.chat_template:
            raise ValueError(
                "tools are rendered into prompts by the chat template: set `chat_template: true` (with a template "
                "that renders tool calls)"
            )
        return self

    @model_validator(mode="after")
    def _truncation_of_plain_prompts(self):
        if self.truncate_prompts is not None and (self.format != "prompt_only" or self.chat_template):
            raise ValueError(
                "truncate_prompts cuts plain prompt_only prompts (openings of texts); cutting a completion's prompt "
                "or a chat-rendered one would cut the template or the text the completion continues"
            )
        return self

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


class KTOStage(StageBase, KTOConfig):
    """Align a causal LM on unpaired good/bad completions with KTO (or APO-zero)."""

    kind: Literal["kto"] = "kto"
    model: str = BASE
    """Policy to start from (and reference): `base` or a stage producing a causal LM (usually `sft`)."""
    data: str
    """Id of a `format` stage with unpaired data (`format: unpaired`)."""

    produces: ClassVar[str] = CAUSAL_LM
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM, "data": DATASET}


class RewardFunctionSpec(Strict):
    """One reward function of an RL stage; exactly one of `function`, `reward_model`, `url`."""

    function: str | None = None
    """A built-in (`exact_match`, `math_answer`, `keyword`, `regex`, `length_penalty`, `sentiment_lexicon`, `length`) or
    `module:function` taking (prompts, completions, **columns, **kwargs) → [float | None]."""
    reward_model: str | None = None
    """Id of a `reward` stage whose model scores prompt + completion."""
    url: str | None = None
    """A remote scorer: POST {"prompts", "completions", "columns"} → {"rewards": [...]}."""
    api_key_env: str | None = Field(None, json_schema_extra={"may_hold_a_secret": True})
    """`url` only: the name of the environment variable holding the scorer's API key (e.g. `SCORER_API_KEY`), sent
    as `Authorization: Bearer`. Read where the stage runs (a pool's workers need it set); the key itself is never in
    the recipe, a log or MLflow. null: no key."""
    weight: float = 1.0
    """Weight in the summed reward."""
    kwargs: dict[str, Any] = Field(default_factory=dict, validate_default=True)  # a built-in may require some
    """Extra keyword arguments for `function` (e.g. `{words: [great]}` for keyword); a built-in's are checked:
    `keyword` takes `words` (required) and `case_sensitive`, `regex` `pattern` (required), `length_penalty` `target`
    and `scale`, `math_answer` `last_number_fallback`, the others none."""
    name: str | None = None
    """Label in metrics (rewards/<name>/mean); defaults to the function or stage name."""

    @field_validator("function")
    @classmethod
    def _known_function(cls, v: str | None) -> str | None:
        return v if v is None else check_reward_name(v)

    @field_validator("kwargs")
    @classmethod
    def _options_of_the_function(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "function" not in info.data:  # it failed its own check, reported on its own
            return v
        function = info.data["function"]
        if function in BUILTIN_OPTIONS:
            check_builtin_kwargs(function, v)
        elif v and not function:
            raise ValueError("kwargs are passed to a `function` only; a reward model or URL takes none")
        return v

    _a_variable_s_name = field_validator("api_key_env")(variable_name)

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("function", "reward_model", "url") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of function, reward_model, url (got {given or 'none'})")
        if self.api_key_env is not None and not self.url:
            raise ValueError("api_key_env is a remote scorer's (`url`) key; a function or reward model takes none")
        return self

    @property
    def label(self) -> str:
        """The name its values are logged under: `name`, else the function's, the reward stage's, or `remote`."""
        if self.name:
            return self.name
        if self.function:
            return self.function.split(":")[-1]
        return self.reward_model or "remote"


def _distinct_labels(rewards: list[RewardFunctionSpec]) -> list[RewardFunctionSpec]:
    labels = [r.label for r in rewards]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(
            f"two rewards would be logged as {', '.join(map(repr, twice))} (rewards/<name>/mean); give each its own "
            "`name:`"
        )
    return rewards


class _RLStage(StageBase):
    """Wiring shared by the online RL stages."""

    model: str = BASE
    """Policy to start from (and reference): `base` or a stage producing a causal LM (usually `sft`)."""
    data: str
    """Id of a `format` stage whose prompts are used (prompt_only, or any format with a prompt)."""
    rewards: list[RewardFunctionSpec] = Field(min_length=1)
    """Reward functions, summed with their weights."""

    _distinct_rewards = field_validator("rewards")(_distinct_labels)

    produces: ClassVar[str] = CAUSAL_LM
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM, "data": DATASET}

    def reference_fields(self) -> list[tuple[tuple, str, str]]:
        own = super().reference_fields()
        return own + [
            (("rewards", i, "reward_model"), r.reward_model, REWARD_MODEL)
            for i, r in enumerate(self.rewards)
            if r.reward_model
        ]


class GRPOStage(_RLStage, GRPOConfig):
    """Online RL with group-relative advantages (GRPO / Dr. GRPO / DAPO variants)."""

    kind: Literal["grpo"] = "grpo"


class RLOOStage(_RLStage, RLOOConfig):
    """Online RL with REINFORCE leave-one-out baselines: k completions per prompt, no value model."""

    kind: Literal["rloo"] = "rloo"


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
            raise ValueError(
                "PPO needs a value model: set `value_model:` to a reward stage id, "
                "or include a `reward_model:` entry in `rewards`"
            )
        return self


class LLMJudgeSpec(Strict):
    """A pairwise LLM judge; exactly one of `model`, `url`."""

    model: str | None = None
    """Judge model: a stage id, `base`, a local directory or a Hub id (transformers, greedy)."""
    url: str | None = None
    """Base URL of an OpenAI-compatible server (`vllm serve`'s `http://host:8000`, or a hosted API's
    `https://api.openai.com/v1`: a trailing /v1 is the same server), judged through /v1/chat/completions."""
    served_model: str | None = None
    """Endpoint only: the model to ask, as the server names it (`gpt-4o-mini`, vLLM's `--served-model-name`);
    null: the first model the server lists at /v1/models."""
    api_key_env: str | None = Field(None, json_schema_extra={"may_hold_a_secret": True})
    """Endpoint only: the name of the environment variable holding its API key (e.g. `OPENAI_API_KEY`), sent as
    `Authorization: Bearer`. Read where the stage runs (a pool's workers need it set); the key itself is never in the
    recipe, a log or MLflow. null: no key (a local `vllm serve`)."""
    concurrency: int = Field(16, gt=0)
    """Endpoint only: requests in flight at once. A server batches them (vLLM's throughput grows with it); a hosted
    API's rate limit may want fewer (a 429 is retried after its Retry-After)."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """Judge prompt with {prompt}, {response_a} and {response_b}; the judge answers A or B."""
    max_new_tokens: int = Field(8, gt=0)
    """Tokens the judge may write."""
    chat_template: bool = True
    """Local judge: send the filled template as a user turn through the judge tokenizer's chat template (when it has
    one), as an endpoint's server does with every chat request; false sends the raw text (base-model judges)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Variables of the judge's chat template, e.g. `{enable_thinking: false}` so that a Qwen3 judge answers at
    once instead of reasoning past `max_new_tokens`: rendered locally, or sent to the endpoint as its
    `chat_template_kwargs` (vLLM's server reads them)."""

    _a_variable_s_name = field_validator("api_key_env")(variable_name)

    @model_validator(mode="after")
    def _check(self):
        if bool(self.model) == bool(self.url):
            raise ValueError("give exactly one of `model` (local judge) or `url` (OpenAI-compatible endpoint)")
        # by value, not `model_fields_set`: a stage process validates the dumped recipe, every default written out
        endpoint_only = [
            k
            for k in ("served_model", "api_key_env", "concurrency")
            if getattr(self, k) != type(self).model_fields[k].default
        ]
        if self.model and endpoint_only:
            raise ValueError(
                f"{', '.join(endpoint_only)}: an endpoint judge's (`url`) settings; a local judge (`model`) is loaded "
                "here and takes none"
            )
        missing = [k for k in ("{prompt}", "{response_a}", "{response_b}") if k not in self.template]
        if missing:
            raise ValueError(f"template is missing {', '.join(missing)}")
        return self


class OnlineDPOStage(StageBase, OnlineDPOConfig):
    """Online DPO: two fresh completions per prompt each step, ranked by `rewards` or a pairwise `llm_judge`."""

    kind: Literal["online_dpo"] = "online_dpo"
    model: str = BASE
    """Policy to start from (and reference): `base` or a stage producing a causal LM (usually `sft`)."""
    data: str
    """Id of a `format` stage whose prompts are used (prompt_only, or any format with a prompt)."""
    rewards: list[RewardFunctionSpec] = Field(default_factory=list)
    """Rank the two completions by these reward functions' weighted sum (a reward model, a function, a URL)."""

    _distinct_rewards = field_validator("rewards")(_distinct_labels)
    llm_judge: LLMJudgeSpec | None = None
    """Rank them with a pairwise LLM judge instead (both orders; a disagreement is a tie, which does not train)."""

    produces: ClassVar[str] = CAUSAL_LM
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM, "data": DATASET}

    @model_validator(mode="after")
    def _one_ranker(self):
        if bool(self.rewards) == bool(self.llm_judge):
            raise ValueError(
                "online_dpo needs exactly one ranker for its two completions per prompt: `rewards` (e.g. "
                "[{reward_model: rm}] or [{function: my_pkg.rewards:score}]) or `llm_judge` ({model: ...} or {url: ...})"
                + (", not both" if self.rewards else "")
            )
        return self

    def reference_fields(self) -> list[tuple[tuple, str, str]]:
        own = super().reference_fields()
        own += [
            (("rewards", i, "reward_model"), r.reward_model, REWARD_MODEL)
            for i, r in enumerate(self.rewards)
            if r.reward_model
        ]
        return own + [(path, value, CAUSAL_LM) for path, value in self.named_models() if not is_model_path(value)]

    def named_models(self) -> list[tuple[tuple, str]]:
        return [(("llm_judge", "model"), self.llm_judge.model)] if self.llm_judge and self.llm_judge.model else []


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def is_model_path(value: str) -> bool:
    """A judge model given as a path or Hub id (stage ids never contain '/')."""
    return "/" in value


class JudgeStage(StageBase):
    """Compare models on eval prompts: win rates with Wilson intervals, per pair and as a matrix."""

    kind: Literal["judge"] = "judge"
    candidate: str | list[str]
    """Model(s) to evaluate: stage ids, `base`, or model paths / Hub ids."""
    baseline: str | list[str] = BASE
    """Model(s) to compare against (same forms). Every candidate is judged against every baseline; with
    more than two models in all, every pair is judged and the full win-rate matrix is reported."""
    prompts: str | None = None
    """Id of a `format` stage whose prompts are used."""
    prompts_file: str | None = None
    """Instead of `prompts`: a .jsonl/.json/.csv/.parquet file with a `prompt` column (extra columns go to
    the reward function)."""
    split: Literal["eval", "train"] = "eval"
    """Which split of `prompts` to judge on."""
    num_prompts: int = Field(64, gt=0)
    """Judge at most this many prompts."""
    reward: str = "sentiment_lexicon"
    """Scoring function: a built-in name (`sentiment_lexicon`, `length`, `exact_match`, `math_answer`, ...) or
    `module:function` taking (prompts, completions, **columns) and returning one float per completion."""
    reward_model: str | None = None
    """Id of a `reward` stage whose model scores the completions instead of `reward`."""
    llm_judge: LLMJudgeSpec | None = None
    """A pairwise LLM judge instead of a scoring function (both orders; disagreement = tie)."""
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=0.7))
    """Sampling used for every judged model."""
    batch_size: int = Field(32, gt=0)
    """Prompts per generation batch."""
    max_tool_calling_iterations: int | None = Field(None, gt=0)
    """When the prompts' format stage offers tools, every model calls them as in training: at most this many rounds
    per answer (null: until it answers without a call or reaches `sampling.max_new_tokens`)."""
    tool_call_format: ToolCallFormat = "auto"
    """How a turn's tool calls are read (as the RL stages' `tool_call_format`)."""

    produces: ClassVar[str] = EVALUATION
    refs: ClassVar[dict[str, str]] = {"prompts": DATASET, "reward_model": REWARD_MODEL}
    # The metrics of its first pair (`judge/<name>`); the rates are also reported per pair.
    RATES: ClassVar[tuple[str, ...]] = ("win_rate", "ci_low", "ci_high")
    COUNTS: ClassVar[tuple[str, ...]] = ("wins", "ties", "losses")
    SCORES: ClassVar[tuple[str, ...]] = ("candidate_score", "baseline_score")  # scoring functions only
    JUDGED: ClassVar[tuple[str, ...]] = ("unreadable_rate",)  # LLM judges only

    @property
    def candidates(self) -> list[str]:
        return _as_list(self.candidate)

    @property
    def baselines(self) -> list[str]:
        return _as_list(self.baseline)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """(candidate, baseline) pairs judged: every candidate against every baseline, and with more than two models
        in all every other pair too (the win-rate matrix needs them)."""
        models = list(dict.fromkeys(self.candidates + self.baselines))
        pairs = [(c, b) for c in self.candidates for b in self.baselines if c != b]
        if len(models) > 2:
            pairs += [(a, b) for a, b in combinations(models, 2) if (a, b) not in pairs and (b, a) not in pairs]
        return pairs

    def reports_metric(self, metric: str) -> bool:
        """Whether a run of this stage reports `metric` as a `when:` condition names it: `win_rate` (or
        `judge/win_rate`), `ci_low`, `ci_high`, `wins`, `ties`, `losses`; with a scoring function (not an LLM judge)
        `candidate_score`, `baseline_score` and `score/<model>`; with an LLM judge `unreadable_rate` (the share of
        its answers naming neither A nor B); per pair `<candidate>_vs_<baseline>/win_rate`, `.../ci_low`,
        `.../ci_high` (and `.../unreadable_rate`)."""
        name = metric.removeprefix("judge/")
        if name in (*self.RATES, *self.COUNTS):
            return True
        scored = self.llm_judge is None
        if name in self.SCORES:
            return scored
        if name in self.JUDGED:
            return not scored
        if name.startswith("score/"):  # a model may be a path, slashes and all
            return scored and name.removeprefix("score/") in self.candidates + self.baselines
        head, _, leaf = name.rpartition("/")
        per_pair = self.RATES + (() if scored else self.JUDGED)
        return leaf in per_pair and head in {f"{c}_vs_{b}" for c, b in self.pairs}

    def reference_fields(self) -> list[tuple[tuple, str, str]]:
        own = super().reference_fields()
        return own + [(path, value, CAUSAL_LM) for path, value in self.named_models() if not is_model_path(value)]

    def named_models(self) -> list[tuple[tuple, str]]:
        named: list[tuple[tuple, str]] = []
        for field in ("candidate", "baseline"):
            value = getattr(self, field)
            named += [((field,) if isinstance(value, str) else (field, i), v) for i, v in enumerate(_as_list(value))]
        if self.llm_judge and self.llm_judge.model:
            named.append((("llm_judge", "model"), self.llm_judge.model))
        return named

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, v: str) -> str:
        name = check_reward_name(v)
        if name in TOKEN_REWARDS:
            raise ValueError(
                f"reward {name!r} counts the completion's tokens, which a judge does not keep: it is for RL stages' "
                "`rewards`; judge with a reward model, a function of the text, or an LLM judge"
            )
        return name

    @model_validator(mode="after")
    def _prompts_source(self):
        if bool(self.prompts) == bool(self.prompts_file):
            raise ValueError(
                "give exactly one of `prompts` (a format stage id) or `prompts_file` (a file with a prompt column)"
            )
        return self


class RegisterSpec(Strict):
    """Register the published model in the MLflow model registry."""

    name: str
    """Registered model name."""
    alias: str = "champion"
    """Alias moved to the new version (from whichever version had it)."""


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
    """Hub branch to push to (created if missing); null pushes to main. `{run_id}` and `{date}` are filled
    in, so `run-{date}-{run_id}` gives every pipeline run its own branch."""
    merge_adapter: bool = False
    """For a LoRA model, merge the adapter into the base weights and publish the full model."""
    license: str = "apache-2.0"
    """License in the model card's metadata."""
    tags: list[str] = Field(default_factory=list)
    """Extra tags for the model card's metadata."""
    token_secret: str | None = Field(None, json_schema_extra={"may_hold_a_secret": True})
    """Name of a Prefect Secret block holding the Hub token (e.g. `hub-token`); null reads HF_TOKEN from the
    environment. The pipeline flow checks the block when it starts (it exists, holds a token, and the Hub lets that
    token write `repo_id`). The token reaches the push process through its environment only: never a parameter, log
    or artifact."""
    registry: RegisterSpec | None = None
    """Also register the published model in the MLflow model registry and move `alias` to it."""

    produces: ClassVar[str] = PUBLICATION
    refs: ClassVar[dict[str, str]] = {"model": CAUSAL_LM}

    @field_validator("token_secret")
    @classmethod
    def _a_block_s_name(cls, v: str | None) -> str | None:
        """Prefect's rule for block names. A value that breaks it is not repeated: it may be the token itself."""
        if v is not None and not re.fullmatch(r"[a-z0-9-]+", v):
            raise ValueError(
                "token_secret is the name of a Prefect Secret block (lowercase letters, digits and dashes, e.g. "
                "hub-token), not the token: save the token in that block (`Secret(value=<token>).save('hub-token')`)"
            )
        return v

    @model_validator(mode="after")
    def _target_fields(self):
        if self.target == "hub" and not self.repo_id:
            raise ValueError("target 'hub' needs `repo_id` (e.g. my-org/my-model); or set `target: local`")
        return self


STAGE_TYPES: tuple[type[StageBase], ...] = (
    FormatStage,
    SFTStage,
    RewardStage,
    DPOStage,
    KTOStage,
    GRPOStage,
    RLOOStage,
    PPOStage,
    OnlineDPOStage,
    JudgeStage,
    PushStage,
)
STAGE_KINDS: dict[str, type[StageBase]] = {t.model_fields["kind"].default: t for t in STAGE_TYPES}

Stage = Annotated[
    FormatStage
    | SFTStage
    | RewardStage
    | DPOStage
    | KTOStage
    | GRPOStage
    | RLOOStage
    | PPOStage
    | OnlineDPOStage
    | JudgeStage
    | PushStage,
    Field(discriminator="kind"),
]
