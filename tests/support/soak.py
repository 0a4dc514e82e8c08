"""A soak test of `python -m builder_plugin.serve`: many mixed requests from several client threads at once, over
HTTP only (the server is a subprocess), then every answer compared with an independent in-process Chat.

    report = run_soak(package, requests=500, concurrency=4, seed=0, max_tokens=8, timeout_s=900)
    report.failures()  # [] when every check holds

Requests (soak_traffic): text, image (photographs) and audio questions, streamed or not; streams closed after a
chunk or two; bad requests, each of which must get its 4xx and OpenAI's error object; conversations that grow by one
question per request (each request re-sends the whole history with the server's earlier answers, as a chat app
does), regenerate their last answer (the same history again) or edit their last question, their requests going out
from whichever thread is free. Greedy search, `max_tokens` new tokens.

Checks: every request answered in time, and no unexpected error (a reply of the wrong kind, an exception, a
traceback in the server's log); every answer (text, finish reason, token counts) equal to Chat's for the same
conversation, its questions asked in order after clear(); the server's resident memory at the end no more than
`rss_tolerance` above the sample taken after the first `warmup` requests, and its thread count not above that
sample's; exit status 0 on SIGTERM; nothing left in its temporary folder (TMPDIR) after it stopped.

Both checked thread samples count an idle server whose worker-thread pool is at its floor. Starlette runs blocking
calls on anyio's worker threads, made on demand; an idle one is ended only when a later call is dispatched after it
has been idle POOL_IDLE_S. So an idle server keeps its pool's high-water mark, which depends on how many requests
overlapped so far, not on a leak. Before each of these samples the soak waits that long with nothing out and sends
one plain question (not counted among the requests, its answer not checked): anyio then ends every expired worker.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tests.support.server_process import ServerProcess
from tests.support.soak_client import SoakClient
from tests.support.soak_traffic import Answer, Question, Step, Traffic, soak_media

if TYPE_CHECKING:
    from builder_plugin.runtime import Chat

SAMPLE_EVERY = 50  # requests between the samples taken under load after the first one (reported, not checked)
STOP_TIMEOUT_S = 60
BURST_TIMEOUT_S = 30  # the first requests of the clients wait this long for each other
# anyio ends a worker thread idle this long at its next dispatch (WorkerThread.MAX_IDLE_TIME, 10 s), plus a margin
POOL_IDLE_S = 10.5
MiB = 1 << 20


@dataclass
class SoakReport:
    requests: int  # planned
    concurrency: int
    max_tokens: int
    completed: int = 0  # requests that got a reply (expected or not)
    counts: dict[str, int] = field(default_factory=dict)  # requests sent, per kind
    streamed: int = 0
    errors: list[str] = field(default_factory=list)  # unexpected replies, exceptions, tracebacks the server logged
    mismatches: list[str] = field(default_factory=list)  # answers unlike Chat's
    checked_answers: int = 0
    # (requests answered, VmRSS bytes / threads) of the server: the first after `warmup` requests and the last after
    # all of them, with no request out; those between under load
    rss_samples: list[tuple[int, int]] = field(default_factory=list)
    thread_samples: list[tuple[int, int]] = field(default_factory=list)
    warmup: int = 0
    rss_tolerance: float | None = 0.05  # None: memory is reported, not checked
    leftover_files: list[str] = field(default_factory=list)  # in its temporary folder after the server stopped
    exit_code: int | None = None  # of the server after SIGTERM (None: it had to be killed or never started)
    duration_s: float = 0.0  # of the requests
    latency_s: dict[str, list[float]] = field(default_factory=dict)  # per kind
    server_command: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float | None:
        """Last sample over the first one, minus 1."""
        if len(self.rss_samples) < 2:
            return None
        return self.rss_samples[-1][1] / self.rss_samples[0][1] - 1

    def failures(self) -> list[str]:
        """The checks that failed, one sentence each (empty: all hold)."""
        failed = []
        if self.completed < self.requests:
            failed.append(f"only {self.completed} of {self.requests} requests were answered in time")
        if self.errors:
            failed.append(f"{len(self.errors)} unexpected errors, the first: {self.errors[0]}")
        if self.mismatches:
            failed.append(f"{len(self.mismatches)} of {self.checked_answers} answers differ from Chat's, the "
                          f"first: {self.mismatches[0]}")
        if len(self.rss_samples) < 2 or len(self.thread_samples) < 2:
            failed.append("the server's memory and threads were not sampled twice")
        else:
            growth = self.rss_growth
            if self.rss_tolerance is not None and growth is not None and growth > self.rss_tolerance:
                failed.append(f"the server's RSS grew by {growth:.1%} (over {self.rss_tolerance:.0%}) from "
                              f"{self.rss_samples[0][1] / MiB:.1f} MiB after {self.rss_samples[0][0]} requests to "
                              f"{self.rss_samples[-1][1] / MiB:.1f} MiB at the end")
            (first_at, first), (_, last) = self.thread_samples[0], self.thread_samples[-1]
            if last > first:
                failed.append(f"the server has {last} threads at the end, {first} after {first_at} requests")
        if self.exit_code != 0:
            failed.append(f"the server's exit status on SIGTERM was {self.exit_code} (None: killed)")
        if self.leftover_files:
            failed.append(f"{len(self.leftover_files)} files left in the server's temporary folder: "
                          f"{self.leftover_files[:3]}")
        return failed


@dataclass(frozen=True)
class _Exchange:
    """A checked request and what the server answered (None: an error, listed at `error_at` in the report)."""

    step: Step
    answer: Answer | None
    error_at: int | None = None


def run_soak(package: str | Path, *, requests: int, concurrency: int, seed: int, max_tokens: int,
             server_args: Sequence[str] = (), timeout_s: float, log: Callable[[str], None] = print,
             warmup: int = 50, rss_tolerance: float | None = 0.05, work_dir: str | Path | None = None,
             keep_logs: str | Path | None = None) -> SoakReport:
    """Serve `package` in a subprocess, send `requests` mixed requests from `concurrency` threads (none started
    after `timeout_s`, counted from the start), stop the server and check everything (see the module's docstring).

    The first memory and thread sample is taken once the first `warmup` requests are answered and before any other
    is sent, the last one after the last answer, so both see an idle server. The media and the server's logs go to
    a temporary folder in `work_dir` (default: the system's), removed at the end; `keep_logs`: a folder to copy the
    server's stdout and stderr to."""
    package = Path(package)
    if requests < 2 or concurrency < 1 or max_tokens < 1:
        raise ValueError("requests must be at least 2, concurrency and max_tokens positive")
    warmup = max(1, min(warmup, requests - 1))
    report = SoakReport(requests, concurrency, max_tokens, warmup=warmup, rss_tolerance=rss_tolerance)
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="builder-plugin-soak-", dir=work_dir) as work:
        work = Path(work)
        media = soak_media(work / "media")
        server_tmp = work / "server-tmp"
        server = ServerProcess(package, server_tmp, work, server_args)
        report.server_command = server.command
        traffic = Traffic(requests, seed, media, max_tokens, clients=concurrency)
        run = _Run(server, traffic, report, log)
        try:
            server.start(deadline)
            log(f"serving {server.model_id} at {server.url} (pid {server.pid})")
            started = time.monotonic()
            run.drive(warmup, deadline, burst=min(traffic.burst, warmup))
            run.sample(settled=True)
            run.drive(requests, deadline)
            report.duration_s = time.monotonic() - started
            run.sample(settled=True)
        except Exception as exc:  # the server did not start, or died: reported, and the checks fail
            report.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            report.exit_code = server.stop(STOP_TIMEOUT_S)
        report.counts = dict(sorted(run.counts.items()))
        report.errors += [f"the server logged a traceback: {line}" for line in server.logged_tracebacks()]
        if keep_logs is not None:
            Path(keep_logs).mkdir(parents=True, exist_ok=True)
            for path in (server.stdout_path, server.stderr_path):
                shutil.copyfile(path, Path(keep_logs) / path.name)
        report.leftover_files = sorted(str(p.relative_to(server_tmp)) for p in server_tmp.rglob("*")
                                       if not p.name.startswith(".ses"))  # onnxruntime's telemetry session id
        answered = [e for e in run.exchanges if e.answer is not None]
        report.checked_answers = len(answered)
        log(f"{report.completed} requests in {report.duration_s:.1f} s; server exit status {report.exit_code}; "
            f"comparing {len(answered)} answers with Chat")
        if run.exchanges:
            compare_with_chat(package, run.exchanges, report)
    return report


class _Run:
    """The client threads of one run and what they collect."""

    def __init__(self, server: ServerProcess, traffic: Traffic, report: SoakReport,
                 log: Callable[[str], None]) -> None:
        self.server = server
        self.traffic = traffic
        self.report = report
        self.log = log
        self.exchanges: list[_Exchange] = []
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def drive(self, until: int, deadline: float, burst: int = 0) -> None:
        """Send the plan's requests before number `until` from `concurrency` threads; return when all are answered.
        The first request of each of the first `burst` threads goes out at the same moment."""
        together = threading.Barrier(burst) if burst > 1 else None
        threads = [threading.Thread(target=self._client, args=(until, deadline, together if i < burst else None),
                                    name=f"soak-client-{i}") for i in range(self.report.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def sample(self, settled: bool = False) -> None:
        """The server's resident memory and thread count now (OSError when the process is gone). `settled`: with no
        request out, the worker-thread pool brought to its floor first (see the module's docstring), then the
        fewest threads over the next second (a thread that finishes its request's tail may still be there for a
        moment; a leaked one stays)."""
        report = self.report
        if settled:
            self._prune_pool()
        report.rss_samples.append((report.completed, self.server.rss_bytes()))
        threads = self.server.thread_count()
        for _ in range(10 if settled else 0):
            time.sleep(0.1)
            threads = min(threads, self.server.thread_count())
        report.thread_samples.append((report.completed, threads))
        self.log(f"{report.completed}/{report.requests} requests, server RSS {report.rss_samples[-1][1] / MiB:.1f} "
                 f"MiB, {report.thread_samples[-1][1]} threads")

    def _prune_pool(self) -> None:
        """Wait until every idle worker thread has expired, then send one plain question, whose dispatch ends them."""
        time.sleep(POOL_IDLE_S)
        with httpx.Client(timeout=STOP_TIMEOUT_S) as client:
            reply = client.post(f"{self.server.url}/chat/completions", json={
                "model": self.server.model_id, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Say hello."}]})
        reply.raise_for_status()

    def _client(self, until: int, deadline: float, together: threading.Barrier | None) -> None:
        client = SoakClient(self.server.url, self.server.model_id, self.report.max_tokens)
        try:
            while (step := self.traffic.take(until, deadline)) is not None:
                with self._lock:
                    self.counts[step.kind] += 1
                    self.report.streamed += step.stream
                if together is not None:
                    with contextlib.suppress(threading.BrokenBarrierError):
                        together.wait(timeout=BURST_TIMEOUT_S)
                    together = None
                started = time.monotonic()
                try:
                    answer, error = client.send(step, timeout=max(1.0, deadline - started)), None
                except Exception as exc:
                    answer, error = None, f"{type(exc).__name__}: {exc}"
                self.traffic.finish(step, None if error else answer)
                self._done(step, time.monotonic() - started, answer, error)
        except Exception as exc:  # a bug of the soak itself: reported, and its requests are missing
            with self._lock:
                self.report.errors.append(f"a client thread failed: {type(exc).__name__}: {exc}")
        finally:
            client.close()

    def _done(self, step: Step, seconds: float, answer: Answer | None, error: str | None) -> None:
        report = self.report
        with self._lock:
            report.completed += 1
            report.latency_s.setdefault(step.kind, []).append(round(seconds, 4))
            if error is not None:
                report.errors.append(f"{step.describe()}: {error}")
                if step.checked:  # Chat is asked too: does it fail on this conversation as well?
                    self.exchanges.append(_Exchange(step, None, len(report.errors) - 1))
            elif step.checked:
                self.exchanges.append(_Exchange(step, answer))
            if report.completed > report.warmup and (report.completed - report.warmup) % SAMPLE_EVERY == 0 \
                    and report.completed < report.requests:
                with contextlib.suppress(OSError):  # a server that is gone fails the last sample
                    self.sample()


class ReferenceChat:
    """Chat's answers to conversations, each asked in order after clear(); a conversation that extends the one
    asked last asks only its new question."""

    def __init__(self, chat: Chat, max_tokens: int) -> None:
        self.chat = chat
        self.max_tokens = max_tokens
        self.answers: dict[tuple[str | None, tuple[Question, ...]], Answer] = {}
        self._asked: tuple[str | None, tuple[Question, ...]] | None = None

    def answer(self, system: str | None, asked: tuple[Question, ...]) -> Answer:
        key = (system, asked)
        if key not in self.answers:
            if self._asked != (system, asked[:-1]):
                self.chat.clear()
                self.chat.system, self.chat.tools = system, None
                self._asked = (system, ())
            for i in range(len(self._asked[1]), len(asked)):
                question = asked[i]
                self._asked = None  # until the answer is recorded (a failure leaves the conversation unknown)
                text = "".join(self.chat.ask(question.text, question.images, question.audios,
                                             max_new_tokens=self.max_tokens))
                stats = self.chat.last_stats
                self.answers[system, asked[:i + 1]] = Answer(text, stats.finish_reason, stats.prompt_tokens,
                                                             stats.new_tokens)
                self._asked = (system, asked[:i + 1])
        return self.answers[key]


def compare_with_chat(package: Path, exchanges: list[_Exchange], report: SoakReport) -> None:
    """Chat's answer (greedy, the same package) for every checked request: a mismatch for each answer unlike it,
    and a note on each request that failed (whether Chat fails on the same conversation)."""
    from builder_plugin.runtime import Chat

    reference = ReferenceChat(Chat(package), report.max_tokens)
    # Sorted by conversation, so each one's requests are asked as one growing conversation.
    for exchange in sorted(exchanges, key=lambda e: (e.step.system or "", e.step.asked, e.step.index)):
        step = exchange.step
        try:
            expected, failure = reference.answer(step.system, step.asked), None
        except Exception as exc:
            expected, failure = None, f"{type(exc).__name__}: {exc}"
        if exchange.error_at is not None:
            note = f"Chat fails on it too: {failure}" if failure else f"Chat answers it: {expected}"
            report.errors[exchange.error_at] += f" ({note})"
        elif failure is not None:
            report.mismatches.append(f"{step.describe()}: Chat fails on it: {failure}")
        elif exchange.answer != expected:
            report.mismatches.append(f"{step.describe()}: the server answered {exchange.answer}, Chat {expected}")
