"""Emulator throughput: requests per second one emulator serves on one core.

One ``prefixroute replica`` process, pinned to one core with ``taskset``, time model off
(``--time-scale 0``: no waiting; what is measured is HTTP, JSON, token-id prompts, vLLM block
hashing, the engine and the paged cache), serves short non-streaming completions (48-88
prompt tokens from 20 shared prefixes, 8 output tokens). The load comes from this process,
pinned to the other core, keeping ``--concurrency`` requests in flight over keep-alive
connections, bounded by ``--requests`` and ``--seconds``.

Two load generators, run one after the other against the same emulator:

``httpx``
    ``httpx.AsyncClient``, one per connection: httpx's pool scans all its connections on every
    request, which at 32 connections in one client costs more CPU than the emulator spends
    on the request (about 2.5 ms against 0.3 ms here) and then measures the client.
``raw``
    a minimal HTTP/1.1 client on asyncio streams (pre-built requests, Content-Length
    responses): cheap enough that the emulator's core is the limit.

Run: ``python benchmarks/emulator_rps.py`` (under a minute). Target: at least 500 requests
per second (both figures are reported; the exit code follows the first client). ``--json``
prints the result as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import httpx

from prefixroute.edges.emulator.process import EmulatorProcess

TARGET_RPS = 500


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Short prompts: one of 20 shared 48-token prefixes, then 8-40 fresh tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 30000) for _ in range(48)] for _ in range(20)]
    return [rng.choice(prefixes) + [rng.randrange(10, 30000) for _ in range(rng.randint(8, 40))]
            for _ in range(count)]


def _request_bytes(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class _Stats:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors = 0
        self.cached = 0
        self.next_index = 0

    def record(self, start: float, status: int, body: bytes) -> None:
        self.latencies.append(time.perf_counter() - start)
        if status != 200:
            self.errors += 1
        else:
            self.cached += json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]

    def report(self, elapsed: float) -> dict:
        latencies = sorted(self.latencies)
        done = len(latencies)
        return {"requests": done, "seconds": round(elapsed, 3),
                "requests_per_second": round(done / elapsed, 1), "errors": self.errors,
                "latency_ms_p50": round(1000 * statistics.median(latencies), 2),
                "latency_ms_p99": round(1000 * latencies[int(0.99 * (done - 1))], 2),
                "cached_tokens_per_request": round(self.cached / max(1, done - self.errors), 1)}


async def load_httpx(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    """Load with httpx: one AsyncClient per connection (httpx's pool scans every connection
    per request, which costs more than the request itself at 32 connections)."""
    stats = _Stats()
    headers = {"content-type": "application/json"}
    clients = [httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False,
                                 limits=httpx.Limits(max_connections=1))
               for _ in range(concurrency)]
    try:
        await asyncio.gather(*(c.post("/v1/completions", content=bodies[0], headers=headers)
                               for c in clients))  # warm up: connect
        deadline = time.perf_counter() + seconds

        async def worker(client: httpx.AsyncClient) -> None:
            while stats.next_index < len(bodies) and time.perf_counter() < deadline:
                body = bodies[stats.next_index]
                stats.next_index += 1
                start = time.perf_counter()
                response = await client.post("/v1/completions", content=body, headers=headers)
                stats.record(start, response.status_code, response.content)

        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in clients))
        return stats.report(time.perf_counter() - start)
    finally:
        for client in clients:
            await client.aclose()


async def load_raw(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    """Load with a minimal HTTP/1.1 keep-alive client on asyncio streams: about a tenth of
    httpx's CPU per request, so the emulator, not the load generator, is what is measured."""
    host, port = url.removeprefix("http://").split(":")
    stats = _Stats()
    streams = [await asyncio.open_connection(host, int(port)) for _ in range(concurrency)]

    async def exchange(reader, writer, body: bytes) -> tuple[int, bytes]:
        writer.write(_request_bytes("/v1/completions", body))
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await reader.readexactly(length)

    try:
        await asyncio.gather(*(exchange(r, w, bodies[0]) for r, w in streams))  # warm up
        deadline = time.perf_counter() + seconds

        async def worker(reader, writer) -> None:
            while stats.next_index < len(bodies) and time.perf_counter() < deadline:
                body = bodies[stats.next_index]
                stats.next_index += 1
                start = time.perf_counter()
                status, payload = await exchange(reader, writer, body)
                stats.record(start, status, payload)

        start = time.perf_counter()
        await asyncio.gather(*(worker(r, w) for r, w in streams))
        return stats.report(time.perf_counter() - start)
    finally:
        for _, writer in streams:
            writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="at most (default 20000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="at most (default 20)")
    parser.add_argument("--concurrency", type=int, default=32, help="in flight (default 32)")
    parser.add_argument("--max-tokens", type=int, default=8, help="per reply (default 8)")
    parser.add_argument("--server-cpu", type=int, default=1, help="core for the emulator")
    parser.add_argument("--client-cpu", type=int, default=0, help="core for the load")
    parser.add_argument("--client", choices=["raw", "httpx", "both"], default="both",
                        help="load generator: a minimal asyncio HTTP/1.1 client, httpx, or "
                             "both one after the other (default both)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.client_cpu})
    bodies = [json.dumps({"prompt": p, "max_tokens": args.max_tokens}).encode()
              for p in make_prompts(args.requests)]
    clients = ["raw", "httpx"] if args.client == "both" else [args.client]
    results = {}
    with EmulatorProcess(["--time-scale", "0", "--block-size", "16", "--num-blocks", "4096",
                          "--served-model-name", "bench"], cpu=args.server_cpu) as replica:
        for client in clients:
            run = load_raw if client == "raw" else load_httpx
            result = asyncio.run(run(replica.url, bodies, args.concurrency, args.seconds))
            result["meets_target"] = result["requests_per_second"] >= TARGET_RPS
            results[client] = result
    report = {"results": results, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "server_cpu": args.server_cpu,
              "client_cpu": args.client_cpu, "target_rps": TARGET_RPS}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for client, result in results.items():
            print(f"{client:>5} client: emulator on cpu {args.server_cpu} served "
                  f"{result['requests_per_second']} requests/s ({result['requests']} in "
                  f"{result['seconds']} s, {args.concurrency} in flight, p50 "
                  f"{result['latency_ms_p50']} ms, p99 {result['latency_ms_p99']} ms, "
                  f"{result['errors']} errors, {result['cached_tokens_per_request']} cached "
                  f"tokens/request); target {TARGET_RPS}: "
                  f"{'met' if result['meets_target'] else 'NOT met'}")
    result = results[clients[0]]
    return 0 if result["meets_target"] and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
