"""Advisory file locks (`flock`) for what two overlapping runs on one machine must not do at once: create the
MLflow SQLite store, or train the same stage into the same folder. The lock is released when its holder exits,
however it exits (a killed run leaves no stale lock)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: str | Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the block; `on_wait()` is called once if another
    process holds it, before blocking until it is released."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
