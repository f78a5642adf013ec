"""``prefixroute calibrate``: measure a live engine and write a service-time profile.

``prefixroute calibrate --backend http://127.0.0.1:8000 [--out profile.json]`` sends probes
to an OpenAI-compatible engine (vLLM, or the emulator), one at a time on an otherwise idle
engine:

* prefill: streamed completions of ``u`` random token ids and one output token, for sizes up
  to most of the context; the time to the first streamed token is the prefill time. Before
  each probe the prefix cache is reset (``POST /reset_prefix_cache``, when the engine has it:
  vLLM needs ``VLLM_SERVER_DEV_MODE=1``); otherwise every probe is a fresh random prompt.
  Probes that report ``cached_tokens`` > 0 are retried with a new prompt.
* decode: ``B`` requests at once, short and long contexts, first with one output token, then
  (cache reset again) with 64; the difference of their end-to-end times over 63 is the decode
  step time. End-to-end times, not gaps between streamed chunks: vLLM's API server delivers
  tokens of fast steps in bursts, which makes chunk gaps meaningless.

The repeats of a size are spread over rounds through all sizes, and the median of each size
is fitted. Then it fits ``ttft = a + b*u + c*u^2`` (``c`` only where the probes show it) and
``itl = a' + d1*B + d2*C`` with non-negative least squares
(``prefixroute.core.replica.calibration``); the step overhead is ``a'`` and the rest of the
TTFT intercept, ``a - a'``, is the per-request ``request_overhead_s`` (HTTP, tokenizing:
outside the engine's steps). It writes the profile as the JSON mapping
``profile_from_dict`` reads, so ``prefixroute simulate --profile FILE`` and ``prefixroute
replica --profile FILE`` load it. Without ``--out`` the profile is printed; ``--json``
prints the fit summary and the raw samples too.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          positive_int, write_atomic)

DEFAULT_SIZES = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECODE_TOKENS = 64
TOKEN_ID_LOW, TOKEN_ID_HIGH = 10, 1000  # plain ids every tokenizer has (none special here)


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure a live engine's TTFT and decode step "
                                                "time and write a service-time profile",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, metavar="URL",
                   help="the engine's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", metavar="FILE", help="write the profile here (JSON)")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--name", help="profile name (default 'calibrated-<model>')")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="probes per prompt size (default 3; the median is fitted)")
    p.add_argument("--max-prompt-tokens", type=positive_int,
                   help="largest prefill probe (default: 90%% of the context, at most 8192)")
    p.add_argument("--decode-batches", default="1,4", metavar="B,B",
                   help="decode probe batch sizes (default 1,4, with two contexts each: "
                        "four points for three unknowns; empty: skip decode probes)")
    p.add_argument("--timeout", type=float, default=300.0, help="per request (default 300 s)")
    add_json_argument(p, "the profile, the fit summary and the samples")
    p.set_defaults(handler=run)


def run(args) -> int:
    check_json_destination(args.out, "--out")
    check_json_destination(args.json)
    from prefixroute.core.replica.calibration import calibrated_profile

    url = args.backend.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--backend must be an http(s) URL, got {args.backend!r}")
    try:
        batches = [int(b) for b in args.decode_batches.split(",") if b.strip()]
    except ValueError:
        raise ConfigError(f"--decode-batches must be integers like 1,4, got "
                          f"{args.decode_batches!r}") from None
    if any(b < 1 for b in batches):
        raise ConfigError("--decode-batches must be positive")
    probe = asyncio.run(_measure(url, args, batches))
    name = args.name or f"calibrated-{probe['model']}"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    profile, summary = calibrated_profile(
        name, probe["prefill"], probe["decode"],
        source=f"prefixroute calibrate against {url} ({probe['model']}) on {stamp}; "
               f"{'cache reset' if probe['reset'] else 'unique prompts'} per probe")
    text = json.dumps(profile.to_dict(), indent=2) + "\n"
    if args.out:
        write_atomic(args.out, text)
    if args.json:
        emit_json({"profile": profile.to_dict(), "fit": summary, "model": probe["model"],
                    "cache_reset": probe["reset"],
                    "prefill_samples": [[s.uncached_tokens, s.ttft_s] for s in probe["prefill"]],
                    "decode_samples": [[s.batch, s.context_tokens, s.itl_s]
                                       for s in probe["decode"]]}, args.json)
    elif not args.out:
        sys.stdout.write(text)
    # Only timings are measured: the KV size fields stay the base profile's, which say nothing
    # about the engine probed (a tiny CPU model would read as 50 GiB of llama-3-8b KV).
    print(f"note: only timings are measured; the profile's KV size is the base profile's "
          f"({profile.kv_memory_gib:g} GiB of {profile.model} KV): give the replica "
          f"--num-blocks, or --kv-memory-gib with --model-config, for the engine's own",
          file=sys.stderr)
    fit = summary["prefill"]
    print(f"prefill: a={fit['step_overhead_s']:.3g} s, b={fit['prefill_s_per_token']:.3g} s/token"
          f", c={fit['attention_s_per_token_context']:.3g} s/token^2 (R^2 {fit['r_squared']:.3f},"
          f" {fit['samples']} sizes)" + (f"; wrote {args.out}" if args.out else ""),
          file=sys.stderr)
    if "decode" in summary:
        fit = summary["decode"]
        print(f"decode: a={fit['step_overhead_s']:.3g} s, d1={fit['decode_s_per_seq']:.3g} "
              f"s/seq, d2={fit['decode_s_per_context_token']:.3g} s/context token (R^2 "
              f"{fit['r_squared']:.3f}); outside steps per request: request_overhead_s="
              f"{summary['prefill']['request_overhead_s']:.3g} s", file=sys.stderr)
    return 0


async def _measure(url: str, args, batches: list[int]) -> dict:
    import httpx
    from rich.progress import Progress

    from prefixroute.core.replica.calibration import DecodeSample, PrefillSample

    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, trust_env=False) as client:
        try:
            models = (await client.get("/v1/models")).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"cannot list models at {url}/v1/models: {exc}") from None
        if not models:
            raise InputError(f"{url}/v1/models lists no model")
        model = args.model or models[0]["id"]
        max_model_len = int(models[0].get("max_model_len") or 2048)
        limit = args.max_prompt_tokens or min(8192, int(max_model_len * 0.9))
        limit = min(limit, max_model_len - 2)
        sizes = sorted({s for s in DEFAULT_SIZES if s <= limit} | {limit})
        if len(sizes) < 3:
            raise ConfigError(f"prompts up to {limit} tokens give fewer than 3 probe sizes")
        reset = (await client.post("/reset_prefix_cache")).status_code == 200

        def prompt(n: int) -> list[int]:
            return [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(n)]

        async def stream(tokens: list[int], max_tokens: int) -> tuple[list[float], int]:
            """Arrival times of the streamed tokens, and the cached tokens reported."""
            body = {"model": model, "prompt": tokens, "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            times: list[float] = []
            cached = 0
            start = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:300]
                    raise InputError(f"{url}/v1/completions answered "
                                     f"{response.status_code}: {text}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        times.append(time.perf_counter() - start)
                    usage = chunk.get("usage") or {}
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens") or cached
            return times, cached

        async def timed(tokens: list[int], max_tokens: int) -> float:
            """End-to-end seconds of one non-streamed request of exactly ``max_tokens``."""
            body = {"model": model, "prompt": tokens, "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True}
            start = time.perf_counter()
            response = await client.post("/v1/completions", json=body)
            elapsed = time.perf_counter() - start
            if response.status_code != 200:
                raise InputError(f"{url}/v1/completions answered {response.status_code}: "
                                 f"{response.text[:300]}")
            return elapsed

        await stream(prompt(16), 2)  # warm up
        prefill: list[PrefillSample] = []
        decode: list[DecodeSample] = []
        contexts = sorted({min(128, limit), max(min(limit // 2, limit - DECODE_TOKENS), 16)})
        total = len(sizes) * args.repeats + len(batches) * len(contexts)
        with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
            task = progress.add_task("probing", total=total)
            # Rounds over every size, not all repeats of one size in a row: a spell of load
            # on a shared machine then slows one probe of several sizes, which the medians
            # drop, instead of every probe of one size, which bends the fitted curve.
            measured: dict[int, list[float]] = {size: [] for size in sizes}
            for _ in range(args.repeats):
                for size in sizes:
                    for _attempt in range(3):
                        if reset:
                            await client.post("/reset_prefix_cache")
                        times, cached = await stream(prompt(size), 1)
                        if cached == 0 and times:
                            measured[size].append(times[0])
                            break
                    progress.advance(task)
            prefill.extend(PrefillSample(size, statistics.median(times))
                           for size, times in measured.items() if times)
            for batch in batches:
                for context in contexts:
                    elapsed = {}
                    for max_tokens in (1, DECODE_TOKENS):
                        if reset:
                            await client.post("/reset_prefix_cache")
                        results = await asyncio.gather(*(timed(prompt(context), max_tokens)
                                                         for _ in range(batch)))
                        elapsed[max_tokens] = statistics.median(results)
                    itl = (elapsed[DECODE_TOKENS] - elapsed[1]) / (DECODE_TOKENS - 1)
                    decode.append(DecodeSample(batch, batch * (context + DECODE_TOKENS // 2),
                                               max(itl, 0.0)))
                    progress.advance(task)
    return {"model": model, "reset": reset, "prefill": prefill, "decode": decode}
