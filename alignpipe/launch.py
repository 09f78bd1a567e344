"""Launching a stage process (`python -m alignpipe.stage SPEC`, or `accelerate launch` for several ranks):
streaming its log, enforcing its timeout, dying with its parent, and turning a failure into `StageFailed`
with the end of its stderr."""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from alignpipe import progress, shared_line
from alignpipe.log_levels import level_of
from alignpipe.manifest import Manifest
from alignpipe.plan import read_spec
from alignpipe.recipe.schema import Recipe
from alignpipe.stage import StageSpec
from alignpipe.storage import CheckpointMirror, localize, stage_folder


class StageFailed(RuntimeError):
    def __init__(self, stage_id: str, returncode: int, tail: list[str], headline: str | None = None):
        self.stage_id, self.returncode, self.tail = stage_id, returncode, tail
        last = "\n".join(tail[-25:])
        if headline is None:
            # the stage process logs "stage <id> failed: <error>" before it exits: that is the cause to lead with
            said = f"stage {stage_id} failed: "
            cause = next((line[len(said) :] for line in reversed(tail) if line.startswith(said)), None)
            headline = f"stage {stage_id!r} failed (exit code {returncode})" + (f": {cause}" if cause else "")
        self.headline = headline
        super().__init__(f"{headline}. Last output:\n{last}")

    def __repr__(self) -> str:
        # Prefect's "Task run failed with exception: {exc!r}" line: the headline, where the message's last lines would
        # be one long line of escaped newlines (its traceback, just after, prints them as lines)
        return f"{type(self).__name__}({self.headline!r})"

    def __reduce__(self):
        # pickling and copying rebuild an exception from its args, which are not this __init__'s
        return _rebuilt, (type(self), self.args, self.__dict__)

    def logged_above(self) -> StageFailed:
        """The same failure with the headline for its message, for a run whose log already shows the stage's lines as
        they came: Prefect prints a task's exception twice more (its traceback, its final state), and the lines
        carried in the message would stand three times in the terminal. `tail` keeps them."""
        shown = copy.copy(self)
        shown.args = (self.headline + LOGGED_ABOVE,)
        return shown


LOGGED_ABOVE = "; its last lines are logged above"


def _rebuilt(cls: type[StageFailed], args: tuple, state: dict) -> StageFailed:
    failure = cls.__new__(cls)
    Exception.__init__(failure, *args)
    failure.__dict__.update(state)
    return failure


class StageTimedOut(StageFailed):
    """The stage ran past `resources.timeout_s` and was killed."""

    def __init__(self, stage_id: str, returncode: int, timeout_s: float, tail: list[str]):
        self.timeout_s = timeout_s
        headline = (
            f"stage {stage_id!r} timed out: killed after {timeout_s:g} s (resources.timeout_s: {timeout_s:g}), "
            "printing or not. Raise `resources.timeout_s` if it needs longer, or find what hangs (a stuck "
            "collective, a scorer that never answers)"
        )
        super().__init__(stage_id, returncode, tail, headline)


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
            str(free_port()),
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
        str(free_port()),
        *stage,
    ]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the OS picks it)."""
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
    on_progress: Callable[[dict], None] | None = None,
) -> Manifest:
    """Run the stage process, streaming its log lines to `on_line` and, where `on_progress` is given, its bars' states
    to it (`alignpipe.progress.parse_report`'s dicts, every few seconds and at each bar's end); its manifest, or
    StageFailed.
    `extra_env` (e.g. a token from a secret store) reaches the process through its environment only.
    `spec_path` may be a URL in the recipe's storage root: the stage then runs on this machine's working
    copy, fetching its inputs first and uploading its folder as it goes (see `alignpipe.storage`)."""
    spec = read_spec(str(spec_path), storage_options)
    if not spec.recipe.get("storage"):
        with one_writer(Path(spec.stage_dir), spec, on_line) as done:
            if done is not None:
                return done
            return _run_stage_process(
                Path(spec_path), spec, on_line, processes, timeout_s, extra_env, accelerate_config, on_progress
            )
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
    with one_writer(local, spec, on_line) as done, CheckpointMirror(store, local, f"stages/{folder}"):
        if done is not None:
            return done
        manifest = _run_stage_process(
            local_spec,
            StageSpec.model_validate_json(local_spec.read_text()),
            on_line,
            processes,
            timeout_s,
            extra_env,
            accelerate_config,
            on_progress,
        )
    sent = store.upload_folder(local, f"stages/{folder}")
    on_line(f"storage: {sent} file(s) uploaded to {store.url_of(f'stages/{folder}')}")
    return manifest


@contextlib.contextmanager
def one_writer(stage_dir: Path, spec: StageSpec, on_line):
    """Hold the stage folder's lock while the stage runs, so two overlapping runs (or two pool workers on one
    machine) never train into one folder at once. A run that had to wait gets the other's manifest when that one
    finished the same stage (same cache key) and reuses it; otherwise (the other failed) it runs the stage itself,
    resuming from the other's last checkpoint."""
    from alignpipe.locks import file_lock

    def waiting() -> None:
        on_line(f"stage {spec.stage_id}: another run is training it into {stage_dir}; waiting for that run")

    with file_lock(stage_dir.with_name(stage_dir.name + ".lock"), on_wait=waiting):
        done = Manifest.read(stage_dir)
        if done is not None and done.cache_key == spec.cache_key:
            on_line(f"stage {spec.stage_id}: finished by another run; reusing {stage_dir}")
            yield done
        else:
            yield None


def _run_stage_process(
    spec_path: Path, spec: StageSpec, on_line, processes, timeout_s, extra_env, accelerate_config, on_progress=None
) -> Manifest:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    shared = shared_line.for_stream(sys.stderr, live=sys.stderr.isatty())
    shared.guard_log_handlers()  # the log lines `on_line` makes go above (on a terminal) or between the bars
    if shared.live:  # the stage's stderr is a pipe, but it ends up on this terminal: draw live bars
        env["ALIGNPIPE_TTY"] = "1"
    if on_progress is not None:
        env[progress.REPORT_ENV] = "1"
    tail: collections.deque[str] = collections.deque(maxlen=60)
    err_tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = _start(spec_path, processes, accelerate_config, env, extra_env)
    # stderr (progress bars, tracebacks from before logging starts) goes to our stderr as it comes, and its
    # last lines are kept for the error message.
    pump = threading.Thread(target=_pump_stderr, args=(proc.stderr, err_tail, shared, spec.stage_id), daemon=True)
    pump.start()
    # A timer, not a check per output line: a stage that hangs silently (a stuck collective, a scorer that never
    # answers) is killed on time too.
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout_s, expire) if timeout_s else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        report = progress.parse_report(line)
        if report is not None:
            if on_progress is not None:
                on_progress(report)
            continue
        tail.append(level_of(line)[1])
        on_line(line)
    code = proc.wait()
    if timer is not None:
        timer.cancel()
    pump.join(timeout=5)
    shared.finish(spec.stage_id)  # a bar the stage left half drawn (killed, crashed) is no longer redrawn
    if timed_out.is_set():
        errors = [line for line in err_tail if line.strip() and "it/s]" not in line and "s/it]" not in line]
        raise StageTimedOut(spec.stage_id, code, float(timeout_s), list(tail) + errors[-10:])
    manifest = Manifest.read(Path(spec.stage_dir))
    if code != 0 or manifest is None or manifest.cache_key != spec.cache_key:
        errors = [line for line in err_tail if line.strip() and "it/s]" not in line and "s/it]" not in line]
        raise StageFailed(spec.stage_id, code, list(tail) + (["--- stderr ---", *errors] if errors else []))
    return manifest


def _start(spec_path: Path, processes, accelerate_config, env: dict[str, str], extra_env):
    """The stage's process (or its ranks): forked from the launcher's stage host (`alignpipe.stage_host`) where it
    may be, which has its libraries imported already; else a fresh one (torchrun or `accelerate launch` for ranks)."""
    from alignpipe import stage_host

    if stage_host.hosts(processes, accelerate_config, extra_env):
        try:
            argv = [str(Path(__file__).with_name("stage.py")), str(spec_path)]
            title = " ".join(stage_command(spec_path))
            return stage_host.HOSTS.get(env).start(argv, env, title=title, ranks=max(processes, 1))
        except stage_host.HostGone as e:
            print(f"alignpipe: {e}; starting the stage as a process of its own", file=sys.stderr)
    return subprocess.Popen(
        stage_command(spec_path, processes, accelerate_config),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
        preexec_fn=die_with_parent(),
    )


def die_with_parent():
    """A preexec hook for Linux: the child gets SIGKILL when the launching process dies, so a worker killed
    mid-stage (OOM killer, preemption) leaves no orphan training that would race the retry for the folder.
    libc is loaded here, before the fork: only the prctl call runs in the child."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _pump_stderr(stream, keep: collections.deque, shared: shared_line.SharedLine, stage_id: str) -> None:
    """Forward the stage's stderr as it comes (chunks, not lines, so `\\r` progress redraws stay live) through the
    lines its bars share with the log and other stages' bars, and keep its last lines for an error message."""
    import codecs

    fd = stream.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may end inside a character
    pending = ""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        text = decoder.decode(chunk)
        shared.write(text, stage_id)
        pending += text.replace("\r", "\n")
        *lines, pending = pending.split("\n")
        keep.extend(line for line in lines if line.strip())
    if pending.strip():
        keep.append(pending)
