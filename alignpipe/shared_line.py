"""The terminal lines stages' progress bars share with the launcher's log lines.

A stage's bars reach the launcher's stderr from the stage process's stderr (`launch._pump_stderr`), redrawn in place
with `\\r`; the launcher's log lines (Prefect's console handler, on the same stderr) come from another thread. Written
as they come, each log line lands after the bar's text, on the bar's line. `SharedLine` takes both:
- on a terminal, the bars of the stages running now are a block at the bottom, a line each (a recipe's parallel
  branches each keep a line, rather than taking turns on one); a log line, or a line a stage finishes, is written
  above the block, which is drawn again under it;
- in a file or a pipe (CI's output, a pool worker's log), each bar update becomes a line of its own, a log line always
  starts a line, and a bar drawn again unchanged but for its timings (tqdm draws its last state again as it closes,
  its rate read again) is not repeated.
Stages that run side by side share the process's one `SharedLine` for the stream (`for_stream`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Hashable
from typing import TextIO

CLEAR_LINE = "\r\x1b[K"  # to the line's start, then erase to its end
UP_CLEAR = "\x1b[A\x1b[K"  # up a line, then erase it
# a bar's timings (tqdm's `[elapsed<remaining, rate, postfix]`, closed or cut off at the line's end so far): a bar
# drawn again as it closes reads its clock again, so its rate may differ in the last digit
_TIMINGS = re.compile(r"\[[^\]]*(?:\]|$)")


class SharedLine:
    """`write(text, source)` takes a stage's stderr as it comes (`source` names the stage); the launcher's log
    handlers write through `log_stream()` (`guard_log_handlers`). `live`: the stream is a terminal, where bars are
    redrawn in place."""

    def __init__(self, stream: TextIO, live: bool):
        self.stream, self.live = stream, live
        self._lock = threading.Lock()
        # live: each source's unfinished line as last drawn, in the order the sources first drew; `_drawn` is how
        # many screen lines the block of them takes now (the cursor is at the end of its last)
        self._bars: dict[Hashable, str] = {}
        self._drawn = 0
        # not live: the stream's current line and whose it is
        self._line = ""
        self._owner: Hashable = None
        # not live, per source: the start of a line held back while it reads as the source's last bar so far, and
        # that last bar (a line ended by a redraw or cut by a log line)
        self._held: dict[Hashable, str] = {}
        self._last_bar: dict[Hashable, str] = {}
        self._cut = False  # not live: the empty current line began where a redraw or log line ended a bar's line
        # live: the start of a log line written while bars are drawn, held until it ends; and whether the cursor is
        # after a log line's start written with no bars drawn
        self._foreign_tail, self._open = "", False

    def write(self, text: str, source: Hashable = None) -> None:
        text = text.replace("\r\n", "\n")
        with self._lock:
            out = self._draw(text, source) if self.live else self._as_lines(text, source)
            if out:
                self.stream.write(out)
                self.stream.flush()

    def finish(self, source: Hashable) -> None:
        """`source`'s stream has ended (its stage exited, or was killed with a bar half drawn): its last line stays as
        it was, on a line of its own (on a terminal, above the bars still running), and no longer redrawn."""
        with self._lock:
            out: list[str] = []
            if self.live:
                bar = self._bars.pop(source, "")
                if bar:
                    out.append(self._erase() + self._below(bar + "\n" + self._block()))
            else:
                self._held.pop(source, None)
                if self._line and self._owner == source:
                    self._end_line(out, bar=False)
                self._last_bar.pop(source, None)
            if out:
                self.stream.write("".join(out))
                self.stream.flush()

    # -- on a terminal

    def _draw(self, text: str, source: Hashable) -> str:
        done = []  # lines the source finished: they go above the block
        line = self._bars.get(source, "")
        for piece in re.split(r"([\r\n])", text):
            if piece == "\r":
                line = ""
            elif piece == "\n":
                done.append(line)
                line = ""
            else:
                line += piece
        if line or not done:
            self._bars[source] = line
        else:
            self._bars.pop(source, None)
        return self._erase() + self._below("".join(d + "\n" for d in done) + self._block())

    def _below(self, text: str) -> str:
        """`text` (finished lines, the block) starting a line of its own after a log line's unfinished start."""
        if text and self._open:
            self._open = False
            return "\n" + text
        return text

    def _erase(self) -> str:
        """Back to the first line of the block, every line of it erased."""
        erase = CLEAR_LINE + UP_CLEAR * (self._drawn - 1) if self._drawn else ""
        self._drawn = 0
        return erase

    def _block(self) -> str:
        """Each source's bar on a line of its own, cut to the terminal's width: a line that wrapped would take two
        screen lines, and the next erase would go up one too few."""
        width = _columns(self.stream) - 1
        lines = [bar[:width] if width > 0 else bar for bar in self._bars.values() if bar]
        self._drawn = len(lines)
        return "\n".join(lines)

    # -- in a file

    def _as_lines(self, text: str, source: Hashable) -> str:
        """`text` for a stream that cannot redraw: a `\\r` ends the line it interrupts (none where the line is
        empty), so each redraw of a bar is a line of its own."""
        out: list[str] = []
        held = self._held.pop(source, "")
        for piece in re.split(r"([\r\n])", text):
            if not piece:
                continue
            last = self._last_bar.get(source)
            if piece in "\r\n" and held:
                if last is not None and _untimed(held) == _untimed(last):
                    # the bar drawn again as it was (its timings aside): not repeated (nor the newline that ends it)
                    held = ""
                    self._cut = piece == "\r"
                    continue
                self._put(out, held, source)  # a line that began as the last bar but ended shorter
                held = ""
            if piece == "\r":
                if self._line:
                    self._end_line(out, bar=True)
            elif piece == "\n":
                if self._line or not self._cut:
                    self._end_line(out, bar=False)
                self._cut = False
            elif not self._line and last is not None and _untimed(last).startswith(_untimed(held + piece)):
                held += piece
            else:
                self._put(out, held + piece, source)
                held = ""
        if held:
            self._held[source] = held
        return "".join(out)

    def _put(self, out: list[str], text: str, source: Hashable) -> None:
        if self._line and self._owner != source:  # another stage's line was left unfinished: end it first
            self._end_line(out, bar=False)
        out.append(text)
        self._line += text
        self._owner = source
        self._cut = False

    def _end_line(self, out: list[str], bar: bool) -> None:
        out.append("\n")
        if bar:
            self._last_bar[self._owner] = self._line
        else:
            self._last_bar.pop(self._owner, None)
        self._line = ""
        self._cut = bar

    # -- another writer's lines (the launcher's log)

    def _foreign(self, text: str) -> None:
        """Text another writer puts on the stream (`log_stream`): it starts a line of its own; on a terminal it goes
        above the bars, drawn again under it once the text ends its line."""
        with self._lock:
            if self.live:
                self._foreign_tail += text
                if not self._drawn:  # no bars on the screen: written as it comes
                    out, self._foreign_tail = self._foreign_tail, ""
                    self._open = not out.endswith("\n") if out else self._open
                elif "\n" in self._foreign_tail:
                    lines, _, self._foreign_tail = self._foreign_tail.rpartition("\n")
                    out = self._erase() + lines + "\n" + self._block()
                else:
                    return  # a line begun while bars are drawn: written whole, once it ends
            else:
                pieces: list[str] = []
                if self._line and self._owner is not _LOG:
                    self._end_line(pieces, bar=True)
                out = "".join(pieces) + text
                # `_cut` stays: a bar's own newline after the log line ends the line the log line cut
                self._line = (self._line + text).rsplit("\n", 1)[-1]
                self._owner = _LOG
            if out:
                self.stream.write(out)
                self.stream.flush()

    def log_stream(self) -> TextIO:
        """A stream for the launcher's log handlers to write to in place of this one (`guard_log_handlers`)."""
        return _LogStream(self)  # type: ignore[return-value]  # duck-typed: write/flush, the rest the stream's

    def guard_log_handlers(self) -> int:
        """Point every logging handler that writes to this stream (Prefect's console handler, a user's) at
        `log_stream()`; returns how many. Taken in the handler's own lock, then this one's, always in that order."""
        handlers = [logging.getLogger()] + [
            lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
        ]
        guarded = 0
        for handler in {h for lg in handlers for h in lg.handlers}:
            if not isinstance(handler, logging.StreamHandler) or handler.stream is not self.stream:
                continue
            if isinstance(getattr(type(handler), "stream", None), property):
                continue  # its stream is whatever sys.stderr is when it writes (logging's last-resort handler)
            proxy = self.log_stream()
            handler.setStream(proxy)
            console = getattr(handler, "console", None)  # Prefect's: a rich Console holding the stream too
            if console is not None and getattr(console, "file", None) is self.stream:
                console.file = proxy
            guarded += 1
        return guarded


_LOG = object()  # the owner of a line the launcher's log wrote (not live)


class _LogStream:
    def __init__(self, shared: SharedLine):
        self._shared = shared

    def write(self, text: str) -> int:
        self._shared._foreign(text)
        return len(text)

    def flush(self) -> None:
        self._shared.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._shared.stream, name)


def _columns(stream: TextIO) -> int:
    """The terminal's width; 0 where it has none (a pseudo-terminal nobody sized, as `script` makes)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return int(os.environ.get("COLUMNS", "") or 80)


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


def _untimed(line: str) -> str:
    """`line` with each bracketed part (a bar's timings) emptied: two draws of one bar at one count read alike."""
    return _TIMINGS.sub("[]", line)
