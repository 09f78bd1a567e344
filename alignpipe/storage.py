"""A storage root every worker reaches, as an fsspec URL (`s3://bucket/prefix`, `gs://…`, `az://…`, `file:///mnt/…`).

With `storage:` set in a recipe, the storage root holds the truth and each machine's `workdir` is a
working copy. The pipeline reads manifests (what is finished) from storage; a stage process, wherever it
runs, first downloads its inputs (upstream stage folders, without their checkpoints) and its own folder
(the checkpoints and MLflow run of an earlier attempt), then uploads its checkpoints as they appear and
everything at the end, the manifest last — so, as on local disk, a manifest in storage means finished.

Manifests record absolute paths of the machine that wrote them; `localize` maps paths inside a stage
folder onto this machine's working copy.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from alignpipe.manifest import MANIFEST, Manifest

log = logging.getLogger("alignpipe.storage")

CHECKPOINTS = "checkpoints"


def is_url(path: str) -> bool:
    return "://" in str(path)


def stage_folder(stage_id: str, cache_key: str) -> str:
    """A stage's folder name under `<run root>/stages/`: the same on every machine and in storage."""
    return f"{stage_id}-{cache_key[:12]}"


def localize(manifest: Manifest, run_root: Path) -> Manifest:
    """The manifest with output paths inside its stage folder moved under this machine's `run_root`."""
    marker = f"/stages/{stage_folder(manifest.stage_id, manifest.cache_key)}"
    local = str(Path(run_root) / "stages" / stage_folder(manifest.stage_id, manifest.cache_key))
    outputs = {}
    for name, value in manifest.outputs.items():
        at = value.find(marker) if isinstance(value, str) else -1
        rest = value[at + len(marker) :] if at >= 0 else None
        outputs[name] = local + rest if rest is not None and (rest == "" or rest.startswith("/")) else value
    return manifest.model_copy(update={"outputs": outputs})


def read_text(url: str, options: dict | None = None) -> str:
    import fsspec

    with fsspec.open(url, "r", **(options or {})) as fh:
        return fh.read()


class RemoteStore:
    """One pipeline's folder in the storage root: `<url>/<pipeline name>/` mirrors `<workdir>/<pipeline name>/`."""

    def __init__(self, url: str, pipeline: str, options: dict | None = None):
        import fsspec

        self.options = dict(options or {})
        self.fs, root = fsspec.core.url_to_fs(url, **self.options)
        self.root = f"{root.rstrip('/')}/{pipeline}"
        self.url = f"{url.rstrip('/')}/{pipeline}"

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}".rstrip("/")

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    # --- single files -----------------------------------------------------------------------------

    def write_text(self, rel: str, text: str) -> None:
        self.fs.pipe_file(self.path(rel), text.encode())

    def read_manifest(self, folder: str) -> Manifest | None:
        path = self.path(f"stages/{folder}/{MANIFEST}")
        try:
            return Manifest.model_validate(json.loads(self.fs.cat_file(path)))
        except FileNotFoundError:
            return None

    # --- folders --------------------------------------------------------------------------------

    def _remote_files(self, rel: str) -> dict[str, int]:
        """Relative path → size of every file under `rel` in storage."""
        base = self.path(rel)
        self.fs.invalidate_cache(base)  # listings are cached per process; other machines write here too
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {
            name[len(base) :].lstrip("/"): int(info.get("size") or 0)
            for name, info in found.items()
            if info.get("type") != "directory"
        }

    def upload_folder(self, local: Path, rel: str, only: str | None = None) -> int:
        """Upload files of `local` that storage lacks (or holds at another size); the manifest last.
        `only` limits the upload to one subfolder. Returns the number of files sent."""
        local = Path(local)
        have = self._remote_files(rel)
        files = sorted(p for p in (local / only if only else local).rglob("*") if p.is_file())
        manifest = [p for p in files if p.relative_to(local).as_posix() == MANIFEST]
        sent = 0
        for p in [p for p in files if p not in manifest and p.suffix != ".tmp"] + manifest:
            name = p.relative_to(local).as_posix()
            try:
                size = p.stat().st_size
                if have.get(name) == size and name != MANIFEST:
                    continue
                self.fs.put_file(str(p), self.path(f"{rel}/{name}"))
                sent += 1
            except FileNotFoundError:  # a checkpoint rotated away while we looked
                continue
        return sent

    def download_folder(self, rel: str, local: Path, with_checkpoints: bool = True, with_manifest: bool = True) -> int:
        """Fetch files of `rel` that `local` lacks (or holds at another size); the manifest last."""
        local = Path(local)
        files = self._remote_files(rel)
        names = sorted(n for n in files if n != MANIFEST and (with_checkpoints or not n.startswith(CHECKPOINTS + "/")))
        names += [MANIFEST] if MANIFEST in files and with_manifest else []
        got = 0
        for name in names:
            dest = local / name
            if dest.exists() and dest.stat().st_size == files[name] and name != MANIFEST:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(self.path(f"{rel}/{name}"), str(dest))
            got += 1
        return got

    def prune_checkpoints(self, local: Path, rel: str) -> None:
        """Remove checkpoints from storage that the trainer has rotated away locally."""
        self.fs.invalidate_cache(self.path(f"{rel}/{CHECKPOINTS}"))
        try:
            remote = self.fs.ls(self.path(f"{rel}/{CHECKPOINTS}"), detail=False)
        except FileNotFoundError:
            return
        for path in remote:
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if not (Path(local) / CHECKPOINTS / name).exists():
                self.fs.rm(path, recursive=True)


class CheckpointMirror:
    """Uploads a running stage's finished checkpoints (and its MLflow run marker) every `interval` seconds,
    so a retry on another machine resumes from them. A checkpoint is finished when its `state.json` exists;
    that file is uploaded last."""

    def __init__(self, store: RemoteStore, local: Path, rel: str, interval: float = 10.0):
        self.store, self.local, self.rel, self.interval = store, Path(local), rel, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-mirror")
        self._sent: set[str] = set()

    def __enter__(self) -> CheckpointMirror:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.sync()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync()
            except Exception as e:  # storage hiccup: try again next round, never kill the stage
                log.warning("checkpoint upload failed (will retry): %s", e)

    def sync(self) -> None:
        marker = self.local / "mlflow_run_id"
        if marker.exists() and "mlflow_run_id" not in self._sent:
            self.store.fs.put_file(str(marker), self.store.path(f"{self.rel}/mlflow_run_id"))
            self._sent.add("mlflow_run_id")
        root = self.local / CHECKPOINTS
        if not root.exists():
            return
        for ckpt in sorted(root.glob("step-*")):
            state = ckpt / "state.json"
            if ckpt.name in self._sent or not state.exists():
                continue
            rel = f"{self.rel}/{CHECKPOINTS}/{ckpt.name}"
            files = [p for p in ckpt.rglob("*") if p.is_file() and p != state]
            try:
                for p in files + [state]:
                    self.store.fs.put_file(str(p), self.store.path(f"{rel}/{p.relative_to(ckpt).as_posix()}"))
            except FileNotFoundError:  # rotated away mid-upload
                continue
            self._sent.add(ckpt.name)
            log.info("checkpoint %s uploaded to %s", ckpt.name, self.store.url_of(rel))
        self.store.prune_checkpoints(self.local, self.rel)
