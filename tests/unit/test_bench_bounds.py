"""benchmarks/policy_comparison.py: the hit-rate bounds the acceptance table prints next to
ours, on three requests small enough to follow by hand (16-token blocks, an LRU of 2)."""

import sys
from pathlib import Path

import pytest

from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import prepare_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import policy_comparison  # noqa: E402


def workload():
    # a: 33 tokens, two full blocks (ids 1, 2) and a partial one; b: one full block (id 5)
    # that nothing asks for again; c: a's two blocks again.
    return prepare_workload([
        Request("a", 0.0, 33, 1, 16, hash_ids=[1, 2, 10]),
        Request("b", 1.0, 17, 1, 16, hash_ids=[5, 11]),
        Request("c", 2.0, 33, 1, 16, hash_ids=[1, 2, 12]),
    ])


def test_the_fleet_lru_loses_the_shared_prefix_to_a_block_nobody_reuses():
    # After a the LRU holds a's blocks 1, 2; b's block 5 pushes out 1 (the oldest), so c
    # finds nothing: its first block is gone and a prefix cache stops there.
    hit, _ = policy_comparison.fleet_lru_bounds(workload(), 2)
    assert hit == 0.0


def test_an_lru_that_skips_dead_blocks_keeps_it():
    # Block 5 is never used again, so it is not cached: c reuses 2 blocks = 32 of the 83
    # prompt tokens.
    hit, floor = policy_comparison.fleet_lru_bounds(workload(), 2, skip_dead=True)
    assert hit == pytest.approx(32 / 83)
    _, plain_floor = policy_comparison.fleet_lru_bounds(workload(), 2)
    assert floor <= plain_floor


def test_with_room_for_everything_both_give_the_ideal():
    w = workload()
    assert policy_comparison.fleet_lru_bounds(w, 100)[0] == pytest.approx(w.ideal_token_hit_rate)
    assert policy_comparison.fleet_lru_bounds(w, 100, skip_dead=True)[0] == \
        pytest.approx(32 / 83)


def test_belady_keeps_the_same_blocks_here():
    # Belady keeps 1 and 2 (used next by c) and drops 5: the same 32 tokens.
    assert policy_comparison.optimal_hit_bound(workload(), 2) == pytest.approx(32 / 83)
