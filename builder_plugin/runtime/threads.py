"""How many threads a package's sessions compute with, chosen when it is loaded (never written into the package).

- onnxruntime-genai 0.18 gives every session it creates ``min(16, hardware_concurrency / 2)`` intra-op threads unless
  ``session_options.intra_op_num_threads`` says otherwise: half the logical CPUs, which is one thread per core only on
  a machine with two hardware threads per core. On a machine without SMT (most cloud VMs, many laptops' efficiency
  cores) it leaves half the cores idle; it also ignores the process's CPU affinity (taskset, cgroup cpusets). Each
  session has its own pool (no global pools), so the count must be set for each: decoder, embedding, vision, speech.
- Decoding is memory-bound and one core cannot saturate the memory bus, so the default here is one thread per
  physical core this process may run on (``os.sched_getaffinity``; the hardware threads of one core count once, as
  they share its load and vector units, and a second thread per core only takes turns on them), overridable.
- Idle pool threads sleep at once instead of spinning first (``session.intra_op.allow_spinning`` "0", unless the
  package sets it): with other work on the machine a spinning thread takes the core a computing one needs, and with
  two threads per session that made decoding slower than one thread; with spinning off two threads were faster than
  one in every measured pair (benchmarks/bench_threads.py). It also spends no battery on busy-waiting.
- onnxruntime-genai's overlay parser merges a decoder ``session_options`` object into the existing one, but replaces
  the ``session_options`` of every other section with a fresh object: the embedding, vision and speech sections of
  the overlay therefore repeat the package's own options (``session.disable_prepacking`` and the providers) in full.
  A section without its own options follows the decoder's, as in the package.
- A model that never runs some of its sessions (a text-only decoder's og.Model, which onnxruntime-genai loads with the
  vision and speech sessions all the same) gives those sessions ``session.disable_prepacking``: nothing they would
  prepack is ever read (the speech model's float audio projections: a 98 MB copy at full size).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from builder_plugin.cpus import available_cores
from builder_plugin.layout import Component

THREADS_KEY = "intra_op_num_threads"
SPINNING_KEY = "session.intra_op.allow_spinning"
NO_SPINNING = "0"
PREPACKING_KEY = "session.disable_prepacking"
# Sections the runtime creates sessions for; the decoder's session_options are the others' fallback.
SESSION_SECTIONS = (Component.DECODER.value, Component.EMBEDDING.value, Component.VISION.value,
                    Component.SPEECH.value)


def genai_default_threads() -> int:
    """The intra-op thread count onnxruntime-genai 0.18 picks itself when a package does not set one."""
    return max(1, min(16, (os.cpu_count() or 2) // 2))


def default_threads() -> int:
    """The intra-op thread count of every session when nobody chooses one: the physical cores this process may use."""
    return available_cores()


def thread_overlay(genai_config: Mapping[str, Any], threads: int | None = None,
                   extra: Mapping[str, str] | None = None, unused: Collection[str] = ()) -> dict[str, Any]:
    """The ``model`` part of an og.Config overlay giving every session `threads` intra-op threads (None:
    `default_threads()`, except where the package itself sets a count), no spinning, and the `extra` options; the
    sessions of the `unused` sections (never run by the model) also no prepacking."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, not {threads!r}")
    count = default_threads() if threads is None else threads
    model = genai_config.get("model", {})
    overlay: dict[str, Any] = {}
    decoder_own = (model.get(Component.DECODER.value) or {}).get("session_options")
    for section in SESSION_SECTIONS:
        own = (model.get(section) or {}).get("session_options")
        if section in unused and section in model:
            own = {**(own if own is not None else decoder_own or {}), PREPACKING_KEY: "1"}
        elif own is None and section != Component.DECODER.value:
            continue  # runs with the decoder's options
        own = dict(own or {})
        chosen = {} if threads is None and THREADS_KEY in own else {THREADS_KEY: count}  # a package's count is kept
        if SPINNING_KEY not in own:
            chosen[SPINNING_KEY] = NO_SPINNING
        chosen.update(extra or {})
        if not chosen:
            continue
        if section == Component.DECODER.value:
            overlay[section] = {"session_options": chosen}  # merged into the decoder's options
        else:
            overlay[section] = {"session_options": {**own, **chosen}}
    return overlay
