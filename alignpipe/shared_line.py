"""The terminal line a stage's progress bar shares with the launcher's log lines.

A stage's bars reach the launcher's stderr from the stage process's stderr (`launch._pump_stderr`), redrawn in place
with `\\r`; the launcher's log lines (Prefect's console handler, on the same stderr) come from another thread. Written
as they come, each log line lands after the bar's text, on the bar's line. `SharedLine` takes both: on a terminal
it clears the bar before a log line and draws it again below it; in a file or a pipe (CI's output, a pool worker's
log) each bar update becomes a line of its own, and a log line always starts a line. Stages that run side by side
(a recipe's parallel branches) share the process's one `SharedLine` for the stream (`for_stream`), so their bars
interleave as whole lines rather than on one.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import TextIO

CLEAR_LINE = "\r\x1b[K"  # to the line's start, then erase to its end


class SharedLine:
    """`write` takes the stage's stderr as it comes; a log line is written inside `apart()`. `live`: the stream is a
    terminal, where bars are redrawn in place."""

    def __init__(self, stream: TextIO, live: bool):
        self.stream, self.live = stream, live
        self._lock = threading.Lock()
        self._line = ""  # the current line's text as it shows: a bar, as last drawn
        self._cut = False  # not live: a log line ended the bar's line, so the bar's own newline is not repeated

    def write(self, text: str) -> None:
        text = text.replace("\r\n", "\n")
        with self._lock:
            # live: each redraw erases the line first, so a shorter bar (another stage's) leaves nothing behind
            self.stream.write(text.replace("\r", CLEAR_LINE) if self.live else self._as_lines(text))
            self.stream.flush()
            if self.live:
                self._line = (self._line + text).rsplit("\n", 1)[-1].rsplit("\r", 1)[-1]

    def _as_lines(self, text: str) -> str:
        """`text` for a stream that cannot redraw: a `\\r` ends the line it interrupts (none where the line is
        empty), so each redraw of a bar is a line of its own."""
        out = []
        for piece in re.split(r"([\r\n])", text):
            if piece == "\r":
                if self._line:
                    out.append("\n")
                    self._line = ""
            elif piece == "\n":
                if not (self._cut and not self._line):
                    out.append("\n")
                self._line = ""
            elif piece:
                out.append(piece)
                self._line += piece
            if piece:
                self._cut = False
        return "".join(out)

    @contextlib.contextmanager
    def apart(self):
        """For a line another writer puts on the stream: it starts a line of its own, and a live bar is drawn again
        under it."""
        with self._lock:
            if self._line:
                self.stream.write(CLEAR_LINE if self.live else "\n")
                self.stream.flush()
                self._cut = not self.live
            try:
                yield
            finally:
                if self.live and self._line:
                    self.stream.write(self._line)
                    self.stream.flush()
                elif not self.live:
                    self._line = ""


_BY_STREAM: dict[int, SharedLine] = {}
_BY_STREAM_LOCK = threading.Lock()


def for_stream(stream: TextIO, live: bool) -> SharedLine:
    """The process's `SharedLine` for `stream` (made on first use): every stage the process launches writes its bars
    and log lines through it."""
    with _BY_STREAM_LOCK:
        shared = _BY_STREAM.get(id(stream))
        if shared is None or shared.stream is not stream:
            shared = _BY_STREAM[id(stream)] = SharedLine(stream, live)
        return shared
