"""Progress bars on long work (training steps, judging's generation, reference log-probs)."""

from __future__ import annotations

import os
import sys


def live() -> bool:
    """Whether this process's bars are drawn live: its stderr is a terminal, or a pipe that the launcher forwards to
    one (`ALIGNPIPE_TTY`, set by `launch`)."""
    return sys.stderr.isatty() or os.environ.get("ALIGNPIPE_TTY") == "1"


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0):
    """A tqdm bar on stderr (live in a terminal, a line every 10 s in logs)."""
    from tqdm.auto import tqdm

    interactive = live()
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.2 if interactive else 10.0,
        ascii=not interactive,
    )
