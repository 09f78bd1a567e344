"""A stage process's log records reach the launcher as lines on the stage's stdout, which the launcher logs to the
Prefect run. Each line of a record at WARNING or above starts with its level's name (`WARNING: `, `ERROR: `,
`CRITICAL: `), so that the launcher logs it at that level: Prefect's UI shows a stage's warnings and its failure's
traceback as warnings and errors, where its level filter finds them, not as INFO lines."""

from __future__ import annotations

import logging
import re

MARKED = {name: getattr(logging, name) for name in ("WARNING", "ERROR", "CRITICAL")}


class LevelMarks(logging.Formatter):
    """`%(message)s` (and an exception's traceback), each line marked with the level from WARNING up."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno < logging.WARNING:
            return text
        mark = f"{record.levelname if record.levelname in MARKED else 'WARNING'}: "
        return "\n".join(mark + line for line in text.split("\n"))


_MARK = re.compile(r"(\[rank\d+\]:)?(" + "|".join(MARKED) + "): ")
"""A mark, after the prefix a rank launcher may put on its ranks' lines (torchrun's `--tee`: `[rank0]:`)."""


def level_of(line: str) -> tuple[int, str]:
    """The level a stage's stdout line was logged at, and the line without its mark (a rank's prefix kept; INFO for
    an unmarked line)."""
    found = _MARK.match(line)
    if found is None:
        return logging.INFO, line
    return MARKED[found.group(2)], (found.group(1) or "") + line[found.end() :]
