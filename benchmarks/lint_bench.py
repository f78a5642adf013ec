"""Benchmark: ``prefixroute lint`` over 10,000 requests of about 2,000 tokens each.

Target: within 30 s on this machine, tokenization included. Timed: reading and parsing
the JSONL log, loading the tokenizer, rendering every chat template, tokenizing every request
(and the rewritten ones for the "after" estimate), the lint itself and the JSON report. Not
timed: training the tiny tokenizer and writing the log, which are set-up.

The log mixes 20 tenants, each with its own system prompt of about 1,300 tokens and four tools,
in multi-turn conversations, and each breaking one layout rule or none (the time on top of the
system prompt, tools in random order, rewritten earlier turns, shuffled few-shot examples, or a
clean layout), so every detector runs.

Run: ``python benchmarks/lint_bench.py [--requests N]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefixroute.core.diagnostics.lint import lint_requests  # noqa: E402
from prefixroute.edges.cli.lint import read_log  # noqa: E402
from prefixroute.edges.tokenization import load_tokenizer  # noqa: E402
from tests.helpers.prompt_fixtures import EXAMPLES, TOOLS  # noqa: E402
from tests.helpers.tiny_tokenizer import TOOLS_CHAT_TEMPLATE, make_tiny_tokenizer  # noqa: E402

TARGET_SECONDS = 30.0
TENANTS = 20
WORDS = ("order shipping return refund warranty customer policy package delivery address "
         "payment invoice account support agent product store item size colour stock price "
         "discount coupon exchange damage photo receipt carrier tracking express standard "
         "international customs duty weekend holiday manager escalate summary polite concise "
         "accurate never always check confirm explain apologise thank offer replace repair").split()
RULES = ("timestamp", "tools", "rewrite", "examples", "clean")


def _policy(rng: random.Random, lines: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 16))).capitalize()
                     + "." for _ in range(lines))


def make_log(path: Path, requests: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    tenants = [{"name": f"tenant-{t:02d}", "rule": RULES[t % len(RULES)],
                "system": _policy(rng, 38), "conversation": []} for t in range(TENANTS)]
    now = datetime(2026, 10, 5, 9, 0, 0, tzinfo=timezone.utc)
    with path.open("w") as out:
        for _ in range(requests):
            tenant = rng.choice(tenants)
            now += timedelta(seconds=rng.randint(1, 20))
            system = tenant["system"]
            if tenant["rule"] == "timestamp":
                system = f"Current time: {now:%Y-%m-%dT%H:%M:%SZ}\n" + system
            tools = copy.deepcopy(TOOLS)
            if tenant["rule"] == "tools":
                rng.shuffle(tools)
            history = tenant["conversation"]
            if not history or len(history) >= 6:
                history = tenant["conversation"] = []
            question = {"role": "user", "content": _policy(rng, 2) + f" Order {rng.randint(1, 10**6)}?"}
            messages = [{"role": "system", "content": system}]
            if tenant["rule"] == "examples":
                examples = list(EXAMPLES)
                rng.shuffle(examples)
                for q, a in examples:
                    messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            turns = copy.deepcopy(history)
            if tenant["rule"] == "rewrite" and turns:
                turns[0]["content"] = "(summary) " + turns[0]["content"][:40]
            messages += turns + [question]
            if tenant["rule"] == "clean":
                messages[-1]["content"] += f"\n(sent {now:%Y-%m-%d %H:%M:%S})"
            history.extend([question, {"role": "assistant", "content": _policy(rng, 1)}])
            body = {"tenant": tenant["name"], "model": "tiny", "tools": tools, "messages": messages}
            out.write(json.dumps(body) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = make_tiny_tokenizer(Path(tmp, "tokenizer"), TOOLS_CHAT_TEMPLATE)
        log = Path(tmp, "requests.jsonl")
        make_log(log, args.requests)
        started = time.perf_counter()
        tokenizer = load_tokenizer(tokenizer_dir)
        requests = read_log(str(log))
        parsed = time.perf_counter()
        report = lint_requests(requests, tokenizer)
        linted = time.perf_counter()
        json.dumps(report.to_dict())
        elapsed = time.perf_counter() - started
    tokens = report.total_tokens
    print(f"linted {report.requests:,} requests, {tokens:,} tokens "
          f"({tokens / report.requests:,.0f} per request), {len(report.tenants)} tenants, "
          f"{len(report.findings)} findings")
    print(f"token hit rate now {report.token_hit_rate_now:.1%}, "
          f"after {report.token_hit_rate_after:.1%}")
    print(f"read+parse {parsed - started:.1f} s, lint {linted - parsed:.1f} s, "
          f"total {elapsed:.1f} s (target {TARGET_SECONDS:.0f} s): "
          f"{'OK' if elapsed <= TARGET_SECONDS else 'TOO SLOW'}")


if __name__ == "__main__":
    main()
