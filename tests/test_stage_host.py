"""The stage host (`alignpipe.stage_host`): stages forked from a warm process get their own arguments, environment,
streams and exit status, die with their launcher, and outlive a host that was replaced; a stage's ranks on a CPU machine
meet as torchrun's would, and one failing stops the others. The pipelines, resume, timeout and dispatch tests run every
single-process stage through it, the multi-process tests all but one stage's ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support import known

from alignpipe import stage_host
from alignpipe.stage_host import StageHost, StageHosts

TESTS = str(Path(__file__).parent)
PRELOAD = ("xml.dom.minidom",)  # light, and imported by nothing the host imports itself


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": TESTS, **extra}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _pid_in(path: Path, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().isdigit():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no pid in {path}")


def test_hosted_stages_get_their_arguments_environment_streams_and_exit_code(tmp_path):
    host = StageHost(_env(), str(tmp_path), PRELOAD)
    try:
        first = host.start(
            ["stage.py", "3", "x"], _env(HF_TOKEN="hf_secret"), target="host_targets:report", title="stage one"
        )
        second = host.start(["stage.py", "0"], _env(MARKER="second"), target="host_targets:report")
        for proc in (first, second):
            assert proc.stderr.read().decode() == "a line on stderr\n"
        seen = [json.loads(proc.stdout.read()) for proc in (first, second)]
        assert [first.wait(), second.wait()] == [3, 0]
    finally:
        host.close()
    assert seen[0]["argv"] == ["3", "x"] and seen[0]["sys_argv"] == ["stage.py", "3", "x"]
    assert seen[0]["token"] == "hf_secret" and seen[1]["token"] is None, "each stage has its own environment"
    assert seen[0]["marker"] is None and seen[1]["marker"] == "second"
    assert all(s["cwd"] == str(tmp_path) for s in seen)
    assert all(s["preloaded"] for s in seen), "the stage started with the host's imports done"
    assert {s["host"] for s in seen} == {host.pid}, "both were forked from the one host"
    assert seen[0]["title"] == "stage one", "`ps` shows the stage's own command line"
    assert seen[1]["title"] == seen[0]["monitor_title"] == stage_host.MONITOR_TITLE
    assert Path(f"/proc/{host.pid}/cmdline").read_bytes().rstrip(b"\0").decode() == stage_host.HOST_TITLE
    known(host.process).wait(timeout=30)  # closed, with no stage left: the host leaves


def test_a_killed_or_crashing_stage_reports_like_a_process_of_its_own(tmp_path):
    host = StageHost(_env(), str(tmp_path), PRELOAD)
    try:
        sleeper = host.start(["stage.py", str(tmp_path / "pid"), "600"], _env(), target="host_targets:sleep")
        assert _pid_in(tmp_path / "pid") == sleeper.pid
        sleeper.kill()
        assert sleeper.wait() == -signal.SIGKILL
        crash = host.start(["stage.py"], _env(), target="host_targets:crash")
        err = crash.stderr.read().decode()
        assert crash.wait() == 1
        assert "ValueError: the target failed on purpose" in err and "Traceback" in err
    finally:
        host.close()


def test_ranks_forked_from_the_host_meet_as_torchrun_s_ranks_would(tmp_path):
    """Two ranks of one stage: each gets torchrun's variables and one intra-op thread (the host's torch had the
    machine's count), both meet in one gloo group over loopback, share the launcher's stdout, show their rank in
    `ps`, and the group's pid is their monitor's."""
    host = StageHost(_env(), str(tmp_path), (*PRELOAD, "torch"))
    try:
        group = host.start(["stage.py"], _env(), target="host_targets:meet", title="stage two", ranks=2)
        out = group.stdout.read()
        assert group.wait() == 0, group.stderr.read().decode()[-2000:]
    finally:
        host.close()
    seen = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in seen] == [0, 1] and all(r["world"] == 2 and r["sum"] == 3.0 for r in seen), seen
    for rank, r in enumerate(seen):
        assert r["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        assert r["threads"] == 1 and r["title"] == f"stage two (rank {rank} of 2)" and r["parent"] == group.pid


def test_a_failing_rank_stops_its_peers_and_a_killed_group_dies_whole(tmp_path):
    """A rank that fails ends its group at once with its exit status (its peer, which would wait for it forever, is
    stopped); `kill` of a group's monitor takes every rank with it."""
    env = _env()
    env.pop("OMP_NUM_THREADS", None)
    host = StageHost(env, str(tmp_path), PRELOAD)
    try:
        failing = host.start(
            ["stage.py", str(tmp_path / "a"), "fail"], env, target="host_targets:last_rank_fails", ranks=2
        )
        started = time.monotonic()
        assert failing.wait() == 3
        assert time.monotonic() - started < 30
        assert not _alive(_pid_in(tmp_path / "a.0")), "the waiting rank was stopped"
        killed = host.start(
            ["stage.py", str(tmp_path / "b"), "sleep"], env, target="host_targets:last_rank_fails", ranks=2
        )
        pids = [_pid_in(tmp_path / f"b.{rank}") for rank in (0, 1)]
        killed.kill()
        assert killed.wait() == -signal.SIGKILL
        deadline = time.monotonic() + 20
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, pids)), "both ranks died with their monitor"
    finally:
        host.close()


def test_the_host_and_its_stages_die_with_the_launcher(tmp_path):
    """A launcher killed mid-stage (a worker's job cancelled, the OOM killer) leaves no host and no stage behind."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from alignpipe.stage_host import StageHost
        env = {{**os.environ, "PYTHONPATH": {TESTS!r}}}
        host = StageHost(env, {str(tmp_path)!r}, ("xml.dom.minidom",))
        host.start(["stage.py", {str(tmp_path / "pid")!r}, "600"], env, target="host_targets:sleep")
        print(host.pid, flush=True)
        time.sleep(600)
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        host_pid = int(known(launcher.stdout).readline())
        stage_pid = _pid_in(tmp_path / "pid")
        assert _alive(host_pid) and _alive(stage_pid)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 20
    while (_alive(host_pid) or _alive(stage_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(stage_pid), "the stage died with its launcher"
    assert not _alive(host_pid)


def test_a_changed_environment_gets_a_new_host_and_the_old_one_finishes_its_stages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hosts = StageHosts(PRELOAD)
    old = hosts.get(_env())
    running = old.start(["stage.py", str(tmp_path / "pid"), "2"], _env(), target="host_targets:sleep")
    _pid_in(tmp_path / "pid")
    assert hosts.get(_env(HF_TOKEN="t")) is old, "a late-read variable does not need a new host"
    assert hosts.get(_env(TRITON_CACHE_DIR=str(tmp_path / "triton"))) is old, "read at a kernel's build"
    new = hosts.get(_env(HF_HOME=str(tmp_path / "hf")))  # read by huggingface_hub when it is imported
    assert new is not old
    assert running.wait() == 0 and (tmp_path / "pid").read_text() == "done", "the replaced host's stage ran on"
    known(old.process).wait(timeout=30)
    new.close()


def test_a_host_whose_preload_initialised_cuda_refuses_and_the_stage_runs_as_a_process_of_its_own(
    tiny, tmp_path, monkeypatch, capfd
):
    host = StageHost(_env(), str(tmp_path), ("host_poison",))
    with pytest.raises(stage_host.HostGone, match="unfit to fork: a preload initialised CUDA"):
        host.start(["stage.py", "0"], _env(), target="host_targets:report")
    known(host.process).wait(timeout=30)

    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.setattr(stage_host, "HOSTS", StageHosts(("host_poison",)))
    lines = _format_stage(tiny, tmp_path)
    assert any("formatted reviews" in line for line in lines)
    assert "starting the stage as a process of its own" in capfd.readouterr().err


def test_what_is_started_from_the_host(monkeypatch):
    assert stage_host.hosts(1, None, None) and stage_host.hosts(1, None, {"HF_TOKEN": "t"})
    assert stage_host.hosts(2, None, None), "a CPU machine's ranks too"
    assert not stage_host.hosts(1, "fsdp.yaml", None) and not stage_host.hosts(2, "fsdp.yaml", None)
    assert not stage_host.hosts(1, None, {"CUDA_VISIBLE_DEVICES": "1"}), "a variable an import may read"
    monkeypatch.setenv("ALIGNPIPE_STAGE_HOST", "0")
    assert not stage_host.hosts(1, None, None)
    monkeypatch.delenv("ALIGNPIPE_STAGE_HOST")
    monkeypatch.setattr(stage_host.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert not stage_host.enabled(), "not by default on a GPU machine"
    monkeypatch.setenv("ALIGNPIPE_STAGE_HOST", "1")
    assert stage_host.enabled() and stage_host.hosts(1, None, None)
    assert not stage_host.hosts(2, None, None), "a GPU machine's ranks are started by accelerate launch, one a device"


def _format_stage(tiny, tmp_path) -> list[str]:
    """Run the demo recipe's `sft-data` format stage through `launch`; its log lines."""
    from support import demo_recipe

    from alignpipe.launch import launch
    from alignpipe.pipeline_run import start_pipeline_run
    from alignpipe.plan import plan, write_spec
    from alignpipe.recipe import load_recipe

    (tmp_path / "r.yaml").write_text(demo_recipe(tiny, tmp_path / "work"))
    recipe = load_recipe(tmp_path / "r.yaml", [])
    plans = plan(recipe)
    lines: list[str] = []
    manifest = launch(
        write_spec(recipe, plans["sft-data"], {}, start_pipeline_run(recipe, "run-1"), "run-1"), on_line=lines.append
    )
    assert manifest.metrics["rows_train"] == 1800 and (plans["sft-data"].dir / "manifest.json").exists()
    return lines


@pytest.mark.parametrize("hosted", ["1", "0"])
def test_a_stage_runs_the_same_from_the_host_and_as_a_process_of_its_own(tiny, tmp_path, monkeypatch, hosted):
    """A format stage through `launch`, forked from the host or not: the same manifest, and its log lines."""
    monkeypatch.setenv("ALIGNPIPE_STAGE_HOST", hosted)
    lines = _format_stage(tiny, tmp_path)
    assert any("formatted reviews → prompt_completion: 1800 train / 200 eval rows" in line for line in lines), lines
