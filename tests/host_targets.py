"""Targets that `test_stage_host` forks from a stage host in place of a stage: `module:function(argv) -> exit code`."""

import json
import os
import sys
import time
from pathlib import Path


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
    Path(argv[0]).write_text(str(os.getpid()))
    time.sleep(float(argv[1]))
    Path(argv[0]).write_text("done")
    return 0


def crash(argv: list[str]) -> int:
    raise ValueError("the target failed on purpose")
