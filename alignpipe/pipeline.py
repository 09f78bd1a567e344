"""Pipeline mechanics without Prefect: cache keys, the run plan, stage spec files, launching a stage
process, the MLflow parent run and the end-of-run outcomes. `flows/pipeline.py` strings them together.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from alignpipe.data.sources import source_type
from alignpipe.manifest import Manifest
from alignpipe.recipe.schema import Recipe
from alignpipe.recipe.stages import BASE, FormatStage
from alignpipe.stage import StageSpec
from alignpipe.storage import CheckpointMirror, is_url, localize, read_text, stage_folder

STATUS_DONE, STATUS_CACHED, STATUS_FAILED, STATUS_NOT_RUN, STATUS_SKIPPED = (
    "done",
    "cached",
    "failed",
    "not run",
    "skipped",
)


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
            ds = recipe.datasets[s.dataset]
            payload["dataset"] = ds.model_dump(mode="json")
            if source_type(ds.path, ds.type) != "hub":
                payload["dataset_digest"] = _file_digest(ds.path)
        keys[s.id] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return keys


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


class StageFailed(RuntimeError):
    def __init__(self, stage_id: str, returncode: int, tail: list[str]):
        self.stage_id, self.returncode, self.tail = stage_id, returncode, tail
        last = "\n".join(tail[-25:])
        super().__init__(f"stage {stage_id!r} failed (exit code {returncode}). Last output:\n{last}")


def stage_command(spec_path: Path, processes: int = 1, accelerate_config: str | None = None) -> list[str]:
    """The command that runs a stage: one process, or `processes` data-parallel ranks. On GPU machines
    `accelerate launch` (with `accelerate_config`, e.g. FSDP or DeepSpeed); on CPU `torch.distributed.run`
    (gloo), which `Accelerator` picks up as multi-CPU."""
    stage = ["-m", "alignpipe.stage", str(spec_path)]
    if processes <= 1 and not accelerate_config:
        return [sys.executable, *stage]
    if _has_cuda() or accelerate_config:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            str(processes),
            "--main_process_port",
            str(_free_port()),
        ]
        if accelerate_config:
            cmd += ["--config_file", accelerate_config]
        elif processes > 1:
            cmd += ["--multi_gpu"]
        return cmd + stage
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        *stage,
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def launch(
    spec_path: str | Path,
    on_line: Callable[[str], None] = print,
    processes: int = 1,
    timeout_s: float | None = None,
    extra_env: dict[str, str] | None = None,
    accelerate_config: str | None = None,
    storage_options: dict | None = None,
) -> Manifest:
    """Run the stage process, streaming its log lines to `on_line`; its manifest, or StageFailed.
    `extra_env` (e.g. a token from a secret store) reaches the process through its environment only.
    `spec_path` may be a URL in the recipe's storage root: the stage then runs on this machine's working
    copy, fetching its inputs first and uploading its folder as it goes (see `alignpipe.storage`)."""
    spec = read_spec(str(spec_path), storage_options)
    if not spec.recipe.get("storage"):
        return _run_stage_process(Path(spec_path), spec, on_line, processes, timeout_s, extra_env, accelerate_config)
    recipe = Recipe.model_validate(spec.recipe)
    store = recipe.remote_store()
    folder = stage_folder(spec.stage_id, spec.cache_key)
    local = recipe.run_root / "stages" / folder
    local.mkdir(parents=True, exist_ok=True)
    got = store.download_folder(f"stages/{folder}", local, with_manifest=False)  # an earlier attempt's checkpoints
    inputs = {}
    for sid, m in spec.inputs.items():
        rel = stage_folder(m.stage_id, m.cache_key)
        got += store.download_folder(f"stages/{rel}", recipe.run_root / "stages" / rel, with_checkpoints=False)
        inputs[sid] = localize(m, recipe.run_root)
    on_line(f"storage: {got} file(s) fetched from {store.url_of('stages')} into {recipe.run_root / 'stages'}")
    local_spec = local / "spec.json"
    local_spec.write_text(spec.model_copy(update={"stage_dir": str(local), "inputs": inputs}).model_dump_json(indent=1))
    with CheckpointMirror(store, local, f"stages/{folder}"):
        manifest = _run_stage_process(
            local_spec,
            StageSpec.model_validate_json(local_spec.read_text()),
            on_line,
            processes,
            timeout_s,
            extra_env,
            accelerate_config,
        )
    sent = store.upload_folder(local, f"stages/{folder}")
    on_line(f"storage: {sent} file(s) uploaded to {store.url_of(f'stages/{folder}')}")
    return manifest


def _run_stage_process(
    spec_path: Path, spec: StageSpec, on_line, processes, timeout_s, extra_env, accelerate_config
) -> Manifest:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if sys.stderr.isatty():  # the stage's stderr is a pipe, but it ends up on this terminal: draw live bars
        env["ALIGNPIPE_TTY"] = "1"
    tail: collections.deque[str] = collections.deque(maxlen=60)
    err_tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = subprocess.Popen(
        stage_command(spec_path, processes, accelerate_config),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
        preexec_fn=_die_with_parent(),
    )
    # stderr (progress bars, tracebacks from before logging starts) goes to our stderr as it comes, and its
    # last lines are kept for the error message.
    pump = threading.Thread(target=_pump_stderr, args=(proc.stderr, err_tail), daemon=True)
    pump.start()
    deadline = time.monotonic() + timeout_s if timeout_s else None
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        on_line(line)
        if deadline and time.monotonic() > deadline:
            proc.kill()
            tail.append(f"killed after {timeout_s}s (resources.timeout_s)")
            break
    code = proc.wait()
    pump.join(timeout=5)
    manifest = Manifest.read(Path(spec.stage_dir))
    if code != 0 or manifest is None or manifest.cache_key != spec.cache_key:
        errors = [line for line in err_tail if line.strip() and "it/s]" not in line and "s/it]" not in line]
        raise StageFailed(spec.stage_id, code, list(tail) + (["--- stderr ---", *errors] if errors else []))
    return manifest


def _die_with_parent():
    """A preexec hook for Linux: the child gets SIGKILL when the launching process dies, so a worker killed
    mid-stage (OOM killer, preemption) leaves no orphan training that would race the retry for the folder.
    libc is loaded here, before the fork: only the prctl call runs in the child."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _pump_stderr(stream, keep: collections.deque) -> None:
    """Forward the stage's stderr as it comes (chunks, not lines, so `\\r` progress redraws stay live) and keep
    its last lines for an error message."""
    import codecs

    fd = stream.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may end inside a character
    pending = ""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        text = decoder.decode(chunk)
        sys.stderr.write(text)
        sys.stderr.flush()
        pending += text.replace("\r", "\n")
        *lines, pending = pending.split("\n")
        keep.extend(line for line in lines if line.strip())
    if pending.strip():
        keep.append(pending)


# --- MLflow parent run ---------------------------------------------------------------------------


def start_pipeline_run(recipe: Recipe, pipeline_run_id: str) -> tuple[str, str, str]:
    """Create the parent MLflow run; returns (tracking uri, experiment id, run id)."""
    from alignpipe.tracking import MlflowTracker, ensure_experiment

    uri = recipe.tracking_uri
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    exp = ensure_experiment(uri, recipe.experiment_name, Path(recipe.workdir).expanduser() / "mlartifacts")
    run = MlflowTracker.start(
        uri,
        exp,
        f"{recipe.name}",
        tags={"alignpipe.pipeline": recipe.name, "alignpipe.pipeline_run_id": pipeline_run_id},
    )
    run.log_params(
        {
            "recipe_hash": recipe.fingerprint(),
            "name": recipe.name,
            "seed": recipe.seed,
            "model": recipe.model.path,
            "stages": ",".join(s.id for s in recipe.stages),
        }
    )
    run.log_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False), "recipe.resolved.yaml")
    return uri, exp, run.run_id


@dataclass
class StageOutcome:
    stage_id: str
    kind: str
    status: str
    duration_s: float = 0.0
    key_metric: str | None = None
    value: float | None = None
    output: str = ""
    message: str = ""

    @classmethod
    def from_manifest(cls, m: Manifest, status: str, duration: float | None = None) -> StageOutcome:
        output = next(iter(m.outputs.values()), "")
        return cls(
            m.stage_id,
            m.kind,
            status,
            m.duration_s if duration is None else duration,
            m.key_metric,
            m.metrics.get(m.key_metric) if m.key_metric else None,
            output,
        )


def gate(stage, manifests: dict[str, Manifest]) -> tuple[bool, str]:
    """Evaluate a stage's `when` on its upstream manifests: (open, explanation)."""
    from alignpipe.gates import evaluate, parse

    if not stage.when:
        return True, ""
    return evaluate(parse(stage.when), {sid: m.metrics for sid, m in manifests.items()})


def end_pipeline_run(tracking: tuple[str, str, str], outcomes: list[StageOutcome]) -> None:
    from alignpipe.tracking import MlflowTracker

    uri, _, run_id = tracking
    run = MlflowTracker(uri, run_id)
    failed = any(o.status == STATUS_FAILED for o in outcomes)
    run.log_text(json.dumps([asdict(o) for o in outcomes], indent=1), "summary.json")
    run.set_tags({f"alignpipe.status.{o.stage_id}": o.status for o in outcomes})
    run.set_tags(
        {f"alignpipe.skip_reason.{o.stage_id}": o.message[:5000] for o in outcomes if o.status == STATUS_SKIPPED}
    )
    run.end("FAILED" if failed else "FINISHED")


def write_summary(
    recipe: Recipe,
    pipeline_run_id: str,
    outcomes: list[StageOutcome],
    mlflow_run_id: str | None,
    request: dict | None = None,
) -> Path:
    """`<run root>/runs/<pipeline run id>.json`: the outcome per stage and what to re-run (`alignpipe resume`)."""
    d = recipe.run_root / "runs"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{pipeline_run_id}.json"
    path.write_text(
        json.dumps(
            {
                "pipeline": recipe.name,
                "pipeline_run_id": pipeline_run_id,
                "mlflow_run_id": mlflow_run_id,
                "tracking_uri": recipe.tracking_uri,
                "request": request or {},
                "stages": [asdict(o) for o in outcomes],
            },
            indent=1,
        )
    )
    store = recipe.remote_store()
    if store:
        store.write_text(f"runs/{pipeline_run_id}.json", path.read_text())
    return path
