"""What the LongRoPE switch costs an answer that crosses it: one text question whose prompt ends just below
``original_max_position_embeddings``, answered greedily past it, through builder_plugin.runtime.Chat.

    python benchmarks/bench_longrope.py --package PKG [--below 16] [--new-tokens 32]

At the first step past the switch Chat replaces the generator by a prefill of every id so far (the cache recomputed
with the long factors, as the original model does). The report gives the prompt's prefill time, the step that
recomputed against the median decode step, and the peak RSS.
Results: benchmarks/results/longrope.json and the "LongRoPE switch" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import fmt, machine_info, machine_markdown, peak_rss_bytes, replace_markdown_section, write_json  # noqa: E402

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
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "longrope.json")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="'' leaves the docs alone")
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
        "command": "python benchmarks/bench_longrope.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(), "package": str(args.package), "switch": switch,
        "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
        "prefill_s": arrivals[0] - started, "recompute_step_s": steps[crossing],
        "recomputed_tokens": switch, "median_decode_step_s": statistics.median(others),
        "peak_rss_bytes": peak_rss_bytes(), "slowest_step_index": steps.index(max(steps)), "crossing_index": crossing,
    }
    write_json(args.out, results)
    body = "\n".join([
        f"Command: `{results['command']}`", "", machine_markdown(results["machine"]), "",
        f"- prompt: {stats.prompt_tokens} tokens, prefilled in {fmt(results['prefill_s'], 1)} s (first token);",
        f"- the step past position {switch}: {fmt(results['recompute_step_s'], 1)} s (a prefill of the "
        f"{switch} ids so far, then the step), against a median decode step of "
        f"{fmt(1e3 * results['median_decode_step_s'], 0)} ms;",
        f"- once per conversation; peak RSS {fmt(results['peak_rss_bytes'] / 1e9, 2)} GB.", ""])
    print(body)
    if args.doc:
        replace_markdown_section(args.doc, "## LongRoPE switch", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
