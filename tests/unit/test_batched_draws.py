"""Batched draws give exactly what one ``random`` call at a time gives, and leave the
generator in the same state."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.simulator.batched_draws import WordBlock
from prefixroute.core.simulator.generators import (FLEET_TENANTS, draw_fleet_batch,
                                                   draw_fleet_prompt)


def test_a_block_of_words_is_the_stream_of_32_bit_draws():
    rng, spec = random.Random(7), random.Random(7)
    block = WordBlock(rng, 10)
    assert block.words.tolist() == [spec.getrandbits(32) for _ in range(10)]


@given(seed=st.integers(0, 2**32), bound=st.integers(1, 2**32 - 1), used=st.integers(0, 40))
@settings(max_examples=60, deadline=None)
def test_next_accepted_word_is_randbelow_and_release_restores_the_state(seed, bound, used):
    rng, spec = random.Random(seed), random.Random(seed)
    block = WordBlock(rng, 64)
    accepted, rank, values = block.accepted(bound), block.rank(bound), block.values(bound)
    pos = 0
    while rank[pos] < len(accepted) and accepted[rank[pos]] < used:
        i = int(accepted[rank[pos]])  # the next accepted word at or after pos
        assert int(values[i]) == spec._randbelow(bound)  # the call randint/choice make
        pos = i + 1
    block.release(pos)
    assert rng.getstate() == spec.getstate()


class OpaqueState(random.Random):
    """A generator whose state is not CPython's layout, as another interpreter's may be."""

    def getstate(self):
        return ("opaque", super().getstate())

    def setstate(self, state):
        super().setstate(state[1])


def test_a_state_of_another_layout_draws_through_random_itself():
    rng, spec = OpaqueState(11), random.Random(11)
    block = WordBlock(rng, 10)
    assert block.words.tolist() == [spec.getrandbits(32) for _ in range(10)]
    block.release(4)
    spec.seed(11)
    for _ in range(4):
        spec.getrandbits(32)
    assert rng.getrandbits(32) == spec.getrandbits(32)


def test_fleet_batch_matches_the_one_at_a_time_prompts_of_all_three_runs():
    rng, spec = random.Random(3), random.Random(3)
    for volatile, route in ((False, 4), (False, 0), (True, 0)):
        batch = draw_fleet_batch(rng, 300, volatile, route)
        for i in range(300):
            prompt = draw_fleet_prompt(spec, volatile)
            assert FLEET_TENANTS[batch.tenants[i]] == prompt.tenant
            assert [f"u{v}" for v in batch.user[i].tolist()] == prompt.user
            if volatile:
                assert prompt.head == f"time={batch.head[i]}"
            if route:
                assert batch.routes[i] == spec.randrange(route)
        assert rng.getstate() == spec.getstate()


def test_fleet_batch_reads_more_words_when_the_first_block_runs_short():
    rng, spec = random.Random(11), random.Random(11)
    batch = draw_fleet_batch(rng, 5, True, 3, read_ahead=8)  # 5 prompts need ~330 words
    for i in range(5):
        prompt = draw_fleet_prompt(spec, True)
        assert FLEET_TENANTS[batch.tenants[i]] == prompt.tenant
        assert [f"u{v}" for v in batch.user[i].tolist()] == prompt.user
        assert batch.routes[i] == spec.randrange(3)
    assert rng.getstate() == spec.getstate()
