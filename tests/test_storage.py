"""A storage root given as an fsspec URL: the mirror's rules on an in-memory filesystem, and whole pipelines
against a real S3 API (`moto_server`, started the way a user starts a local S3) from machines whose
working copies start empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import known, start_service, stop_service

from alignpipe.launch import free_port
from alignpipe.manifest import Manifest
from alignpipe.storage import CheckpointMirror, RemoteStore, localize, stage_folder

BIN = Path(sys.executable).parent


def _manifest(stage_id="sft", key="k" * 64, outputs=None) -> Manifest:
    return Manifest(stage_id=stage_id, kind="sft", cache_key=key, outputs=outputs or {})


def _store(tmp_name: str) -> RemoteStore:
    import fsspec

    fsspec.filesystem("memory").store.clear()
    return RemoteStore(f"memory://{tmp_name}", "pipe")


def test_upload_sends_the_manifest_last_and_download_can_leave_checkpoints_behind(tmp_path):
    store = _store("a")
    src = tmp_path / "src"
    (src / "model").mkdir(parents=True)
    (src / "model" / "weights.bin").write_bytes(b"w" * 100)
    (src / "checkpoints" / "step-2").mkdir(parents=True)
    (src / "checkpoints" / "step-2" / "state.json").write_text("{}")
    _manifest().write(src)
    order = []
    put = store.fs.put_file
    store.fs.put_file = lambda lpath, rpath, **kw: (order.append(Path(lpath).name), put(lpath, rpath, **kw))
    assert store.upload_folder(src, "stages/sft-x") == 3
    assert order[-1] == "manifest.json", "a manifest in storage means the folder is complete"
    assert store.upload_folder(src, "stages/sft-x") == 1, "only the manifest is re-sent when nothing changed"
    assert known(store.read_manifest("sft-x")).stage_id == "sft" and store.read_manifest("nope") is None

    dest = tmp_path / "dest"
    assert store.download_folder("stages/sft-x", dest, with_checkpoints=False) == 2
    assert (dest / "model" / "weights.bin").read_bytes() == b"w" * 100 and (dest / "manifest.json").exists()
    assert not (dest / "checkpoints").exists(), "downstream stages do not need upstream checkpoints"
    own = tmp_path / "own"
    store.download_folder("stages/sft-x", own, with_manifest=False)
    assert (own / "checkpoints" / "step-2" / "state.json").exists() and not (own / "manifest.json").exists()


def test_localize_moves_paths_inside_the_stage_folder_only(tmp_path):
    key = "a" * 64
    m = _manifest(
        key=key,
        outputs={
            "model": f"/other/host/runs/p/stages/{stage_folder('sft', key)}/model",
            "folder": f"/x/stages/{stage_folder('sft', key)}",
            "hub": "https://hub/org/m",
            "near": f"/x/stages/{stage_folder('sft', key)}-other/model",
        },
    )
    out = localize(m, tmp_path).outputs
    assert out["model"] == str(tmp_path / "stages" / stage_folder("sft", key) / "model")
    assert out["folder"] == str(tmp_path / "stages" / stage_folder("sft", key))
    assert out["hub"] == "https://hub/org/m" and out["near"] == m.outputs["near"]


def test_checkpoint_mirror_uploads_finished_checkpoints_and_follows_rotation(tmp_path):
    store = _store("b")
    local = tmp_path / "stage"
    (local / "mlflow_run_id").parent.mkdir(parents=True)
    (local / "mlflow_run_id").write_text("run123")
    for step in (2, 4):
        d = local / "checkpoints" / f"step-{step}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * step)
        (d / "state.json").write_text(json.dumps({"step": step}))
    partial = local / "checkpoints" / "step-6"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")  # a save in progress: no state.json yet
    mirror = CheckpointMirror(store, local, "stages/s")
    mirror.sync()
    names = set(store.fs.ls(store.path("stages/s/checkpoints"), detail=False))
    assert {n.rsplit("/", 1)[-1] for n in names} == {"step-2", "step-4"}
    assert store.fs.cat_file(store.path("stages/s/mlflow_run_id")) == b"run123"
    import shutil

    shutil.rmtree(local / "checkpoints" / "step-2")  # the trainer keeps the last N
    (partial / "state.json").write_text(json.dumps({"step": 6}))
    mirror.sync()
    names = {n.rsplit("/", 1)[-1] for n in store.fs.ls(store.path("stages/s/checkpoints"), detail=False)}
    assert names == {"step-4", "step-6"}


def test_the_mirror_never_uploads_a_checkpoint_whose_state_is_still_being_written(tmp_path, monkeypatch):
    """The mirror's thread runs beside the trainer. Were `state.json` created empty and written after (as
    `write_text` does), a sync at that instant would upload the checkpoint with an empty state, mark it sent, and a
    retry elsewhere would fail to resume from it. Here the sync runs at every file creation of a real save."""
    from accelerate import Accelerator

    from alignpipe.trainers.common import Checkpointer

    store = _store("c")
    local = tmp_path / "stage"
    mirror = CheckpointMirror(store, local, "stages/s")
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))  # registered: the save writes its weights before state.json
    created = []
    plain = Path.write_text

    def create_then_sync(self, text, *args, **kwargs):
        self.touch()  # open(..., "w") creates the file before a byte is written
        created.append(self.name)
        mirror.sync()
        return plain(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", create_then_sync)
    Checkpointer(local, keep=2).save(accelerator, step=3)
    monkeypatch.setattr(Path, "write_text", plain)
    assert not store.fs.exists(store.path("stages/s/checkpoints/step-3")), "nothing sent before state.json was whole"
    assert any(name.endswith(".tmp") and "state.json" in name for name in created)
    mirror.sync()
    assert json.loads(store.fs.cat_file(store.path("stages/s/checkpoints/step-3/state.json"))) == {"step": 3}
    assert [p.name for p in (local / "checkpoints" / "step-3").iterdir() if p.name.endswith(".tmp")] == []


def test_storage_is_validated_before_anything_runs(demo_text, tmp_path):
    from alignpipe.recipe import RecipeError, load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(demo_text.replace("seed: 0\n", "seed: 0\nstorage: {url: 'nosuchfs://bucket/x'}\n"))
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert "storage.url" in str(e.value) and "unknown storage protocol 'nosuchfs'" in str(e.value)
    path.write_text(demo_text.replace("seed: 0\n", "seed: 0\nstorage: {url: 's3://b/x', options: {secret: abc}}\n"))
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert "look like credentials" in str(e.value) and "AWS_SECRET_ACCESS_KEY" in str(e.value)


def test_credential_option_names_are_refused_and_look_alikes_pass():
    from alignpipe.recipe.specs import secret_option_names

    refused = {
        "key": 1,
        "secret": 1,
        "token": 1,
        "aws_secret_access_key": 1,
        "access_key": 1,
        "account_key": 1,
        "sas_token": 1,
        "password": 1,
        "client_kwargs": {"aws_session_token": 1, "region_name": "eu"},
    }
    assert sorted(secret_option_names(refused)) == sorted(
        [k for k in refused if k != "client_kwargs"] + ["client_kwargs.aws_session_token"]
    )
    harmless = {
        "endpoint_url": "http://minio:9000",
        "sse_kms_key_id": "alias/x",
        "key_prefix": "p",
        "anon": False,
        "client_kwargs": {"region_name": "eu"},
        "requester_pays": True,
    }
    assert secret_option_names(harmless) == []


# --- against a real S3 API ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """`moto_server` on loopback (a local S3 API), a bucket, and the environment a worker would have."""
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    cmd = [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    proc = start_service(cmd, log, endpoint, timeout_s=60, needs_ok=False)
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "test-key",
        "AWS_SECRET_ACCESS_KEY": "test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    import fsspec

    fs = fsspec.filesystem("s3", key="test-key", secret="test-secret", endpoint_url=endpoint, skip_instance_cache=True)
    fs.mkdir("alignpipe-test")
    yield env, fs
    stop_service(proc)


def _run(args, env, cwd, timeout=400):
    out = subprocess.run(
        [str(BIN / "alignpipe"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _statuses(workdir: Path) -> dict[str, str]:
    latest = max((workdir / "tiny-demo" / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    return {s["stage_id"]: s["status"] for s in json.loads(latest.read_text())["stages"]}


def test_pipeline_on_s3_resumes_from_a_machine_with_an_empty_working_copy(s3, tiny, tmp_path):
    """Machine A runs the pipeline with `storage: s3://…`; machine B (another, empty workdir) finds every stage
    finished in storage; machine C re-runs the judge, fetching the SFT model it never trained."""
    from support import demo_recipe

    env, fs = s3
    recipe = tmp_path / "s3.yaml"
    shared_db = f"sqlite:///{tmp_path / 'mlflow.db'}"  # one tracking store for all "machines", as a server would be
    text = demo_recipe(tiny, Path("./work")).replace(
        "seed: 0\n", f"seed: 0\nstorage: {{url: 's3://alignpipe-test/root'}}\ntracking: {{uri: '{shared_db}'}}\n"
    )
    text = text.replace("    max_steps: 150", "    max_steps: 30\n    save_every: 10")
    recipe.write_text(text)
    machines = {m: tmp_path / m for m in "ABC"}
    for d in machines.values():
        d.mkdir()

    _run(["run", str(recipe), "--set", "stages.judge.num_prompts=16"], env, machines["A"])
    sft_dirs = fs.ls("alignpipe-test/root/tiny-demo/stages", detail=False)
    sft = next(d for d in sft_dirs if d.rsplit("/", 1)[-1].startswith("sft-") and "data" not in d)
    assert fs.exists(f"{sft}/manifest.json") and fs.exists(f"{sft}/model/config.json")
    assert fs.exists(f"{sft}/checkpoints"), "checkpoints are mirrored so a retry elsewhere can resume"
    assert fs.ls("alignpipe-test/root/tiny-demo/runs"), "the run summary is in storage too"

    _run(["run", str(recipe), "--set", "stages.judge.num_prompts=16"], env, machines["B"])
    statuses = _statuses(machines["B"] / "work")
    assert statuses["sft"] == statuses["judge"] == statuses["sft-data"] == "cached", statuses
    assert not (machines["B"] / "work" / "tiny-demo" / "stages").exists() or not any(
        (machines["B"] / "work" / "tiny-demo" / "stages").rglob("*.safetensors")
    ), "nothing was fetched that was not needed"

    out = _run(["run", str(recipe), "--set", "stages.judge.num_prompts=8"], env, machines["C"])
    statuses = _statuses(machines["C"] / "work")
    assert statuses["sft"] == "cached" and statuses["judge"] == "done", statuses
    local_sft = machines["C"] / "work" / "tiny-demo" / "stages" / sft.rsplit("/", 1)[-1]
    assert (local_sft / "model" / "config.json").exists(), "the judge fetched the SFT model from storage"
    assert not (local_sft / "checkpoints").exists()
    fs.invalidate_cache()
    judges = [
        d
        for d in fs.ls("alignpipe-test/root/tiny-demo/stages", detail=False)
        if d.rsplit("/", 1)[-1].startswith("judge-") and fs.exists(f"{d}/manifest.json")
    ]
    assert len(judges) == 2, "machine C's judge (8 prompts) is in storage beside machine A's (16)"
    assert "test-secret" not in out.stdout + out.stderr

    # Machine D has neither the recipe file nor the run: `resume` finds A's run in storage and rebuilds the recipe.
    run_a = next((machines["A"] / "work" / "tiny-demo" / "runs").glob("*.json")).stem
    recipe.rename(tmp_path / "elsewhere.yaml")
    d = tmp_path / "D"
    d.mkdir()
    missing = subprocess.run(
        [str(BIN / "alignpipe"), "resume", run_a[:8]], env=env, cwd=d, capture_output=True, text=True
    )
    assert missing.returncode == 2 and "pass --storage URL" in missing.stderr
    out = _run(["resume", run_a[:8], "--storage", "s3://alignpipe-test/root"], env, d)
    assert "is not on this machine" in out.stdout and "stages.judge.num_prompts=16" in out.stdout
    assert (d / "work" / "tiny-demo" / "runs" / f"{run_a}.recipe.yaml").read_text() == text
    statuses = _statuses(d / "work")
    assert statuses["sft"] == statuses["judge"] == "cached", statuses
