"""A warm process that starts single-process stages with their libraries already imported.

A stage process spends ~11 s of a CPU like CI's importing torch, transformers, MLflow and the rest before it does
anything, and a pipeline starts one per stage: on the tiny demo that was half its time. The host imports them once,
beside the pipeline's own start-up, then forks each stage from itself, so a stage starts in a fraction of a second.

Each stage is forked from a monitor that the host forks for it: the monitor reports the stage's pid and then its exit
status (as Popen reports it: negative for a signal) over a socket of the stage's own, so the host never waits on a
stage and serves the next one at once. The stage gets pipes of the launcher's own for its stdout and stderr, the
working directory and environment the launcher gives it, and dies when its launcher does (host, monitor and stage
each die with their parent).

A fork carries the host's imported modules, so the host serves only launches whose environment is its own but for
`LATE_READ` variables (read when used, never at import): `StageHosts` starts a new host when the launcher's
environment or working directory changed, and `launch` starts a plain process where a stage's extra environment holds
anything else.

A multi-process stage on a machine without a GPU (`processes: 2` runs gloo ranks) is forked too: its monitor forks
each rank with the variables torchrun would give it (`RANK`, `WORLD_SIZE`, `MASTER_PORT`…), waits for all of them,
and, as torchrun does, stops the others when one fails, whose exit status it reports. Two ranks under torchrun spend
~9 s of a 2-core CPU importing before they meet; forked, they meet at once. On a GPU machine ranks are started by
`accelerate launch`, as before. `ALIGNPIPE_STAGE_HOST=0` turns the host off.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, cast

PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "accelerate",
    "datasets",
    "peft",
    "alignpipe.stage",
    "alignpipe.stages",
    "alignpipe.modeling",
    "alignpipe.tracking",
)
"""What the host imports before it serves: what every stage imports (a module that a stage kind does not need costs
the host's start only)."""

LATE_READ = frozenset({"HF_TOKEN", "ALIGNPIPE_TTY", "ALIGNPIPE_PROGRESS", "PYTHONUNBUFFERED", "TRITON_CACHE_DIR"})
"""Variables a stage may have that its host does not: read when used (the token when the push uploads, the bars' TTY
and report flags when a bar starts, Triton's cache folder at a kernel's build), never by an import, so a fork of the
host sees them as a fresh process would."""

STAGE_TARGET = "alignpipe.stage:hosted_main"
HOST_TITLE = "alignpipe stage host"
MONITOR_TITLE = "alignpipe stage monitor"
"""The host's and the monitors' command lines as `ps` shows them (a stage shows its own)."""
_MESSAGE = 1 << 20  # the largest request: its environment and arguments as JSON


class HostGone(RuntimeError):
    """The host did not start the stage (it failed to import, or died): the launcher starts a plain process."""


class HostedStage:
    """A stage forked by a host, with the part of `subprocess.Popen` that `launch` uses: `pid`, `stdout` (text
    lines), `stderr` (its file descriptor is read), `kill()` and `wait()`. For a stage of several ranks, `pid` is
    their monitor's, whose death (`kill`) takes the ranks with it."""

    def __init__(self, pid: int, stdout: IO[str], stderr: IO[bytes], status: IO[bytes]):
        self.pid, self.stdout, self.stderr, self._status = pid, stdout, stderr, status
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        with self._lock:
            if self.returncode is None:
                line = self._status.readline().decode()
                # no status: the monitor was killed with its host (its stage with it, by its death signal)
                self.returncode = int(line.split()[1]) if line.startswith("exit ") else -signal.SIGKILL
                self._status.close()
            return self.returncode


class StageHost:
    """One host process: started with `env` in `cwd`, importing `preload`; `start` forks a stage from it."""

    def __init__(self, env: dict[str, str], cwd: str, preload: tuple[str, ...] = PRELOAD):
        self.env, self.cwd = dict(env), cwd
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._send = threading.Lock()
        self._ready = threading.Event()
        self._failed: str | None = None
        self.process: subprocess.Popen | None = None
        # The host dies with the thread that started it (PR_SET_PDEATHSIG follows the forking thread): a thread of
        # its own that lives as long as this process, not a task's thread that ends with its task.
        started = threading.Event()

        def keeper() -> None:
            from alignpipe.launch import die_with_parent

            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "alignpipe.stage_host", str(theirs.fileno()), *preload],
                    pass_fds=(theirs.fileno(),),
                    env=self.env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    preexec_fn=die_with_parent(),
                )
            except OSError as e:
                self._failed = str(e)
                self._ready.set()
                return
            finally:
                theirs.close()
                started.set()
            self._await_ready()
            self.process.wait()  # the host leaves once closed and its stages have ended

        threading.Thread(target=keeper, name="stage-host", daemon=True).start()
        started.wait()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def _await_ready(self) -> None:
        assert self.process is not None
        try:
            said = self._sock.recv(256).decode()
        except OSError as e:
            said = f"({e})"
        if said != "ready":
            self._failed = said or f"exit code {self.process.wait()}"
        self._ready.set()

    def serves(self, env: dict[str, str], cwd: str) -> bool:
        """Whether a stage with environment `env` in `cwd` may be forked from this host (if it started)."""
        died = self._failed is None and self.process is not None and self.process.poll() is not None
        if cwd != self.cwd or died:
            return False
        keys = (set(env) | set(self.env)) - LATE_READ
        return all(env.get(k) == self.env.get(k) for k in keys)

    def start(
        self, argv: list[str], env: dict[str, str], target: str = STAGE_TARGET, title: str = "", ranks: int = 1
    ) -> HostedStage:
        """Fork `target` (`module:function`, called with `argv[1:]`, returning its exit code) with `env`, its command
        line shown as `title` (`ps`, `top`; default: its monitor's), as one process or as `ranks` data-parallel ranks
        on loopback: waits for the host to finish importing. HostGone where it cannot."""
        self._ready.wait()
        if self._failed is not None:
            raise HostGone(f"the stage host did not start: {self._failed}")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status, remote = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = {"target": target, "argv": argv, "env": env, "cwd": self.cwd, "title": title, "ranks": ranks}
        if ranks > 1:
            from alignpipe.launch import free_port

            request["master_port"] = free_port()
        try:
            with self._send:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [out_w, err_w, remote.fileno()])
        except OSError as e:
            for fd in (out_r, err_r):
                os.close(fd)
            status.close()
            raise HostGone(f"the stage host is gone ({e})") from e
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            remote.close()
        lines = status.makefile("rb")
        status.close()  # the file keeps the socket open
        said = lines.readline().decode()
        if not said.startswith("pid "):
            for fd in (out_r, err_r):
                os.close(fd)
            lines.close()
            raise HostGone("the stage host did not start the stage")
        stdout = open(out_r, encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115 (the caller reads it)
        return HostedStage(int(said.split()[1]), stdout, open(err_r, "rb", buffering=0), lines)

    def close(self) -> None:
        """Stop serving: the host exits once the stages it started have ended."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class StageHosts:
    """The launcher's host, started on first use (or by `warm`) and replaced when the environment or working
    directory the launcher starts stages in has changed; a replaced host finishes its running stages. A host that
    could not serve (`serve`) is kept for its environment: its stages start as processes of their own at once."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.preload = preload
        self._host: StageHost | None = None
        self._lock = threading.Lock()

    def get(self, env: dict[str, str]) -> StageHost:
        cwd = os.getcwd()
        with self._lock:
            if self._host is None or not self._host.serves(env, cwd):
                if self._host is not None:
                    self._host.close()
                self._host = StageHost({k: v for k, v in env.items() if k not in LATE_READ}, cwd, self.preload)
            return self._host


HOSTS = StageHosts()


def _gpu_machine() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def enabled() -> bool:
    """Whether stages are forked from a host: on Linux (where processes fork), by default on a machine without a GPU,
    and as `ALIGNPIPE_STAGE_HOST` (`1` or `0`) says. A process that initialised CUDA cannot fork a CUDA user, so the
    host refuses to serve if a preload did (`serve`), but on GPU machines the host has not been run yet; there a
    stage's ~11 s of imports weigh little beside its training."""
    if not sys.platform.startswith("linux"):
        return False
    said = os.environ.get("ALIGNPIPE_STAGE_HOST")
    if said in ("0", "1"):
        return said == "1"
    return not _gpu_machine()


def hosts(processes: int, accelerate_config: str | None, extra_env: dict[str, str] | None) -> bool:
    """Whether a stage of `processes` ranks, launched with `accelerate_config` and `extra_env`, is forked from the
    host: not one that `accelerate launch` starts (an accelerate config; several ranks on a GPU machine, where each
    takes a device), and no extra variable an import might read."""
    if not enabled() or accelerate_config or not set(extra_env or {}) <= LATE_READ:
        return False
    return processes <= 1 or not _gpu_machine()


def warm() -> None:
    """Start the launcher's host now, so its imports run beside the pipeline's own start-up."""
    if enabled():
        HOSTS.get({**os.environ, "PYTHONUNBUFFERED": "1"})


# ---- the host process ----------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    from alignpipe.launch import die_with_parent

    parent = os.getppid()
    hook = die_with_parent()
    if hook is not None:
        hook()
    if os.getppid() != parent:  # the parent was gone before the signal was set
        os._exit(1)


def _stage(request: dict, out: int, err: int) -> None:
    """In the stage's process: its streams, directory and environment, then its target; never returns."""
    code = 1
    try:
        if request["title"]:
            from setproctitle import setproctitle

            setproctitle(request["title"])
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        for stream in (sys.stdout, sys.stderr):  # as PYTHONUNBUFFERED makes a fresh process's
            cast(io.TextIOWrapper, stream).reconfigure(line_buffering=True, write_through=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        module, function = request["target"].split(":")
        code = getattr(importlib.import_module(module), function)(request["argv"][1:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def rank_env(rank: int, ranks: int, master_port: int) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of `ranks` on this one machine (what torch.distributed's env://
    rendezvous and accelerate read)."""
    every = {"WORLD_SIZE": ranks, "LOCAL_WORLD_SIZE": ranks, "ROLE_WORLD_SIZE": ranks, "GROUP_WORLD_SIZE": 1}
    mine = {"RANK": rank, "LOCAL_RANK": rank, "ROLE_RANK": rank, "GROUP_RANK": 0}
    where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "ROLE_NAME": "default"}
    return {k: str(v) for k, v in {**every, **mine, **where}.items()}


def _rank(request: dict, rank: int) -> dict:
    """Rank `rank`'s request: its variables, one intra-op thread where the launcher set none (torchrun's default for
    several ranks a machine), its rank in its title."""
    ranks = request["ranks"]
    env = {**request["env"], **rank_env(rank, ranks, request["master_port"])}
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
        torch = sys.modules.get("torch")
        if torch is not None:  # imported by the host, which read its thread count then
            torch.set_num_threads(1)
    title = f"{request['title'] or MONITOR_TITLE} (rank {rank} of {ranks})"
    return {**request, "env": env, "title": title}


def _wait_for_ranks(pids: list[int]) -> int:
    """The ranks' exit status: 0 once all have ended so; else the first failure's, the others stopped at once (a
    rank left waiting in a collective for a dead peer would wait forever)."""
    left = set(pids)
    while left:
        pid, raw = os.wait()
        left.discard(pid)
        code = os.waitstatus_to_exitcode(raw)
        if code != 0:
            for other in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
            for other in left:
                os.waitpid(other, 0)
            return code
    return 0


def _monitor(request: dict, out: int, err: int, status: socket.socket) -> None:
    """Fork the stage (or its ranks), tell its pid (the ranks': this monitor's) and then its exit status over
    `status`; never returns."""
    try:
        from setproctitle import setproctitle

        _die_with_parent()
        setproctitle(MONITOR_TITLE)
        ranks = request.get("ranks", 1)
        pids = []
        for rank in range(ranks):
            pid = os.fork()
            if pid == 0:
                status.close()
                _die_with_parent()
                _stage(_rank(request, rank) if ranks > 1 else request, out, err)
            pids.append(pid)
        os.close(out)
        os.close(err)
        status.sendall(f"pid {pids[0] if ranks == 1 else os.getpid()}\n".encode())
        status.sendall(f"exit {_wait_for_ranks(pids)}\n".encode())
    finally:
        os._exit(0)


def _unfit_to_fork() -> str:
    """Why a fork of this process could not run a stage, or "": a preload started a thread (a fork copies only the
    forking one), or initialised CUDA (a fork then fails at its first CUDA call; seen from a test fork, where torch
    says it is in a bad fork)."""
    if threading.active_count() > 1:
        return "a preload started a thread"
    torch = sys.modules.get("torch")
    if torch is None:
        return ""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"1" if torch.cuda._is_in_bad_fork() else b"0")
        os._exit(0)
    os.close(w)
    bad = os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    return "a preload initialised CUDA" if bad else ""


def serve(fd: int, preload: list[str]) -> None:
    """The host: import `preload`, say "ready", then fork a monitor for each request until the launcher closes the
    socket, and leave once the stages it started have ended."""
    from setproctitle import setproctitle

    sock = socket.socket(fileno=fd)
    _die_with_parent()
    setproctitle(HOST_TITLE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the launcher, which stops its stages
    # torch's CUDA check through NVML, which leaves CUDA uninitialised (the stages read their own environment)
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        from alignpipe.stage import quiet_environment

        quiet_environment()
        for name in preload:
            importlib.import_module(name)
    except BaseException as e:
        sock.send(f"import failed: {type(e).__name__}: {e}"[:60].encode())
        return
    unfit = _unfit_to_fork()
    sock.send(f"unfit to fork: {unfit}".encode() if unfit else b"ready")
    if unfit:
        return
    children = 0
    while True:
        message, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 3)
        while children:  # reap monitors that have finished
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children -= 1
        if not message:
            break
        out, err, status_fd = fds
        status = socket.socket(fileno=status_fd)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _monitor(json.loads(message), out, err, status)
        children += 1
        for f in (out, err):
            os.close(f)
        status.close()
    sock.close()
    while children:
        os.waitpid(-1, 0)
        children -= 1


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
