"""The run plan without Prefect: a cache key per stage (its config, upstream keys, data file digests, the model,
the seed and the library source), which stages are finished, and the spec file each stage process reads."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from alignpipe.data.sources import source_type
from alignpipe.manifest import Manifest
from alignpipe.recipe.schema import Recipe
from alignpipe.recipe.stages import BASE, FormatStage
from alignpipe.stage import StageSpec
from alignpipe.storage import is_url, localize, read_text, stage_folder


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the library's source: a code change invalidates cached stages."""
    import alignpipe

    h = hashlib.sha256()
    for p in sorted(Path(alignpipe.__file__).parent.rglob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _file_digest(path: str) -> str:
    p = Path(path).expanduser()
    h = hashlib.sha256()
    files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def cache_keys(recipe: Recipe) -> dict[str, str]:
    """Stage id → key over its config, upstream keys, the data and model it reads, seed and code."""
    keys: dict[str, str] = {}
    for s in recipe.topological_order():
        payload = {
            "stage": s.model_dump(mode="json", exclude={"resources", "description"}),
            "deps": {d: keys[d] for d in s.dependencies()},
            "seed": recipe.seed,
            "code": code_version(),
        }
        if isinstance(s, FormatStage) or BASE in s.references().values():
            payload["model"] = recipe.model.model_dump(mode="json")
        if isinstance(s, FormatStage):
            read = [_dataset_payload(recipe.datasets[name]) for name in s.dataset_names]
            # one dataset keeps the keys it always had, so the stages cached before mixtures existed stay cached
            payload |= read[0] if len(read) == 1 else {"datasets": read}
        keys[s.id] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return keys


def _dataset_payload(ds) -> dict:
    """What a format stage's key holds of a dataset it reads: its spec and, for a local one, its contents' digest."""
    payload = {"dataset": ds.model_dump(mode="json")}
    if source_type(ds.path, ds.type) != "hub":
        payload["dataset_digest"] = _file_digest(ds.path)
    return payload


@dataclass
class StagePlan:
    stage_id: str
    kind: str
    key: str
    dir: Path
    deps: list[str]
    cached: bool
    manifest: Manifest | None = None
    """The finished stage's manifest (localized to this machine) when `cached`."""
    fresh: bool = False
    """Forced although finished: its folder is cleared so nothing resumes from the old checkpoints."""

    @property
    def folder(self) -> str:
        return self.dir.name


def plan(recipe: Recipe, force: list[str] | tuple[str, ...] = ()) -> dict[str, StagePlan]:
    """What each stage would do now: reuse a finished output with the same key, or run. With a storage
    root, what is finished is what storage holds."""
    unknown = [f for f in force if f not in {s.id for s in recipe.stages}]
    if unknown:
        raise ValueError(f"--force names unknown stage(s) {unknown}; stages: {[s.id for s in recipe.stages]}")
    keys = cache_keys(recipe)
    store = recipe.remote_store()
    out = {}
    for s in recipe.topological_order():
        folder = stage_folder(s.id, keys[s.id])
        d = recipe.run_root / "stages" / folder
        m = store.read_manifest(folder) if store else Manifest.read(d)
        finished = m is not None and m.cache_key == keys[s.id]
        cached = finished and s.id not in force
        out[s.id] = StagePlan(
            s.id,
            s.kind,
            keys[s.id],
            d,
            s.dependencies(),
            cached,
            localize(m, recipe.run_root) if cached and store and m else (m if cached else None),
            fresh=finished and not cached,
        )
    return out


def write_spec(
    recipe: Recipe,
    p: StagePlan,
    inputs: dict[str, Manifest],
    tracking: tuple[str, str, str | None],
    pipeline_run_id: str,
) -> str:
    """Write the stage's spec file; its path, or its URL in the storage root when the recipe has one."""
    store = recipe.remote_store()
    if p.fresh:
        shutil.rmtree(p.dir, ignore_errors=True)
        if store and store.fs.exists(store.path(f"stages/{p.folder}")):
            store.fs.rm(store.path(f"stages/{p.folder}"), recursive=True)
    p.dir.mkdir(parents=True, exist_ok=True)
    uri, experiment_id, parent = tracking
    spec = StageSpec(
        recipe=recipe.model_dump(mode="json"),
        stage_id=p.stage_id,
        stage_dir=str(p.dir),
        cache_key=p.key,
        inputs=inputs,
        tracking_uri=uri,
        experiment_id=experiment_id,
        parent_run_id=parent,
        pipeline_run_id=pipeline_run_id,
    )
    path = p.dir / "spec.json"
    path.write_text(spec.model_dump_json(indent=1))
    if store:
        store.write_text(f"stages/{p.folder}/spec.json", path.read_text())
        return store.url_of(f"stages/{p.folder}/spec.json")
    return str(path)


def read_spec(spec_path: str, storage_options: dict | None = None) -> StageSpec:
    text = read_text(spec_path, storage_options) if is_url(spec_path) else Path(spec_path).read_text()
    return StageSpec.model_validate_json(text)


def read_manifest(spec: StageSpec) -> Manifest | None:
    """The manifest a stage left, from storage when the recipe has a storage root (localized to this machine)."""
    if not spec.recipe.get("storage"):
        return Manifest.read(Path(spec.stage_dir))
    recipe = Recipe.model_validate(spec.recipe)
    store = recipe.remote_store()
    m = store.read_manifest(stage_folder(spec.stage_id, spec.cache_key))
    return localize(m, recipe.run_root) if m else None
