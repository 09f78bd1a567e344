"""Targets that `test_stage_host` forks from a stage host in place of a stage: `module:function(argv) -> exit code`."""

import json
import os
import sys
import time
from pathlib import Path

from alignpipe.manifest import write_whole as _write  # a peer polling for a pid file must never find it empty


def report(argv: list[str]) -> int:
    """Print what the process was given and whether the host's preload was already imported; exit with argv[0]."""
    monitor = os.getppid()
    fields = Path(f"/proc/{monitor}/stat").read_text().rsplit(")", 1)[1].split()
    print(
        json.dumps(
            {
                "argv": argv,
                "sys_argv": sys.argv,
                "cwd": os.getcwd(),
                "token": os.environ.get("HF_TOKEN"),
                "marker": os.environ.get("MARKER"),
                "preloaded": "xml.dom.minidom" in sys.modules,
                "host": int(fields[1]),  # the monitor's parent
                "title": Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").decode(),
                "monitor_title": Path(f"/proc/{monitor}/cmdline").read_bytes().rstrip(b"\0").decode(),
            }
        )
    )
    print("a line on stderr", file=sys.stderr)
    return int(argv[0])


def sleep(argv: list[str]) -> int:
    """Write this process's pid to argv[0], sleep argv[1] seconds, then write "done" to argv[0]."""
    _write(argv[0], str(os.getpid()))
    time.sleep(float(argv[1]))
    _write(argv[0], "done")
    return 0


def crash(argv: list[str]) -> int:
    raise ValueError("the target failed on purpose")


def meet(argv: list[str]) -> int:
    """A rank of a group: join the process group torch's env:// rendezvous describes, sum the ranks + 1 over it, print
    what this rank was given; exit 0."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    # one write a line: the ranks share the stream, and print's separate write of the newline could interleave
    sys.stdout.write(
        json.dumps(
            {
                "rank": dist.get_rank(),
                "world": dist.get_world_size(),
                "sum": total.item(),
                "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")},
                "threads": torch.get_num_threads(),
                "title": Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").decode(),
                "parent": os.getppid(),
            }
        )
        + "\n"
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def last_rank_fails(argv: list[str]) -> int:
    """Every rank writes its pid to argv[0].RANK; the last rank then fails with exit code 3 (argv[1] == "fail"),
    the others sleep 600 s, as a rank waiting in a collective for a dead peer would."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _write(f"{argv[0]}.{rank}", str(os.getpid()))
    if rank == world - 1 and argv[1] == "fail":
        while not all(Path(f"{argv[0]}.{r}").exists() for r in range(world)):  # the peers have started
            time.sleep(0.05)
        return 3
    time.sleep(600)
    return 0
