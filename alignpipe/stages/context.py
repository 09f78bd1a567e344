"""What a stage runner gets: its typed config, the recipe's globals, upstream manifests, a tracker."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from alignpipe.manifest import Manifest
from alignpipe.recipe.schema import Recipe
from alignpipe.recipe.stages import BASE, StageBase
from alignpipe.tracking import Tracker
from alignpipe.trainers.common import resolve_seed

log = logging.getLogger(__name__)


@dataclass
class StageResult:
    """A runner's return value; the stage process turns it into the manifest."""

    outputs: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    key_metric: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelSource:
    """Where a model reference points: a full model, or an adapter over `base_path`."""

    path: str
    adapter: bool = False
    base_path: str | None = None


S = TypeVar("S", bound=StageBase)


@dataclass
class StageContext(Generic[S]):
    """What a runner of stage kind S gets: `stage` is that kind's typed config (for a trainer stage, also the
    trainer's config: the runner hands it on as it is)."""

    recipe: Recipe
    stage: S
    dir: Path
    inputs: dict[str, Manifest]
    tracker: Tracker
    pipeline_run_id: str = ""
    mlflow_parent_run_id: str | None = None

    @property
    def seed(self) -> int:
        """The stage's own `seed`, or the recipe's."""
        return resolve_seed(getattr(self.stage, "seed", None), self.recipe.seed)

    def model_source(self, ref: str) -> ModelSource:
        if ref == BASE:
            return ModelSource(self.recipe.model.path)
        if ref not in self.inputs:  # a model path or Hub id (judges accept those)
            return ModelSource(ref)
        m = self.inputs[ref]
        return ModelSource(m.outputs["model"], bool(m.info.get("adapter")), m.info.get("base_model_path"))

    def load_model(self, ref: str, merge: bool = True):
        """The causal LM a reference names; an adapter is loaded over its base (and merged when `merge`)."""
        from alignpipe.modeling import load_causal_lm

        src = self.model_source(ref)
        spec = self.recipe.model
        if src.adapter:
            if src.base_path is None:
                raise ValueError(f"{ref!r} is an adapter whose manifest names no base model")
            return load_causal_lm(
                src.base_path,
                spec.dtype,
                trust_remote_code=spec.trust_remote_code,
                adapter=src.path,
                merge=merge,
                attention=spec.attention,
            )
        revision = spec.revision if ref == BASE else None
        return load_causal_lm(
            src.path, spec.dtype, revision=revision, trust_remote_code=spec.trust_remote_code, attention=spec.attention
        )

    def start_model(self, ref: str, lora: bool):
        """(model, tokenizer, base path) for a trainer starting from `ref`: an upstream adapter is
        merged; when a *new* adapter will be trained over merged weights, those weights are saved in
        the stage folder so the new adapter has a base on disk."""
        from alignpipe.positions import check_model_window

        src = self.model_source(ref)
        model = self.load_model(ref, merge=True)
        check_model_window(model, self.stage)
        tokenizer = self.tokenizer(ref)
        base_path = src.base_path if src.adapter else src.path
        if lora and src.adapter:
            base_path = str(self.dir / "base_model")
            model.save_pretrained(base_path)
            tokenizer.save_pretrained(base_path)
        return model, tokenizer, base_path

    def causal_lm_result(self, result, base_path: str, metrics: dict | None = None) -> StageResult:
        """The StageResult of a trainer that produced a causal LM (full or adapter)."""
        key = "eval/loss" if "eval/loss" in result.metrics else "train/loss"
        return StageResult(
            outputs={"model": str(result.model_dir)},
            metrics={**result.metrics, "steps": result.steps, **(metrics or {})},
            key_metric=key,
            info={
                "adapter": result.adapter,
                "base_model_path": base_path if result.adapter else None,
                "base_model": self.recipe.model.path,
                "train_seconds": result.seconds,
                "resumed_from": result.resumed_from,
            },
        )

    def log_samples(self, model, tokenizer, rows: list[dict], n: int = 8, max_new_tokens: int = 32) -> None:
        """A table of a few greedy generations on eval prompts (the stage's `samples` artifact)."""
        from alignpipe.engine.hf import HFEngine
        from alignpipe.engine.sampling import SamplingParams

        prompts = [r["prompt"] for r in rows[:n] if "prompt" in r]
        if not prompts:
            return
        gens = HFEngine(model, tokenizer, n).generate(
            prompts, 1, SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
        )
        self.tracker.log_table(
            [
                {"prompt": p, "completion": g.completion, "finish_reason": g.finish_reason}
                for p, g in zip(prompts, gens)
            ],
            "samples",
        )

    def tokenizer(self, ref: str = BASE):
        from alignpipe.modeling import load_tokenizer

        spec = self.recipe.model
        if ref == BASE:
            return load_tokenizer(
                spec.tokenizer or spec.path, spec.revision, spec.trust_remote_code, spec.eos_token, spec.chat_template
            )
        return load_tokenizer(self.model_source(ref).path, trust_remote_code=spec.trust_remote_code)

    def rows(self, data_ref: str, split: str) -> list[dict]:
        """Rows of a `format` stage's output split."""
        import datasets

        dd = datasets.load_from_disk(self.inputs[data_ref].outputs["data"])
        return dd[split].to_list() if split in dd else []
