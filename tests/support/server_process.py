"""`python -m builder_plugin.serve` as a subprocess (the soak run's, the command line's tests): started on a free
127.0.0.1 port, its resident memory and thread count read from /proc, stopped by a signal, and the tracebacks it
logged."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import builder_plugin
from builder_plugin.memory import proc_kib_field

_SERVING = re.compile(r"^serving (\S+) at (http://\S+)$")


class ServerProcess:
    """One server process; its stdout and stderr go to files in `logs` (a pipe nobody reads could fill up), its
    temporary files (TMPDIR) to `tmp` (created), where a client's media would show if the server wrote any."""

    def __init__(self, package: Path | str, tmp: Path, logs: Path, server_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.command = [sys.executable, "-m", "builder_plugin.serve", str(package), "--port", "0",
                        "--host", "127.0.0.1", *server_args]
        self.tmp = tmp
        self.env = dict(env or {})
        self.cwd = cwd
        self.stdout_path = logs / "server.stdout"
        self.stderr_path = logs / "server.stderr"
        self.process: subprocess.Popen | None = None
        self.url = ""  # http://127.0.0.1:PORT/v1
        self.model_id = ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, deadline: float) -> None:
        """Start the server and wait (until `deadline`, time.monotonic) for its "serving MODEL at URL" line."""
        # The server imports the same builder_plugin as this process, wherever it was imported from.
        source = str(Path(builder_plugin.__file__).resolve().parents[1])
        self.tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p),
               "TMPDIR": str(self.tmp), **self.env}
        with open(self.stdout_path, "wb") as stdout, open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(self.command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                            env=env, cwd=self.cwd)
        while True:
            first = self.stdout_path.read_text(encoding="utf-8", errors="replace").partition("\n")
            if first[1]:
                match = _SERVING.match(first[0])
                if match is None:
                    raise RuntimeError(f"the server printed {first[0]!r} instead of its address")
                self.model_id, self.url = match.groups()
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode} before serving: "
                                   f"{self.stderr_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in time")
            time.sleep(0.05)

    def rss_bytes(self) -> int:
        """VmRSS of the server process."""
        rss = proc_kib_field(f"/proc/{self.pid}/status", "VmRSS")
        if rss is None:
            raise RuntimeError("no VmRSS in /proc status")
        return rss

    def thread_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:PORT (the API is under /v1)."""
        return self.url.removesuffix("/v1")

    def stop(self, timeout: float = 60, stop_signal: signal.Signals = signal.SIGTERM) -> int | None:
        """`stop_signal` and wait; the exit status, or None when it had to be killed."""
        if self.process is None:
            return None
        if self.process.poll() is not None:
            return self.process.returncode
        self.process.send_signal(stop_signal)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None

    def stdout_lines(self) -> list[str]:
        return self.stdout_path.read_text(encoding="utf-8", errors="replace").splitlines()

    def stderr_tail(self, lines: int = 5) -> str:
        text = self.stderr_path.read_text(encoding="utf-8", errors="replace") if self.stderr_path.is_file() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def logged_tracebacks(self) -> list[str]:
        """The exception line closing each traceback in the server's log (what it failed on that no client may have
        seen, e.g. while a cancelled stream was torn down)."""
        found, inside = [], False
        for line in self.stderr_path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Traceback (most recent call last)"):
                inside = True
            elif inside and line and not line[0].isspace():
                found.append(line.strip())
                inside = False
        return found


@contextlib.contextmanager
def server_process(package: Path | str, folder: Path, *server_args: str, env: Mapping[str, str] | None = None,
                   cwd: Path | None = None, start_timeout: float = 120) -> Iterator[ServerProcess]:
    """A started server process whose temporary folder is `folder`/tmp and logs `folder`/server.std*; killed at the
    end if the test did not stop it."""
    folder.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(package, folder / "tmp", folder, server_args, env, cwd)
    try:
        server.start(time.monotonic() + start_timeout)
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.process.kill()
            server.process.wait()
