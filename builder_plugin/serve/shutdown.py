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
    caller's cleanup runs; here `run` returns and `stopped_by` names the signal.

    The first stop signal runs `drain` on a thread of its own while the server keeps listening, so that the requests
    that come meanwhile (and readiness probes) get a 503 rather than a refused connection; the server closes when it
    returns. A second stop signal closes it at once."""

    stopped_by: signal.Signals | None = None
    drain: Callable[[], None] | None = None  # returns once the answers in progress have ended

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
        if self.stopped_by is not None or self.drain is None:
            self.stopped_by = self.stopped_by or signal.Signals(signum)
            self.handle_exit(signum, frame)  # a second Ctrl-C forces the exit, as in uvicorn
            return
        self.stopped_by = signal.Signals(signum)
        threading.Thread(target=self._drain_then_exit, args=(signum,), name="drain", daemon=True).start()

    def _drain_then_exit(self, signum: int) -> None:
        try:
            if self.drain is not None:
                self.drain()
        finally:
            self.handle_exit(signum, None)
