"""A stage's manifest: the small record of what it produced. Written last, so a manifest means done."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

MANIFEST = "manifest.json"


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
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, stage_dir: Path) -> Manifest | None:
        path = Path(stage_dir) / MANIFEST
        if not path.exists():
            return None
        return cls.model_validate(json.loads(path.read_text()))
