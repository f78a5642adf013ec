"""Workload generators: seeded, and shaped as the worked examples and the design scenario say."""

import random
from collections import Counter

import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.simulator.generators import (design_scenario, draw_fleet_prompt,
                                                   five_turn_conversation, make_workload,
                                                   seed_fleet, skewed_trace, universal_prefix)
from prefixroute.core.simulator.keys import BlockKeyer


def test_fleet_prompts_follow_the_spec_random_stream():
    rng, spec = random.Random(3), random.Random(3)
    prompt = draw_fleet_prompt(rng)
    assert prompt.tenant == spec.choice("ABCDEFGH")
    assert prompt.user == [f"u{spec.randint(0, 10 ** 6)}" for _ in range(60)]
    volatile = draw_fleet_prompt(rng, volatile=True)
    spec.choice("ABCDEFGH")
    [spec.randint(0, 10 ** 6) for _ in range(60)]
    assert volatile.head == f"time={spec.randint(0, 10 ** 6)}"
    assert len(prompt) == 2060 and len(volatile) == 2061


def test_seed_fleet_requests_share_system_prompt_and_tenant_documents():
    requests = list(seed_fleet(requests=50))
    keyer = BlockKeyer()
    keys = {r.request_id: keyer.keys(r) for r in requests}
    same_tenant = [r for r in requests if r.tenant == requests[0].tenant]
    other = next(r for r in requests if r.tenant != requests[0].tenant)
    assert keys[same_tenant[0].request_id][:125] == keys[same_tenant[1].request_id][:125]
    assert keys[other.request_id][:75] == keys[requests[0].request_id][:75]   # system prompt
    assert keys[other.request_id][75] != keys[requests[0].request_id][75]     # document


def test_generators_repeat_for_a_seed():
    a = [(r.arrival_s, list(r.token_ids)) for r in design_scenario(requests=20, seed=5,
                                                                  prefix_tokens=100)]
    b = [(r.arrival_s, list(r.token_ids)) for r in design_scenario(requests=20, seed=5,
                                                                  prefix_tokens=100)]
    assert a == b


def test_design_scenario_has_a_hot_tenant_and_a_zipf_tail():
    requests = list(design_scenario(requests=4000, prefix_tokens=32, user_tokens_min=1,
                                    user_tokens_max=2))
    counts = Counter(r.tenant for r in requests)
    assert counts["tenant-000"] / 4000 == pytest.approx(0.25, abs=0.03)
    assert counts.most_common(1)[0][0] == "tenant-000"
    # 50,000 requests/day: the mean gap is 86,400 / 50,000 = 1.73 s
    duration = requests[-1].arrival_s - requests[0].arrival_s
    assert duration / 3999 == pytest.approx(1.728, rel=0.1)


def test_timestamp_at_top_leaves_nothing_to_share_between_seconds():
    requests = list(design_scenario(requests=50, prefix_tokens=64, timestamp_at_top=True))
    keyer = BlockKeyer()
    first_blocks = {keyer.keys(r)[0] for r in requests}
    # Only requests of one tenant within the same second (same stamp) share a block.
    assert len(first_blocks) == len({(int(r.arrival_s), r.tenant) for r in requests})
    assert all(r.prefix_group is None for r in requests)


def test_five_turn_conversation_grows_turn_by_turn():
    turns = list(five_turn_conversation())
    assert [t.input_tokens for t in turns] == [400, 700, 1000, 1400, 1700]
    for previous, current in zip(turns, turns[1:]):
        assert list(current.token_ids[:previous.input_tokens + previous.output_tokens]) == \
            list(previous.token_ids) + list(previous.output_token_ids)


def test_skewed_trace_and_universal_prefix_shapes():
    skewed = list(skewed_trace())
    assert "".join(r.tenant for r in skewed) == "AABACABDAACBADABCABA"
    assert len(list(skewed_trace(hot_burst=8))) == 28
    universal = list(universal_prefix())
    assert len(universal) == 50
    assert len({tuple(r.token_ids[:200]) for r in universal}) == 1


def test_unknown_workloads_and_parameters_are_config_errors():
    with pytest.raises(ConfigError, match="unknown workload"):
        make_workload("nope")
    with pytest.raises(ConfigError, match="no parameter 'rat'"):
        make_workload("seed-fleet", {"rat": "2"})
    with pytest.raises(ConfigError, match="requests"):
        make_workload("seed-fleet", {"requests": "x"})
