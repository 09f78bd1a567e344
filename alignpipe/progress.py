"""Progress bars on long work (training steps, judging's generation, reference log-probs).

Under the launcher, a bar also reports its state on the stage's stdout (a `PROGRESS_MARK` line, every
`REPORT_EVERY_S` and at its end), which the launcher hands to its `on_progress` instead of logging it: the Prefect
task runs it as the stage's progress artifact (`tasks.hooks.StageProgress`)."""

from __future__ import annotations

import functools
import json
import os
import sys
import time

PROGRESS_MARK = "::alignpipe-progress:: "
"""Starts a stdout line that is a bar's state (JSON: n, total, desc, postfix), not a log line (as CI runners'
`::command::` lines)."""
REPORT_ENV = "ALIGNPIPE_PROGRESS"
"""Set to 1 by the launcher when something reads the reports."""
REPORT_EVERY_S = 5.0
"""At most one report a bar this often (each is an API call to Prefect's server), besides its last."""


def live() -> bool:
    """Whether this process's bars are drawn live: its stderr is a terminal, or a pipe that the launcher forwards to
    one (`ALIGNPIPE_TTY`, set by `launch`)."""
    return sys.stderr.isatty() or os.environ.get("ALIGNPIPE_TTY") == "1"


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0):
    """A tqdm bar on stderr (live in a terminal, a line every 10 s in logs), which reports to the launcher where it
    asks (`REPORT_ENV`)."""
    from tqdm.auto import tqdm

    interactive = live()
    cls = _reporting(tqdm) if enabled and os.environ.get(REPORT_ENV) == "1" else tqdm
    return cls(
        total=total,
        initial=initial,
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.2 if interactive else 10.0,
        ascii=not interactive,
    )


def parse_report(line: str) -> dict | None:
    """A `PROGRESS_MARK` line's report (n, total, desc, postfix); None for any other line. The mark may follow a
    prefix a rank launcher puts on its ranks' lines (torchrun's `--tee`: `[rank0]:`)."""
    at = line.find(PROGRESS_MARK)
    if at < 0:
        return None
    try:
        report = json.loads(line[at + len(PROGRESS_MARK) :])
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


@functools.cache
def _reporting(base: type) -> type:
    class Reporting(base):  # tqdm's class, imported late
        _last: tuple | None = None
        _at = float("-inf")

        def update(self, n=1):
            shown = super().update(n)
            self._report(at_end=self.total is not None and self.n >= self.total)
            return shown

        def close(self):
            if not self.disable:
                self._report(at_end=True)
            super().close()

        def _report(self, at_end: bool) -> None:
            now = time.monotonic()
            state = (self.n, self.total, self.desc, self.postfix or "")
            if state == self._last or (not at_end and now - self._at < REPORT_EVERY_S):
                return
            self._last, self._at = state, now
            n, total, desc, postfix = state
            line = json.dumps({"n": n, "total": total, "desc": desc, "postfix": postfix}, ensure_ascii=False)
            sys.stdout.write(PROGRESS_MARK + line + "\n")  # one write: a log line from another thread stays whole
            sys.stdout.flush()

    return Reporting
