"""Spec of the prompt diff: the first differing token, the blocks it invalidates, the verdict."""

from __future__ import annotations

import pytest

from prefixroute.core.diagnostics.diff import common_prefix_length, diff_tokens, verdict
from prefixroute.core.diagnostics.volatile import (COUNTER, EMAIL, REQUEST_ID, TIMESTAMP,
                                                   USER_NAME, UUID, classify_change)
from prefixroute.core.errors import ConfigError
from prefixroute.edges.tokenization import load_tokenizer


def changed_at(tokens: list[int], position: int) -> list[int]:
    out = list(tokens)
    out[position] = -1
    return out


def test_identical_prompts_have_no_divergence_and_reuse_every_full_block():
    prompt = list(range(40))  # 2 full blocks of 16 and 8 tokens in a partial block
    diff = diff_tokens(prompt, list(prompt), 16)
    assert diff.first_divergence_token is None
    assert diff.first_divergence_block is None
    assert (diff.reusable_blocks, diff.reusable_tokens, diff.total_tokens) == (2, 32, 40)
    assert diff.invalidated_fraction == 0.0


def test_a_change_in_the_first_block_invalidates_every_block():
    prompt = list(range(64))
    diff = diff_tokens(prompt, changed_at(prompt, 3), 16)
    assert (diff.first_divergence_token, diff.first_divergence_block) == (3, 0)
    assert (diff.reusable_blocks, diff.reusable_tokens) == (0, 0)
    assert diff.invalidated_fraction == 1.0


def test_blocks_before_the_divergence_stay_reusable():
    prompt = list(range(64))  # blocks 0..3
    diff = diff_tokens(prompt, changed_at(prompt, 35), 16)  # token 35 lies in block 2
    assert diff.first_divergence_block == 2
    assert (diff.reusable_blocks, diff.reusable_tokens) == (2, 32)
    assert (diff.invalidated_blocks, diff.total_blocks) == (2, 4)
    assert diff.invalidated_fraction == 0.5


def test_a_change_on_a_block_boundary_keeps_the_blocks_before_it():
    prompt = list(range(64))
    diff = diff_tokens(prompt, changed_at(prompt, 32), 16)
    assert (diff.first_divergence_block, diff.reusable_tokens) == (2, 32)


def test_an_appended_prompt_diverges_where_the_shorter_one_ends():
    cached = list(range(40))
    extended = list(range(70))  # the next turn: cached prompt + 30 new tokens
    diff = diff_tokens(cached, extended, 16)
    assert diff.first_divergence_token == 40
    assert diff.extends
    assert (diff.reusable_blocks, diff.reusable_tokens, diff.total_blocks) == (2, 32, 4)


def test_a_partial_block_is_never_reusable():
    prompt = list(range(15))
    assert diff_tokens(prompt, list(prompt), 16).reusable_tokens == 0


def test_the_engine_recomputes_the_last_token_of_a_fully_cached_prompt():
    prompt = list(range(32))  # floor((32 - 1) / 16) * 16 = 16 tokens served from cache
    diff = diff_tokens(prompt, list(prompt), 16)
    assert (diff.reusable_tokens, diff.engine_cached_tokens) == (32, 16)


def test_block_size_must_be_positive():
    with pytest.raises(ConfigError):
        diff_tokens([1], [1], 0)


def test_common_prefix_length_crosses_the_slice_boundary():
    a = list(range(1000))
    assert common_prefix_length(a, changed_at(a, 700)) == 700
    assert common_prefix_length(a, a[:300]) == 300


def test_verdict_names_the_change_its_position_and_the_share_of_blocks():
    prompt = list(range(64))
    diff = diff_tokens(prompt, changed_at(prompt, 3), 16)
    assert verdict(diff, TIMESTAMP) == "a timestamp at token 3 invalidates 100% of blocks (4 of 4 blocks)"
    assert verdict(diff).startswith("changed content at token 3 invalidates 100%")


def test_verdict_for_identical_and_extended_prompts():
    prompt = list(range(40))
    assert verdict(diff_tokens(prompt, prompt, 16)) == (
        "identical prompts: all 2 full blocks (32 tokens) are reusable")
    assert verdict(diff_tokens(prompt[:20], prompt, 16)).startswith("B extends A at token 20")


@pytest.mark.parametrize("before, after, kind", [
    ("Current time: 2026-10-05T12:30:01Z\nYou", "Current time: 2026-10-05T12:31:07Z\nYou", TIMESTAMP),
    ("Today is Monday, October 5, 2026.", "Today is Tuesday, October 6, 2026.", TIMESTAMP),
    ("at 09:15 the", "at 10:02 the", TIMESTAMP),
    ("id 123e4567-e89b-12d3-a456-426614174000.", "id 9b2f4c1a-0d3e-4f5a-8b6c-7d8e9f0a1b2c.", UUID),
    ("request id: req_8f7a6b5c4d\n", "request id: req_1a2b3c4d5e\n", REQUEST_ID),
    ("Contact: alice@example.com\n", "Contact: bob@example.org\n", EMAIL),
    ("User: Alice Smith\n", "User: Bob Jones\n", USER_NAME),
    ("This is turn 9 of the chat", "This is turn 10 of the chat", COUNTER),
    ("You are a pirate.", "You are a helpful assistant.", "changed content"),
])
def test_the_change_is_classified_by_what_covers_the_first_differing_character(before, after, kind):
    assert classify_change(before, after) == kind


def test_a_system_prompt_with_the_time_on_top_invalidates_nearly_every_block(tiny_tokenizer_dir):
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    policy = "You are the support assistant of ACME. Answer politely.\n" * 12

    def chat(time: str) -> list[int]:
        return tokenizer.encode_chat([
            {"role": "system", "content": f"Current time: {time}\n{policy}"},
            {"role": "user", "content": "Where is my order?"}])

    cached, new = chat("2026-10-05T09:01:13Z"), chat("2026-10-05T09:04:50Z")
    diff = diff_tokens(cached, new, 16)
    assert diff.first_divergence_token < 32  # the minutes sit in the first two blocks
    assert diff.reusable_tokens == diff.first_divergence_block * 16
    assert diff.invalidated_fraction > 0.9
    at = diff.first_divergence_token
    kind = classify_change(tokenizer.decode(cached[at - 12:at + 12]),
                           tokenizer.decode(new[at - 12:at + 12]))
    assert kind == TIMESTAMP
