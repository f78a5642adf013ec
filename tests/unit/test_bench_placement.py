"""benchmarks/placement.py: per-replica LRUs with no timing, placed by affinity or with
foresight, on cases small enough to follow block by block."""

import sys
from pathlib import Path

import pytest

from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import prepare_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import placement  # noqa: E402


IDS = {"A": 1, "B": 2, "C": 3}


def one_block_requests(blocks):
    """Each request is one full block (its hash id) and one more token, so the block can
    hit: 17 prompt tokens."""
    return prepare_workload([Request(f"r{i}", float(i), 17, 1, 16,
                                     hash_ids=[IDS[b], 1000 + i])
                             for i, b in enumerate(blocks)])


def test_foresight_pushes_out_a_dead_block_where_affinity_pushes_out_a_live_one():
    # Two replicas of one block each. A goes to replica 0, B to replica 1, and B is never
    # used again. C (never used again either) hits nowhere: affinity breaks the tie to the
    # lower index and pushes A out, so A's return misses; foresight sees that replica 1 would
    # lose only the dead B and puts C there, and A hits: 16 of the 4 x 17 prompt tokens.
    workload = one_block_requests(["A", "B", "C", "A"])
    hit = {s: placement.replay(workload, 2, 1, s)["token_hit_rate"]
           for s in placement.STRATEGIES}
    assert hit["affinity"] == 0.0
    assert hit["foresight"] == pytest.approx(16 / 68)
    # One LRU of both replicas' two blocks: C pushes A out (A, B, C in that order).
    assert hit["fleet LRU"] == 0.0


def test_placement_keeps_request_counts_within_the_balance_bound():
    # Every request is the same block. Request i may go to a replica with at most
    # 1.25 (i + 1) / 2 + 1 requests after it: replica 0 takes requests 0 (a miss) and 1, and
    # request 2 would make it 3 > 2.875, so it goes to replica 1 and misses there once. From
    # then on both hold A and equal hits go to the replica with fewer requests.
    workload = one_block_requests(["A"] * 8)
    result = placement.replay(workload, 2, 4, "affinity")
    assert result["token_hit_rate"] == pytest.approx(6 * 16 / (8 * 17))
    assert result["busiest_over_mean"] == 1.0
    # On one replica there is nothing to balance: 7 of 8 hit.
    assert placement.replay(workload, 1, 4, "affinity")["token_hit_rate"] == \
        pytest.approx(7 * 16 / (8 * 17))
