"""A stage's manifest: the small record of what it produced. Written last, so a manifest means done."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

MANIFEST = "manifest.json"


def write_whole(path: Path | str, text: str) -> None:
    """Write `text` to `path` whole or not at all: into a temporary file of this process beside it, then renamed over
    it. For files whose existence means something to another reader (a manifest, a checkpoint's `state.json`, the
    MLflow run marker): `write_text` creates the file empty before it writes, so a reader polling for it (the
    checkpoint mirror's thread), or a re-run after a kill at that instant, would find it empty."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Manifest(BaseModel):
    """What a finished stage hands downstream: paths and metrics, never tensors."""

    stage_id: str
    kind: str
    cache_key: str
    outputs: dict[str, str] = Field(default_factory=dict)
    """Named output paths, e.g. `model`, `data`, `results`."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Final metrics (the summary table shows `key_metric`)."""
    key_metric: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)
    """Anything downstream needs: base model, adapter flag, dataset fingerprint..."""
    mlflow_run_id: str | None = None
    duration_s: float = 0.0

    def write(self, stage_dir: Path) -> Path:
        path = Path(stage_dir) / MANIFEST
        write_whole(path, self.model_dump_json(indent=2))
        return path

    @classmethod
    def read(cls, stage_dir: Path) -> Manifest | None:
        path = Path(stage_dir) / MANIFEST
        if not path.exists():
            return None
        return cls.model_validate(json.loads(path.read_text()))
