"""What the LongRoPE switch costs an answer that crosses it: one text question whose prompt ends just below
``original_max_position_embeddings``, answered greedily past it, through builder_plugin.runtime.Chat.

    python -m benchmarks.bench_longrope --package PKG [--below 16] [--new-tokens 32]

At the first step past the switch Chat replaces the generator by a prefill of every id so far (the cache recomputed
with the long factors, as the original model does). The report gives the prompt's prefill time, the step that
recomputed against the median decode step, and the peak RSS.
Results: benchmarks/results/longrope.json and the "LongRoPE switch" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    add_report_options,
    command_line,
    fmt,
    machine_info,
    machine_markdown,
    peak_rss_bytes,
    publish,
)

SENTENCE = "The keeper climbed the stairs of the lighthouse, counted the ships and wrote the weather in his book. "


def long_question(chat, tokens: int) -> str:
    """A question of about `tokens` prompt tokens (the chat template's few included)."""
    import onnxruntime_genai as og

    tokenizer = og.Tokenizer(chat.model(chat.next_variant([], [])))
    words = (SENTENCE * (tokens // 4 + 1)).split()  # at least one token per word
    low, high = 1, len(words)
    while low < high:  # the most words that stay within `tokens`
        middle = (low + high + 1) // 2
        if len(tokenizer.encode(" ".join(words[:middle]))) <= tokens:
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, required=True)
    parser.add_argument("--below", type=int, default=16, help="prompt tokens below the switch")
    parser.add_argument("--new-tokens", type=int, default=32)
    add_report_options(parser, "longrope.json", replay=False)
    args = parser.parse_args(argv)

    from builder_plugin.runtime import Chat, Sampling

    chat = Chat(args.package)
    switch = chat.manifest.original_max_position_embeddings
    if switch is None:
        raise SystemExit("the package's manifest names no LongRoPE switch")
    question = long_question(chat, switch - args.below - 8)  # the chat format adds a few
    arrivals = []
    started = time.perf_counter()
    for _ in chat.ask(question, max_new_tokens=args.new_tokens, sampling=Sampling()):
        arrivals.append(time.perf_counter())
    stats = chat.last_stats
    steps = [b - a for a, b in itertools.pairwise(arrivals)]
    # Token k (0-based) is made after the recompute when prompt + k first exceeds the switch; steps[k - 1] holds it.
    crossing = switch - stats.prompt_tokens
    if not stats.recomputed or not 0 <= crossing < len(steps):
        raise SystemExit(f"the answer did not cross the switch (prompt {stats.prompt_tokens} tokens, "
                         f"{stats.new_tokens} new, switch {switch}); raise --new-tokens")
    others = steps[:crossing] + steps[crossing + 1:]
    results = {
        "command": command_line("bench_longrope.py", argv), "note": args.note,
        "machine": machine_info(), "package": str(args.package), "switch": switch,
        "num_attention_heads": _attention_heads(args.package),
        "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
        "prefill_s": arrivals[0] - started, "recompute_step_s": steps[crossing],
        "recomputed_tokens": switch, "median_decode_step_s": statistics.median(others),
        "peak_rss_bytes": peak_rss_bytes(), "slowest_step_index": steps.index(max(steps)), "crossing_index": crossing,
    }
    publish(results, args.out, args.doc, "## LongRoPE switch", report(results))
    return 0


def _attention_heads(package: Path) -> int:
    from builder_plugin.layout import GENAI_CONFIG_FILE

    return int(json.loads((package / GENAI_CONFIG_FILE).read_text(encoding="utf-8"))["model"]["decoder"]
               ["num_attention_heads"])


def report(results: dict) -> str:
    switch = results["switch"]
    scores_gb = results["num_attention_heads"] * switch * switch * 4 / 1e9
    return "\n".join([
        *([results["note"], ""] if results.get("note") else []),
        f"Command: `{results['command']}`", "", machine_markdown(results["machine"]), "",
        f"- prompt: {results['prompt_tokens']} tokens, prefilled in {fmt(results['prefill_s'], 1)} s (first token);",
        f"- the step past position {switch}: {fmt(results['recompute_step_s'], 1)} s (a prefill of the {switch} ids "
        f"so far, then the step), against a median decode step of {fmt(1e3 * results['median_decode_step_s'], 0)} ms "
        "at that length;",
        "- so crossing the switch costs one more prefill of the conversation, once per conversation;",
        f"- peak RSS {fmt(results['peak_rss_bytes'] / 1e9, 2)} GB (onnxruntime's CPU attention holds the "
        f"[{results['num_attention_heads']} heads, {switch}, {switch}] fp32 scores of a {switch}-token prefill, "
        f"{fmt(scores_gb, 1)} GB).", ""])

if __name__ == "__main__":
    sys.exit(main())
