"""The fleet worked example through the library vs the seed's own script, side by side.

Both sides replay the same workload: 3 runs x 2,000 requests (random routing, prefix-aware
MD5 routing, prefix-aware with a timestamp at the top) on one ``random.Random(3)`` stream,
4 replicas, each an LRU of 400 blocks of 16 tokens. All must print the same hit rates
(83.67% / 96.82% / 0.00%); the benchmark fails otherwise.

* **library**: :func:`prefixroute.core.simulator.repro_fleet.repro_fleet` (the random stream
  drawn in one block, integer token ids, native xxh3 block keys with each tenant's static
  blocks hashed once and every prompt's own blocks hashed a block position at a time in
  numpy, keys numbered, and each replica's known sequence of requests replayed at once by
  :func:`~prefixroute.core.caches.lru_replay.replay_lru_hits`);
* **baseline** (the headline): the seed's own script: token strings, one ``OrderedDict`` per
  replica, and for every block a chained key, the SHA-256 of ``parent + "|" + block`` (the
  previous key, then the block's joined tokens);
* **prefix baseline** (for reference, slow): the same, but each block's key is the SHA-256 of
  the whole prompt text up to the end of that block (unchained; quadratic in prompt length).

Usage: ``python benchmarks/sim_vs_baseline.py [--repeat N] [--skip-prefix-baseline]``.
Target: library >= 10x faster than the chained baseline. Each side reports the best wall time
and the best process CPU time of its repeats, which alternate between the two sides: on a
machine shared with other work the CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections import OrderedDict

SYSTEM = [f"s{i}" for i in range(1200)]
DOCS = {t: [f"{t}{i}" for i in range(800)] for t in "ABCDEFGH"}
BLOCK, CAPACITY, REPLICAS, REQUESTS = 16, 400, 4, 2000


def block_keys(tokens: list[str], chained: bool = True) -> list[str]:
    """One key per full block: chained, SHA-256 of ``parent + "|" + block`` (the first
    block's parent is ""); otherwise SHA-256 of the whole prompt up to the block's end."""
    keys = []
    parent = ""
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        if chained:
            parent = hashlib.sha256((parent + "|" + " ".join(
                tokens[end - BLOCK:end])).encode()).hexdigest()
            keys.append(parent)
        else:
            keys.append(hashlib.sha256(" ".join(tokens[:end]).encode()).hexdigest())
    return keys


def baseline(chained: bool = True) -> dict[str, float]:
    rng = random.Random(3)
    out = {}
    for name, volatile, prefix_aware in (("random", False, False),
                                         ("prefix_aware", False, True),
                                         ("timestamp_at_top", True, True)):
        caches = [OrderedDict() for _ in range(REPLICAS)]
        hit = total = 0
        for _ in range(REQUESTS):
            tenant = rng.choice("ABCDEFGH")
            user = [f"u{rng.randint(0, 10 ** 6)}" for _ in range(60)]
            tokens = SYSTEM + DOCS[tenant] + user
            if volatile:
                tokens = [f"time={rng.randint(0, 10 ** 6)}"] + tokens
            if prefix_aware:
                replica = int(hashlib.md5(" ".join(tokens[:1280]).encode()).hexdigest(), 16) \
                    % REPLICAS
            else:
                replica = rng.randrange(REPLICAS)
            keys = block_keys(tokens, chained)
            cache = caches[replica]
            hits, prefix = 0, True
            for key in keys:
                if key in cache:
                    cache.move_to_end(key)
                    if prefix:
                        hits += 1
                else:
                    prefix = False
                    cache[key] = None
                    if len(cache) > CAPACITY:
                        cache.popitem(last=False)
            hit += hits * BLOCK
            total += len(tokens)
        out[name] = hit / total
    return out


def library() -> dict[str, float]:
    from prefixroute.core.simulator.repro_fleet import repro_fleet
    return repro_fleet()


def timed(fns: list, repeat: int) -> list[tuple[float, float, dict]]:
    """Best wall and best CPU seconds of each of ``fns`` over ``repeat`` rounds, and its
    result. The rounds interleave the contenders (A, B, A, B, ...), so a change of load on
    the shared machine falls on both sides alike."""
    best = [[float("inf"), float("inf"), None] for _ in fns]
    for _ in range(repeat):
        for fn, row in zip(fns, best):
            start, start_cpu = time.perf_counter(), time.process_time()
            row[2] = fn()
            row[0] = min(row[0], time.perf_counter() - start)
            row[1] = min(row[1], time.process_time() - start_cpu)
    return [tuple(row) for row in best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="best of N (default 3)")
    parser.add_argument("--skip-prefix-baseline", action="store_true",
                        help="do not run the slow unchained baseline")
    args = parser.parse_args()
    import prefixroute.core.simulator.repro_fleet  # noqa: F401  (import outside the timing)
    library()  # warm-up: numpy's first calls and the module-level tables

    (lib_s, lib_cpu, lib), (chain_s, chain_cpu, chain) = timed(
        [library, lambda: baseline(chained=True)], args.repeat)
    rows = [("baseline (chained SHA-256)", chain_s, chain_cpu, chain, "target >= 10x")]
    if not args.skip_prefix_baseline:
        [(base_s, base_cpu, base)] = timed([lambda: baseline(chained=False)], 1)
        rows.append(("prefix baseline (reference)", base_s, base_cpu, base, ""))
    for name in lib:
        for row in rows:
            assert round(lib[name], 6) == round(row[3][name], 6), (name, lib[name], row)
    rates = " / ".join(f"{lib[n]:.2%}" for n in lib)
    print(f"hit rates (all agree): {rates}")
    print(f"{'':30s} {'wall s':>8s} {'cpu s':>8s}  library is faster by (wall / cpu)")
    print(f"{'library':30s} {lib_s:8.3f} {lib_cpu:8.3f}")
    for label, wall, cpu, _, note in rows:
        print(f"{label:30s} {wall:8.3f} {cpu:8.3f}  {wall / lib_s:5.1f}x / {cpu / lib_cpu:5.1f}x"
              f"  {note}")


if __name__ == "__main__":
    main()
