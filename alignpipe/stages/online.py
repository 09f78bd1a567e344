"""What the online stages (grpo, rloo, online_dpo, ppo) share: their prompts, the policy they start from with its
reference and rollout engine, the curves they plot and the result they hand back."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from alignpipe.engine.factory import make_engine
from alignpipe.plots import curves_figure
from alignpipe.positions import check_generation_window, model_position_limit, rollout_window
from alignpipe.recipe.stages import FormatStage
from alignpipe.stages.context import StageContext, StageResult

Curves = tuple[tuple[list[str], str], ...]
"""(metric names drawn together, file name of the figure) per figure."""


def prompt_rows(ctx: StageContext, data_ref: str, split: str) -> list[dict]:
    """Prompt + extra columns (e.g. `answer`); completions are dropped: the policy writes its own."""
    return [
        {k: v for k, v in r.items() if k not in ("completion", "chosen", "rejected")} for r in ctx.rows(data_ref, split)
    ]


@dataclass
class Policy:
    """What an online trainer starts from."""

    model: Any
    tokenizer: Any
    base_path: str
    """Where the weights a new adapter trains over are (`StageContext.start_model`)."""
    ref: Any
    """A frozen copy of the starting model, or None (LoRA: the adapter-disabled policy is the reference)."""
    engine: Any
    """The recipe's rollout engine, or None for the hf engine, which the trainer builds on the policy itself."""

    def __enter__(self) -> Policy:
        return self

    def __exit__(self, *exc) -> None:
        """What the engine holds outside this process released, whether the training ended or failed (a vLLM
        server's rollout adapter)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def start_policy(ctx: StageContext, reference: bool) -> Policy:
    """The stage's policy, its tokenizer, a frozen reference where `reference` asks for one and no LoRA adapter
    stands in, and the rollout engine."""
    s: Any = ctx.stage
    model, tokenizer, base_path = ctx.start_model(s.model, lora=s.lora is not None)

    @functools.cache
    def prompts() -> list[str]:  # read once, and only where a check or the engine needs them
        return [r["prompt"] for split in ("train", "eval") for r in ctx.rows(s.data, split)]

    limit = model_position_limit(model)
    if s.max_prompt_length is None and limit:  # whole prompts: the data sets the window
        check_generation_window(
            limit,
            tokenizer,
            prompts(),
            s.max_completion_length,
            f"stage {s.id!r}",
            "max_completion_length",
            "set max_prompt_length: {n} (prompts keep their last tokens)",
        )
    ref = ctx.load_model(s.model, merge=True) if reference and not s.lora else None
    engine = None
    if s.rollout.backend != "hf":
        engine = make_engine(s.rollout, model, tokenizer, _vllm_window(ctx, tokenizer, model.config, prompts), ctx.dir)
    return Policy(model, tokenizer, base_path, ref, engine)


def _vllm_window(ctx: StageContext, tokenizer, config, prompts: Callable[[], list[str]]) -> int | None:
    """The longest sequence a vLLM colocate engine decodes for this stage (`positions.rollout_window`) over the
    stage's `prompts()`; None where the format stage renders tools (their turns grow a completion past one sampling
    call) or vLLM is a server."""
    s: Any = ctx.stage
    data = ctx.recipe.stage(s.data)
    if s.rollout.mode != "colocate" or (isinstance(data, FormatStage) and data.tools):
        return None
    return rollout_window(tokenizer, prompts(), s.max_prompt_length, s.max_completion_length, config)


def finish(ctx: StageContext, title: str, curves: Curves, result, base_path: str, key_metric: str) -> StageResult:
    """Log the stage's curves as figures and hand back its model, with `key_metric` as the manifest's key metric
    where the run reported it."""
    for keys, name in curves:
        fig = curves_figure(ctx.tracker, keys, f"{title} {ctx.stage.id}")
        if fig is not None:
            ctx.tracker.log_figure(fig, name)
    out = ctx.causal_lm_result(result, base_path)
    if key_metric in result.metrics:
        out.key_metric = key_metric
    return out
