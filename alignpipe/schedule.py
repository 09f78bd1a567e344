"""Which stage runs next, without Prefect: the pipeline flow asks `Schedule.ready()` for the stages whose
dependencies have finished, launches those that must run, and reports each result with `Schedule.finish()`.

A stage does not run when an upstream stage failed ("not run"), was skipped, or its gate is closed ("skipped"), or
when an earlier run finished it with the same cache key ("cached"). Those decisions live here so they are testable
on their own and the flow holds only what Prefect needs (task submission and waiting).
"""

from __future__ import annotations

from collections.abc import Iterator

from alignpipe.launch import StageFailed
from alignpipe.manifest import Manifest
from alignpipe.pipeline_run import (
    STATUS_CACHED,
    STATUS_DONE,
    STATUS_FAILED,
    STATUS_NOT_RUN,
    STATUS_SKIPPED,
    StageOutcome,
    gate,
)
from alignpipe.plan import StagePlan
from alignpipe.recipe.schema import Recipe


class Schedule:
    """Stage outcomes and manifests of one pipeline run, filled in as stages finish."""

    def __init__(self, recipe: Recipe, plans: dict[str, StagePlan]):
        self.recipe = recipe
        self.plans = plans
        self.pending = list(recipe.topological_order())
        self.outcomes: dict[str, StageOutcome] = {}
        self.manifests: dict[str, Manifest] = {}

    def ready(self) -> Iterator[tuple]:
        """Yield `(stage, outcome)` for each stage whose dependencies are settled, in topological order: `outcome` is
        None when the stage must run (the caller launches it and later calls `finish`), else the recorded reason it
        does not run (not run, skipped, cached, or a gate that cannot be evaluated)."""
        for s in list(self.pending):
            deps = self.plans[s.id].deps
            settled = [self.outcomes[d] for d in deps if d in self.outcomes]
            outcome: StageOutcome | None
            if any(o.status in (STATUS_FAILED, STATUS_NOT_RUN) for o in settled):
                outcome = StageOutcome(s.id, s.kind, STATUS_NOT_RUN, message="an upstream stage failed")
            elif any(o.status == STATUS_SKIPPED for o in settled):
                skipped = next(o.stage_id for o in settled if o.status == STATUS_SKIPPED)
                outcome = StageOutcome(s.id, s.kind, STATUS_SKIPPED, message=f"upstream stage {skipped!r} was skipped")
            elif all(d in self.manifests for d in deps):
                outcome = self._decide(s)
            else:
                continue  # an upstream stage is still running
            self.pending.remove(s)
            if outcome is not None:
                self.outcomes[s.id] = outcome
            yield s, outcome

    def _decide(self, s) -> StageOutcome | None:
        try:
            open_gate, why = gate(s, self.manifests)
        except ValueError as e:
            return StageOutcome(s.id, s.kind, STATUS_FAILED, message=f"gate `when: {s.when}`: {e}")
        if not open_gate:
            return StageOutcome(s.id, s.kind, STATUS_SKIPPED, message=f"gate `{s.when}` is false: {why}")
        p = self.plans[s.id]
        if p.cached and p.manifest is not None:
            self.manifests[s.id] = p.manifest
            return StageOutcome.from_manifest(p.manifest, STATUS_CACHED, 0.0)
        return None

    def inputs(self, stage_id: str) -> dict[str, Manifest]:
        """The manifests of every ancestor of a stage that is about to run."""
        return {a: self.manifests[a] for a in self.recipe.ancestors(stage_id)}

    def finish(self, stage_id: str, kind: str, result) -> StageOutcome:
        """Record a launched stage's result: its manifest (as a dict) when it finished, else the error."""
        if isinstance(result, dict):
            self.manifests[stage_id] = Manifest.model_validate(result)
            outcome = StageOutcome.from_manifest(self.manifests[stage_id], STATUS_DONE)
        else:
            # a stage's failure says its cause in `headline`; anything else (the task's own error) in its first line
            headline = result.headline if isinstance(result, StageFailed) else str(result).split("\n")[0]
            outcome = StageOutcome(stage_id, kind, STATUS_FAILED, message=headline)
        self.outcomes[stage_id] = outcome
        return outcome

    @property
    def settled(self) -> bool:
        """Every stage has an outcome (none is waiting or running)."""
        return len(self.outcomes) == len(self.recipe.stages)

    def ordered(self) -> list[StageOutcome]:
        return [self.outcomes[s.id] for s in self.recipe.topological_order()]
