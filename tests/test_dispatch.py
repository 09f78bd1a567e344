"""Stages dispatched to a Prefect work pool, with real components started the way users start them:
`prefect server start` on loopback behind basic auth (PREFECT_SERVER_API_AUTH_STRING; every client here, the worker
included, holds PREFECT_API_AUTH_STRING), a `process` work pool, `alignpipe deploy`, `prefect worker start`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient
from support import known, start_service, stop_service

from alignpipe.launch import free_port

BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[1]
POOL = "alignpipe-process"
AUTH = ("prefect-admin", "pf-dispatch-5e2d9a")
AUTH_STRING = ":".join(AUTH)
http = httpx.Client(auth=AUTH, timeout=30)  # the tests' own reads of the server's API


@pytest.fixture(scope="module")
def hub():
    """A loopback stand-in for the Hub that the worker's stage processes push to."""
    from loopback import FakeHub, serve

    fake = FakeHub()
    with serve(fake) as url:
        url.fake = fake
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory, hub):
    root = tmp_path_factory.mktemp("prefect")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(root / "home"),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        DO_NOT_TRACK="1",
        ALIGNPIPE_HOME=str(REPO),
        PREFECT_API_AUTH_STRING=AUTH_STRING,
    )
    proc = start_service(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        root / "server.log",
        f"{api}/health",
        env={**env, "PREFECT_SERVER_API_AUTH_STRING": AUTH_STRING},
    )
    subprocess.run(
        [
            str(BIN / "prefect"),
            "work-pool",
            "create",
            POOL,
            "--type",
            "process",
            "--base-job-template",
            str(REPO / "infra" / "work-pools" / "process.json"),
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    out = subprocess.run(
        [str(BIN / "prefect"), "--no-prompt", "deploy", "--prefect-file", "infra/prefect.yaml", "--name", POOL],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    worker_env = {
        **env,
        "HF_ENDPOINT": str(hub),
        "HF_HUB_OFFLINE": "0",
    }  # no HF_TOKEN: a stage must get it from a block
    worker_env.pop("HF_TOKEN", None)
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", POOL],
        env=worker_env,
        stdout=(root / "worker.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    yield api, env, root
    stop_service(worker)
    stop_service(proc)


def alignpipe_cli(env: dict, cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`alignpipe ARGS` as a user runs it in `cwd`, its output captured."""
    return subprocess.run(
        [str(BIN / "alignpipe"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _recipe(tiny, tmp_path, pool: str) -> Path:
    from support import demo_recipe

    path = tmp_path / "pool.yaml"
    text = demo_recipe(tiny, tmp_path / "runs").replace(
        "    learning_rate: 1.0e-3\n    max_steps: 150",
        f"    learning_rate: 1.0e-3\n    max_steps: 40\n    resources: {{pool: {pool}}}",
    )
    path.write_text(text)
    return path


SECRET = "hf_pool_token_from_block"


@pytest.fixture(scope="module")
def pool_run(server, tiny, tmp_path_factory) -> tuple[Path, Path]:
    """One pipeline run with SFT, judge and push dispatched to the pool (the push to the loopback Hub with the token
    of a Prefect Secret block); the tests below read it, none changes it. Returns the run's folder and summary file."""
    _api, env, root = server
    tmp_path = tmp_path_factory.mktemp("pool-run")
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from prefect.blocks.system import Secret; "
            "Secret(value=sys.argv[1]).save('pool-hub-token', overwrite=True)",
            SECRET,
        ],
        env=env,
        check=True,
        timeout=120,
    )
    path = _recipe(tiny, tmp_path, POOL)
    text = path.read_text()
    for old, new in (
        ("    reward: sentiment_lexicon", f"    reward: sentiment_lexicon\n    resources: {{pool: {POOL}}}"),
        (
            "    when: judge.win_rate >= 0.55 and judge.ci_low > 0.5\n    target: local",
            f"    target: hub\n    repo_id: me/pool-demo\n    token_secret: pool-hub-token\n    resources: {{pool: {POOL}}}",
        ),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    out = alignpipe_cli(env, tmp_path, "run", str(path), "--set", "stages.judge.num_prompts=16", timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + (root / "worker.log").read_text()[-3000:]
    (summary,) = (tmp_path / "runs" / "tiny-demo" / "runs").glob("*.json")
    return tmp_path, summary


def test_stages_run_on_the_pools_worker_with_their_hooks_and_log_under_the_pipeline_run(server, hub, pool_run):
    """SFT, judge and push dispatched to the pool: the push authenticates with the token of a Prefect Secret block
    (resolved on the worker, never written to the spec) and the judge's Prefect artifacts are published, as the
    local tasks do."""
    api, _env, root = server
    secret, (tmp_path, summary_path) = SECRET, pool_run
    summary = json.loads(summary_path.read_text())
    from alignpipe.manifest import Manifest

    manifests = {m.stage_id: m for m in map(Manifest.read, (tmp_path / "runs" / "tiny-demo" / "stages").iterdir()) if m}
    sft_flow_run = manifests["sft"].info["prefect_flow_run_id"]
    assert sft_flow_run and sft_flow_run != summary["pipeline_run_id"], "the SFT stage ran in a flow run of its own"
    assert manifests["sft-data"].info["prefect_flow_run_id"] is None, "undispatched stages ran beside the pipeline flow"
    run = http.get(f"{api}/flow_runs/{sft_flow_run}").json()
    deployment = http.get(f"{api}/deployments/{run['deployment_id']}").json()
    assert deployment["name"] == POOL and run["work_pool_name"] == POOL and run["state"]["type"] == "COMPLETED"
    assert run["parent_task_run_id"], "the stage flow run is a subflow of the pipeline run"
    client = MlflowClient(summary["tracking_uri"])
    child = client.get_run(known(manifests["sft"].mlflow_run_id))
    assert child.data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"] and child.info.status == "FINISHED"

    commits = [c for c in hub.fake.commits if c["repo"] == "me/pool-demo"]
    assert commits and all(c["authorization"] == f"Bearer {secret}" for c in commits), hub.fake.commits
    assert manifests["publish"].info["prefect_flow_run_id"], "the push ran on the pool"
    for spec in (tmp_path / "runs").rglob("spec.json"):
        assert secret not in spec.read_text()
    judge_run = manifests["judge"].info["prefect_flow_run_id"]
    assert judge_run, "the judge ran on the pool"
    artifacts = http.post(
        f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["tiny-demo-judge-win-rates"]}}}
    ).json()
    assert any(a["flow_run_id"] == judge_run and a["type"] == "table" for a in artifacts), artifacts
    progress = http.post(
        f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["tiny-demo-sft-progress"]}}}
    ).json()
    assert any(a["flow_run_id"] == sft_flow_run and a["type"] == "progress" and a["data"] == 100.0 for a in progress), (
        progress
    )  # the stage's bar, as the pool's flow run shows it in the UI
    # the server's password, which every client here holds, is in no file the run wrote (its MLflow store, logs,
    # manifests, specs), nor in the worker's log or any flow run's parameters
    written = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()] + [root / "worker.log"]
    assert len(written) > 20 and not [str(p) for p in written if AUTH[1].encode() in p.read_bytes()]
    flow_runs = http.post(f"{api}/flow_runs/filter", json={}).json()
    assert len(flow_runs) >= 4 and AUTH[1] not in json.dumps([r["parameters"] for r in flow_runs])


def test_unknown_pool_fails_before_anything_runs(server, tiny, tmp_path):
    _api, env, _ = server
    path = _recipe(tiny, tmp_path, "no-such-pool")
    out = alignpipe_cli(env, tmp_path, "run", str(path), timeout=120)
    assert out.returncode == 2
    assert "stages[2].resources.pool" in out.stderr and "work pool 'no-such-pool' does not exist" in out.stderr
    assert not (tmp_path / "runs" / "tiny-demo").exists()


def test_a_client_without_the_servers_credentials_is_refused_in_one_line(server, tiny, tmp_path):
    """A run started without PREFECT_API_AUTH_STRING, or with a wrong one: exit 1, one error naming the variable to
    set, no traceback, the string never shown, nothing written."""
    _api, env, _ = server
    path = _recipe(tiny, tmp_path, POOL)
    for held, said in (
        (None, "refused a client with no credentials"),
        ("prefect-admin:guess-7f1", "refused the credentials in PREFECT_API_AUTH_STRING"),
    ):
        client_env = {k: v for k, v in env.items() if k != "PREFECT_API_AUTH_STRING"}
        if held:
            client_env["PREFECT_API_AUTH_STRING"] = held
        out = alignpipe_cli(client_env, tmp_path, "run", str(path), timeout=120)
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
        assert said in out.stderr and "(401 Unauthorized)" in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "fix: set PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING" in out.stderr
        assert "guess-7f1" not in out.stdout + out.stderr and AUTH[1] not in out.stdout + out.stderr
        assert not (tmp_path / "runs" / "tiny-demo").exists()


def test_resume_reruns_nothing_that_finished(server, pool_run):
    """`alignpipe resume RUN_ID` re-runs a pipeline run's recipe with its overrides; all cached here."""
    _api, env, _ = server
    tmp_path, run_file = pool_run
    out = alignpipe_cli(env, tmp_path, "resume", run_file.stem[:8], timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "stages.judge.num_prompts=16" in out.stdout
    latest = max((tmp_path / "runs" / "tiny-demo" / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    assert latest != run_file
    statuses = {s["stage_id"]: s["status"] for s in json.loads(latest.read_text())["stages"]}
    assert set(statuses.values()) == {"cached"}, statuses


def alignpipe_deploy(env: dict, *args: str) -> subprocess.CompletedProcess:
    return alignpipe_cli(env, REPO, "deploy", *args)


def test_alignpipe_deploy_creates_a_scheduled_pipeline_deployment(server, tiny, tmp_path):
    from support import demo_recipe

    api, env, _ = server
    recipe = tmp_path / "tiny-demo.yaml"  # the shipped recipe, pointed at this session's tiny assets
    recipe.write_text(demo_recipe(tiny, tmp_path / "runs"))
    out = alignpipe_deploy(
        env,
        "--pool",
        POOL,
        "--recipe",
        str(recipe),
        "--name",
        "weekly-demo",
        "--pipeline-pool",
        POOL,
        "--cron",
        "0 3 * * 1",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    dep = http.get(f"{api}/deployments/name/alignpipe-pipeline/weekly-demo").json()
    assert dep["schedules"][0]["schedule"]["cron"] == "0 3 * * 1"
    assert dep["parameters"]["recipe_path"] == str(recipe)
    limit = (dep.get("global_concurrency_limit") or {}).get("limit", dep.get("concurrency_limit"))
    assert limit == 1 and dep["concurrency_options"]["collision_strategy"] == "ENQUEUE", (
        "cron runs queue, one at a time"
    )
    props = dep["parameter_openapi_schema"]["properties"]
    assert {"recipe_path", "overrides", "force"} <= set(props), "the UI form has the flow's typed parameters"
    assert all(props[p].get("description") for p in ("recipe_path", "overrides", "force")), "and says what each takes"


def test_alignpipe_deploy_checks_pools_and_cron_before_deploying_anything(server, tiny, tmp_path):
    """A missing work pool or a bad cron string is found before the first deployment: exit 2, each problem with its
    fix, and the pools that do exist get no half of the deployment."""
    from support import demo_recipe

    api, env, _ = server
    recipe = tmp_path / "tiny-demo.yaml"
    recipe.write_text(demo_recipe(tiny, tmp_path / "runs"))
    args = ["--pool", POOL, "--pool", "no-such-pool", "--recipe", str(recipe), "--name", "half-demo"]
    out = alignpipe_deploy(env, *args, "--pipeline-pool", POOL, "--cron", "61 3 * *")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "error: nothing was deployed" in out.stderr and "Traceback" not in out.stderr
    assert "--cron '61 3 * *' is not a cron schedule" in out.stderr
    assert f"work pool 'no-such-pool' does not exist on the Prefect server at {api}" in out.stderr
    assert "prefect work-pool create no-such-pool --type process" in out.stderr
    assert f"'{POOL}' does not exist" not in out.stderr
    assert http.get(f"{api}/deployments/name/alignpipe-pipeline/half-demo").status_code == 404
    # what the recipe's stages name on the server: a Secret block and a pool it lacks, found before any deployment
    # (the pool deployed by this same command needs no deployment yet)
    sets = ["stages.publish.target=hub", "stages.publish.repo_id=me/x", "stages.publish.token_secret=no-such-block"]
    sets += ["stages.sft.resources.pool=" + POOL, "stages.judge.resources.pool=no-such-pool"]
    args = ["--pool", POOL, "--recipe", str(recipe), "--name", "half-demo", "--pipeline-pool", POOL]
    out = alignpipe_deploy(env, *args, *[a for kv in sets for a in ("--set", kv)])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"error: {recipe} is invalid (2 problems)" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "stages[4].token_secret" in out.stderr and "Secret block 'no-such-block'" in out.stderr
    assert "stages[3].resources.pool" in out.stderr and "work pool 'no-such-pool' does not exist" in out.stderr
    assert http.get(f"{api}/deployments/name/alignpipe-pipeline/half-demo").status_code == 404


def _stage_process(spec_marker: str) -> int | None:
    """pid of the running `python -m alignpipe.stage …spec_marker…` process, if any."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = b" ".join(cmd)  # a stage forked from the stage host shows its command line as one string
        if b" alignpipe.stage " in line and spec_marker.encode() in line:
            return int(proc.name)
    return None


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _job_of(stage_pid: int) -> int:
    """The process that launched a stage: its parent, or the parent of the stage host it was forked from."""
    from alignpipe.stage_host import HOST_TITLE, MONITOR_TITLE

    pid = _parent(stage_pid)
    while Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0") in (HOST_TITLE.encode(), MONITOR_TITLE.encode()):
        pid = _parent(pid)
    return pid


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")
def test_worker_job_killed_mid_stage_fails_with_its_exit_code_and_the_retry_resumes(server, tiny, tmp_path):
    """SIGKILL the flow-run process the worker started for the SFT stage (what the OOM killer does): the
    attempt fails with the worker's exit code (-9), the training under it dies too, and the stage's retry
    resumes from the last checkpoint on the pool."""
    from alignpipe.manifest import Manifest

    _api, env, root = server
    path = tmp_path / "crash.yaml"
    path.write_text(
        _recipe(tiny, tmp_path, POOL)
        .read_text()
        .replace(
            "    max_steps: 40\n    resources: {pool: " + POOL + "}",
            "    max_steps: 60\n    save_every: 10\n    resources: {pool: " + POOL + ", retries: 1}",
        )
    )
    run = subprocess.Popen(
        [
            str(BIN / "alignpipe"),
            "run",
            str(path),
            "--set",
            "stages.judge.num_prompts=8",
            "--set",
            "stages.sft.eval_every=null",
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stages = tmp_path / "runs" / "tiny-demo" / "stages"
    deadline = time.monotonic() + 300
    ckpt = None
    while time.monotonic() < deadline and run.poll() is None:
        ckpt = next(iter(stages.glob("sft-*/checkpoints/step-20/state.json")), None) if stages.exists() else None
        if ckpt:
            break
        time.sleep(0.2)
    assert ckpt, "no SFT checkpoint before the deadline"
    stage_dir = ckpt.parents[2]
    stage_pid = _stage_process(stage_dir.name)
    assert stage_pid, "the stage process is running"
    job_pid = _job_of(stage_pid)  # the worker's job
    os.kill(job_pid, signal.SIGKILL)
    gone = time.monotonic() + 15
    while _alive(stage_pid):
        assert time.monotonic() < gone, "the training outlived the worker's job (it would race the retry)"
        time.sleep(0.1)
    out, _ = run.communicate(timeout=540)
    assert run.returncode == 0, out[-4000:] + (root / "worker.log").read_text()[-3000:]
    assert "exit code -9" in out, "the failed attempt reports the worker job's exit code"
    manifest = known(Manifest.read(stage_dir))
    assert manifest.info["resumed_from"] >= 20 and manifest.metrics["steps"] == 60
    assert manifest.info["prefect_flow_run_id"], "the retry ran on the pool again"


def test_the_gpu_pools_keep_their_caches_on_the_volume_every_job_mounts():
    """A docker or kubernetes job is a fresh container: the caches a stage fills (Hub downloads, torch.compile's
    inductor and Triton kernels) must lie on the volume every job mounts, or each stage downloads and compiles
    again (`ALIGNPIPE_HOME` is the image's own checkout and stays out)."""
    pools = REPO / "infra" / "work-pools"
    docker = json.loads((pools / "docker-gpu.json").read_text())["variables"]["properties"]
    kube = json.loads((pools / "kubernetes-gpu.json").read_text())
    pod = kube["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    mounted = {
        "docker": [Path(v.split(":")[1]) for v in docker["volumes"]["default"]],
        "kubernetes": [Path(m["mountPath"]) for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims],
    }
    envs = {"docker": docker["env"]["default"], "kubernetes": kube["variables"]["properties"]["env"]["default"]}
    for pool, env in envs.items():
        assert mounted[pool], pool
        for var in ("HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
            assert any(Path(env[var]).is_relative_to(m) for m in mounted[pool]), (pool, var, env.get(var))
    image = (REPO / "infra" / "docker" / "Dockerfile.gpu-worker").read_text()
    assert f"TORCHINDUCTOR_CACHE_DIR={envs['docker']['TORCHINDUCTOR_CACHE_DIR']}" in image
