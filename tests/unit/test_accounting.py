"""Trace-driven provider-cache accounting, checked by hand.

Blocks are 16 tokens. A 2,048-token prompt is 128 full blocks; the default minimum cacheable
length is 1,024 tokens (64 blocks); the lookback is 20 blocks.
"""

from __future__ import annotations

from array import array

import pytest

from prefixroute.core.economics.accounting import (
    MAX_BREAKPOINTS,
    Breakpoint,
    CacheModel,
    ProviderCacheReplay,
    account_trace,
    growing_conversation_demo,
    ledger_costs,
    min_cacheable_tokens,
    parse_breakpoints,
)
from prefixroute.core.economics.presets import EXPLICIT_OBJECT, FIVE_MINUTE, ONE_HOUR
from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.simulator.request import Request

BLOCK = 16


def prompt(length: int, start: int = 1) -> array:
    return array("I", range(start, start + length))


def request(arrival: float, tokens: array, *, name: str = "", group: str | None = "doc",
            prefix_tokens: int = 0) -> Request:
    return Request(name or f"r@{arrival:g}", arrival, len(tokens), 1, BLOCK, token_ids=tokens,
                   prefix_group=group, prefix_tokens=prefix_tokens)


def charges(requests, policy=FIVE_MINUTE, model=CacheModel()):
    replay = ProviderCacheReplay(policy, model)
    return [replay.charge(r) for r in requests], replay


# --- the TTL: write, read (refresh), write -------------------------------------------------------


def test_three_requests_at_0_200_600_s_write_then_read_then_write_again():
    same = prompt(2048)
    out, _ = charges([request(t, same) for t in (0, 200, 600)])
    assert [(c.written_tokens, c.read_tokens, c.uncached_tokens) for c in out] == [
        (2048, 0, 0),  # t=0: nothing cached, the whole prompt is written; lives until 300 s
        (0, 2048, 0),  # t=200: live, read; the read refreshes the entry until 500 s
        (2048, 0, 0),  # t=600: expired at 500 s, written again
    ]


def test_a_read_refreshes_the_ttl_so_a_request_at_450_s_still_reads():
    same = prompt(2048)
    out, _ = charges([request(t, same) for t in (0, 200, 450)])
    # Without the refresh at 200 s the entry would have expired at 300 s.
    assert [c.read_tokens for c in out] == [0, 2048, 2048]


def test_an_entry_expires_exactly_at_write_time_plus_ttl():
    same = prompt(2048)
    out, _ = charges([request(t, same) for t in (0, 300)])
    assert [c.read_tokens for c in out] == [0, 0]


def test_a_longer_ttl_keeps_the_600_s_request_a_read():
    same = prompt(2048)
    out, _ = charges([request(t, same) for t in (0, 200, 600)], policy=ONE_HOUR)
    assert [c.read_tokens for c in out] == [0, 2048, 2048]


def test_automatic_caching_reads_the_shared_prefix_and_writes_the_new_suffix():
    shared = prompt(1600)
    first = shared + prompt(400, start=10_000)
    second = shared + prompt(400, start=20_000)
    out, _ = charges([request(0, first), request(10, second)])
    # 1,600 shared tokens = 100 full blocks; the second prompt's remaining 25 blocks are new.
    assert (out[1].read_tokens, out[1].written_tokens, out[1].uncached_tokens) == (1600, 400, 0)


def test_the_partial_last_block_is_never_cached():
    out, _ = charges([request(0, prompt(2050)), request(1, prompt(2050))])
    assert (out[0].written_tokens, out[0].uncached_tokens) == (2048, 2)
    assert (out[1].read_tokens, out[1].uncached_tokens) == (2048, 2)


# --- minimum cacheable length -------------------------------------------------------------------


def test_a_prompt_below_the_minimum_is_never_cached():
    same = prompt(1000)
    out, _ = charges([request(t, same) for t in (0, 10)])
    assert [(c.written_tokens, c.read_tokens, c.uncached_tokens) for c in out] == [
        (0, 0, 1000), (0, 0, 1000)]


def test_with_a_512_token_minimum_the_same_prompt_is_written_then_read():
    same = prompt(1000)
    out, _ = charges([request(t, same) for t in (0, 10)], model=CacheModel(min_cacheable_tokens=512))
    # 1,000 tokens = 62 full blocks (992 tokens) + 8 uncached.
    assert [(c.written_tokens, c.read_tokens, c.uncached_tokens) for c in out] == [
        (992, 0, 8), (0, 992, 8)]


def test_a_shared_prefix_shorter_than_the_minimum_is_not_read():
    shared = prompt(512)
    first = shared + prompt(1536, start=10_000)
    second = shared + prompt(1536, start=20_000)
    out, _ = charges([request(0, first), request(1, second)])
    # The 512 shared tokens match, but a read needs at least 1,024 tokens: all written again.
    assert (out[1].read_tokens, out[1].written_tokens) == (0, 2048)


def test_minimum_by_model_family():
    assert min_cacheable_tokens("claude-haiku-4.5") == 4096
    assert min_cacheable_tokens("claude-opus-5") == 512
    assert min_cacheable_tokens("2048") == 2048
    with pytest.raises(ConfigError):
        min_cacheable_tokens("gpt-9000")
    with pytest.raises(ConfigError):
        min_cacheable_tokens(-1)


# --- breakpoints: the 20-block lookback -----------------------------------------------------------


def conversation(turns: int, growth: int, system: int = 2048, first_user: int = 100):
    """Turn k's prompt is turn k-1's plus ``growth`` tokens (a reply and a user message)."""
    tokens = prompt(system + first_user)
    out = []
    for turn in range(turns):
        out.append(request(turn * 30.0, tokens, name=f"turn{turn}", group="conv",
                           prefix_tokens=system))
        tokens = tokens + prompt(growth, start=100_000 + turn * 1000)
    return out


END = CacheModel(parse_breakpoints("end"))
STATIC_END = CacheModel(parse_breakpoints("static,end"))


def test_only_breakpoint_at_the_end_rewrites_everything_once_a_turn_grows_by_more_than_20_blocks():
    # 400 tokens a turn = 25 blocks > 20: the lookback from the new end (159 blocks) checks
    # blocks 139..159 and misses the previous write at block 134.
    out, _ = charges(conversation(3, growth=400), model=END)
    assert [(c.written_tokens, c.read_tokens, c.uncached_tokens) for c in out] == [
        (2144, 0, 4),  # 2,148 tokens: 134 full blocks written, 4 uncached
        (2544, 0, 4),  # 2,548 tokens: 159 blocks, nothing read
        (2944, 0, 4),  # 2,948 tokens: 184 blocks, nothing read
    ]


def test_only_breakpoint_at_the_end_still_reads_when_a_turn_grows_by_at_most_20_blocks():
    # 320 tokens = exactly 20 blocks: the previous write at block 134 is the window's bottom.
    out, _ = charges(conversation(3, growth=320), model=END)
    assert [(c.written_tokens, c.read_tokens) for c in out] == [
        (2144, 0), (320, 2144), (320, 2464)]


def test_a_breakpoint_at_the_end_of_the_static_region_fixes_it():
    out, _ = charges(conversation(3, growth=400), model=STATIC_END)
    # The static region (2,048 tokens = 128 blocks) is written with turn 0 and read afterwards;
    # each turn writes from block 128 to its end.
    assert [(c.written_tokens, c.read_tokens, c.uncached_tokens) for c in out] == [
        (2144, 0, 4),
        (2544 - 2048, 2048, 4),  # 496
        (2944 - 2048, 2048, 4),  # 896
    ]


def test_a_breakpoint_at_the_previous_turns_end_reads_the_history_too():
    model = CacheModel(parse_breakpoints("static,end-400,end"))
    out, _ = charges(conversation(3, growth=400), model=model)
    assert [(c.written_tokens, c.read_tokens) for c in out] == [
        (2144, 0), (400, 2144), (400, 2544)]


def test_a_breakpoint_below_the_minimum_length_is_ignored():
    model = CacheModel(parse_breakpoints("512,end"))
    out, _ = charges(conversation(2, growth=400), model=model)
    # The 512-token breakpoint is never written, so turn 1 behaves as with `end` alone.
    assert [(c.written_tokens, c.read_tokens) for c in out] == [(2144, 0), (2544, 0)]


def test_a_static_breakpoint_without_a_known_static_region_is_skipped():
    requests = conversation(2, growth=400)
    for r in requests:
        r.prefix_tokens = 0
    out, _ = charges(requests, model=STATIC_END)
    assert [(c.written_tokens, c.read_tokens) for c in out] == [(2144, 0), (2544, 0)]


def test_the_growing_conversation_demo_numbers():
    demo = growing_conversation_demo()  # 6 turns, 2,048 static, +100 user and +300 reply
    failure = demo["layouts"]["end"]
    fix = demo["layouts"]["static,end"]
    rolling = demo["layouts"]["static,end-400,end"]
    assert failure["written_by_turn"] == [2144, 2544, 2944, 3344, 3744, 4144]
    assert failure["read_tokens"] == 0
    assert fix["written_by_turn"] == [2144, 496, 896, 1296, 1696, 2096]
    assert fix["read_tokens"] == 5 * 2048
    assert rolling["written_by_turn"] == [2144] + [400] * 5
    assert rolling["read_tokens"] == 2144 + 2544 + 2944 + 3344 + 3744
    # 18,888 input tokens: failure 18,864 x 1.25 + 24 = 23,604 -> x1.2497;
    # fix 8,624 x 1.25 + 10,240 x 0.1 + 24 = 11,828 -> x0.6262.
    assert failure["input_tokens"] == fix["input_tokens"] == 18_888
    assert failure["input_multiplier"] == pytest.approx(23_604 / 18_888)
    assert fix["input_multiplier"] == pytest.approx(11_828 / 18_888)


def test_a_breakpoint_inside_a_read_prefix_becomes_an_entry_for_later_requests():
    long_text = prompt(3200)  # 200 blocks
    first = request(0, long_text, prefix_tokens=3200)  # writes block 200
    second = request(100, long_text, prefix_tokens=1600)  # reads block 200; static at block 100
    # Shares only the first 1,600 tokens; its end (125) cannot look back to block 200.
    third = request(150, long_text[:1600] + prompt(400, start=90_000), prefix_tokens=1600)
    out, _ = charges([first, second, third], model=STATIC_END)
    assert [(c.written_tokens, c.read_tokens) for c in out] == [(3200, 0), (0, 3200), (400, 1600)]
    # Without the free entry at block 100 the third request would miss under this 5-minute TTL
    # yet hit under a 60 s one (where the second request wrote block 100): a longer TTL must
    # never lose a hit.


def test_parse_breakpoints():
    assert parse_breakpoints("auto") is None
    assert parse_breakpoints("static, end-400 ,end") == (
        Breakpoint("static"), Breakpoint("end", 400), Breakpoint("end"))
    assert parse_breakpoints("10000") == (Breakpoint("absolute", 10000),)


@pytest.mark.parametrize("text", ["", "end,", "middle", "end+4", "1,2,3,4,5", "end,end"])
def test_bad_breakpoints_are_config_errors(text):
    with pytest.raises(ConfigError):
        parse_breakpoints(text)


def test_at_most_four_breakpoints():
    assert MAX_BREAKPOINTS == 4
    assert len(parse_breakpoints("1024,2048,static,end")) == 4


# --- groups, storage, the Poisson column ----------------------------------------------------------


def test_the_shared_prefix_of_a_group_is_its_longest_common_block_prefix():
    shared = prompt(1600)
    result = account_trace([request(0, shared + prompt(400, start=10_000)),
                            request(1, shared + prompt(200, start=20_000))])
    assert result.groups["doc"].shared_tokens == 1600  # 100 blocks in common


def test_requests_without_a_group_are_grouped_by_their_first_block():
    a, b = prompt(2048), prompt(2048, start=50_000)
    result = account_trace([request(0, a, group=None), request(1, b, group=None),
                            request(2, a, group=None)])
    assert sorted(ledger.requests for ledger in result.groups.values()) == [1, 2]
    assert all(name.startswith("block:") for name in result.groups)


def test_storage_is_billed_from_write_to_expiry():
    same = prompt(2048)
    result = account_trace([request(t, same) for t in (0, 200)], policy=EXPLICIT_OBJECT)
    # One entry of 2,048 tokens written at 0 s, last used at 200 s, expiring 1 h later:
    # alive 3,800 s.
    assert result.total.storage_token_seconds == pytest.approx(2048 * 3800)
    costs = ledger_costs(result.total, EXPLICIT_OBJECT, 3.0)
    # 2,048 tokens x 3,800/3,600 h x $1 per Mtok-hour.
    assert costs["storage_usd"] == pytest.approx(2048 * 3800 / 3600 / 1e6)


def test_the_report_puts_the_poisson_figure_beside_the_exact_one():
    same = prompt(2048)
    result = account_trace([request(t, same) for t in (0, 200, 600)])
    report = result.as_dict(price_per_mtok=3.0)
    group = report["groups"]["doc"]
    assert (group["written_tokens"], group["read_tokens"], group["uncached_tokens"]) == (
        4096, 2048, 0)
    assert group["request_hit_rate"] == pytest.approx(1 / 3)
    # 3 requests over 600 s = 18 per hour; P(hit) = 1 - exp(-18 x 300 / 3600) = 0.7769.
    assert group["poisson"]["requests_per_hour"] == pytest.approx(18.0)
    assert group["poisson"]["p_hit"] == pytest.approx(0.77687, abs=1e-5)
    # Exact: (4,096 x 1.25 + 2,048 x 0.1) / 6,144 = 0.8667 of the cacheable tokens.
    assert group["cache_multiplier"] == pytest.approx((4096 * 1.25 + 2048 * 0.1) / 6144)
    # Poisson: each of the 3 requests reads the shared 2,048 tokens with P(hit):
    # 0.77687 x 3 x 2,048 = 4,773 read, 1,371 written.
    assert group["shared_prefix_tokens"] == 2048
    read = 0.776870 * 3 * 2048
    assert group["poisson"]["read_tokens"] == pytest.approx(read, rel=1e-5)
    assert group["poisson"]["multiplier"] == pytest.approx(
        (read * 0.1 + (6144 - read) * 1.25) / 6144, rel=1e-5)
    assert report["totals"]["usd"] == pytest.approx((4096 * 1.25 + 2048 * 0.1) * 3 / 1e6)


def test_time_going_backwards_is_an_input_error():
    same = prompt(2048)
    with pytest.raises(InputError):
        account_trace([request(10, same), request(5, same)])


def test_an_empty_trace_is_an_input_error():
    with pytest.raises(InputError):
        account_trace([])
