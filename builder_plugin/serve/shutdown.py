"""Stopping the server: SIGINT (Ctrl-C), SIGTERM (`kill`, systemd, Docker) and SIGHUP (a closed terminal) all end it
the same way, through its shutdown, so the media folder is removed whatever stopped it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def interrupting_signals() -> Iterator[None]:
    """While active (start-up: loading the model can take minutes), every stop signal unwinds as KeyboardInterrupt,
    so `finally` blocks run instead of the process ending where it stands."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class StoppableServer(uvicorn.Server):
    """uvicorn's server, shut down gracefully by every stop signal. uvicorn itself handles SIGINT and SIGTERM only
    and raises the signal again once it has stopped, which ends the process (status 143 for SIGTERM) before the
    caller's cleanup runs; here `run` returns and `stopped_by` names the signal."""

    stopped_by: signal.Signals | None = None
    on_stop: Callable[[], None] | None = None  # called once, at the first stop signal (the worker's drain)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._stop) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        if self.stopped_by is None and self.on_stop is not None:
            self.on_stop()
        self.stopped_by = self.stopped_by or signal.Signals(signum)
        self.handle_exit(signum, frame)  # a second Ctrl-C forces the exit, as in uvicorn
