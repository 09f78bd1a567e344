"""The `Recipe` model: the whole pipeline declared in one YAML file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TypeVar, overload

from pydantic import Field

from alignpipe.recipe.specs import DatasetSpec, ModelSpec, Storage, Tracking
from alignpipe.recipe.stages import Stage, StageBase
from alignpipe.strict import Strict

S = TypeVar("S", bound=StageBase)


class Recipe(Strict):
    """A post-training pipeline: a starting model, named datasets and a DAG of stages."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    """Pipeline name: the MLflow experiment (by default) and the folder under `workdir`."""
    description: str = ""
    """Free text for `alignpipe show` and the model card."""
    seed: int = 0
    """Seed for data shuffling, initialisation and sampling in every stage."""
    workdir: str = "./runs"
    """Root of everything the pipeline writes (stage outputs, checkpoints, the default MLflow store).
    Relative paths are relative to the directory `alignpipe` is run from."""
    storage: Storage | None = None
    """Storage root every worker reaches (an fsspec URL such as `s3://bucket/prefix`); null keeps
    everything under `workdir`, which must then be a path every worker sees (a shared mount)."""
    tracking: Tracking = Field(default_factory=Tracking)
    """MLflow settings."""
    model: ModelSpec
    """The starting model, referred to as `base` by stages."""
    datasets: dict[str, DatasetSpec] = Field(default_factory=dict)
    """Raw datasets by name; `format` stages read them."""
    stages: list[Stage] = Field(min_length=1)
    """The stages; order does not matter, dependencies do."""

    @overload
    def stage(self, stage_id: str) -> StageBase: ...
    @overload
    def stage(self, stage_id: str, kind: type[S]) -> S: ...
    def stage(self, stage_id: str, kind: type[StageBase] = StageBase) -> StageBase:
        """The stage named `stage_id`; with `kind` (`SFTStage`, `GRPOStage`, ...), typed as that kind, a stage of
        another kind being a `TypeError`."""
        for s in self.stages:
            if s.id == stage_id:
                if not isinstance(s, kind):
                    raise TypeError(f"stage {stage_id!r} is a {s.kind} stage, not a {kind.__name__}")
                return s
        raise KeyError(stage_id)

    @property
    def run_root(self) -> Path:
        """`<workdir>/<name>`: all outputs of this pipeline."""
        return Path(self.workdir).expanduser().resolve() / self.name

    def remote_store(self):
        """The pipeline's folder in `storage` (a `RemoteStore`), or None without one."""
        if self.storage is None:
            return None
        from alignpipe.storage import RemoteStore

        return RemoteStore(self.storage.url, self.name, self.storage.options)

    @property
    def tracking_uri(self) -> str:
        if self.tracking.uri:
            return self.tracking.uri
        return f"sqlite:///{Path(self.workdir).expanduser().resolve() / 'mlflow.db'}"

    @property
    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name

    def fingerprint(self) -> str:
        """Hash of the resolved recipe (what the MLflow parent run records as `recipe_hash`)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def topological_order(self) -> list[StageBase]:
        """Stages in an order where every stage comes after its dependencies (recipe order kept
        among independent stages). Assumes a validated, acyclic recipe."""
        done: set[str] = set()
        order: list[StageBase] = []
        pending = list(self.stages)
        while pending:
            for s in pending:
                if all(d in done for d in s.dependencies()):
                    order.append(s)
                    done.add(s.id)
                    pending.remove(s)
                    break
            else:  # pragma: no cover - check_recipe rejects cycles first
                raise ValueError("cycle in stage dependencies")
        return order

    def ancestors(self, stage_id: str) -> list[str]:
        """All stages `stage_id` depends on, directly or not, in topological order."""
        seen: set[str] = set()
        stack = list(self.stage(stage_id).dependencies())
        while stack:
            s = stack.pop()
            if s not in seen:
                seen.add(s)
                stack.extend(self.stage(s).dependencies())
        return [s.id for s in self.topological_order() if s.id in seen]
