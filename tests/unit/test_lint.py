"""Spec of the request-log lint: where a tenant's requests diverge, what is volatile in the
static region, and the token hit rate now and after the volatile parts move to the end.

Most tests use a character encoder (one token per character, a BOS of 0 on completions, a
one-line-per-message chat rendering) so that token counts can be checked by hand; the last ones
run the realistic fixtures through the tiny BPE tokenizer.
"""

from __future__ import annotations

import json

import pytest

from prefixroute.core.diagnostics.lint import (AFTER_STATIC_REGION, CHANGED_TEMPLATE, CHANGED_TOOLS, REORDERED_TOOLS,
                                               REWRITTEN_TURN, SHUFFLED_EXAMPLES, TOOL_KEY_ORDER,
                                               lint_requests)
from prefixroute.core.diagnostics.prompts import (Prompt, PromptRequest, parse_body, parse_log)
from prefixroute.core.diagnostics.volatile import COUNTER, EMAIL, REQUEST_ID, TIMESTAMP, USER_NAME
from prefixroute.core.errors import InputError
from prefixroute.edges.tokenization import load_tokenizer
from tests.helpers import prompt_fixtures as fixtures
from tests.helpers.tiny_tokenizer import TOOLS_CHAT_TEMPLATE, copy_with_template


class CharEncoder:
    """One token per character: token counts are string lengths."""

    def render(self, request: PromptRequest) -> Prompt:
        if request.kind == "chat":
            tools = f"<tools>{json.dumps(request.tools)}\n" if request.tools else ""
            return Prompt(tools + "".join(f"<{m['role']}>{m['content']}\n"
                                          for m in request.messages), False)
        return Prompt(request.prompt, True)

    def encode_prompts(self, prompts):
        return [([0] if p.add_special_tokens else []) + [ord(c) for c in p.text] for p in prompts]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)


def completions(*prompts: str, tenant: str = "t") -> list[PromptRequest]:
    return [parse_body({"prompt": p, "tenant": tenant}, f"log:{n}") for n, p in
            enumerate(prompts, 1)]


def chats(bodies: list[dict]) -> list[PromptRequest]:
    return [parse_body(b, f"log:{n}") for n, b in enumerate(bodies, 1)]


def kinds(report, tenant: str) -> set[str]:
    return {f.kind for t in report.tenants if t.tenant == tenant for f in t.findings}


def tenant_report(report, tenant: str):
    return next(t for t in report.tenants if t.tenant == tenant)


# -- hit rates -----------------------------------------------------------------------------


def test_a_repeated_prompt_reuses_its_full_blocks_but_not_its_last_token():
    # "abcdefghi" is 10 tokens with the BOS; block size 4: the second request matches 2 full
    # blocks (8 tokens) and 8 <= floor((10 - 1) / 4) * 4 = 8. Hit rate 8 / 20.
    report = lint_requests(completions("abcdefghi", "abcdefghi"), CharEncoder(), block_size=4)
    assert (report.reused_tokens_now, report.total_tokens) == (8, 20)
    assert report.token_hit_rate_now == 0.4


def test_the_cache_remembers_every_earlier_request_not_only_the_previous_one():
    # a b a: the third request reuses the first one's blocks although b came in between.
    report = lint_requests(completions("aaaaaaa1", "bbbbbbb2", "aaaaaaa3"), CharEncoder(),
                           block_size=4)
    # third: [0]+"aaaaaaa3" = 9 tokens, shares 8 with the first: 2 blocks = 8 tokens.
    assert report.reused_tokens_now == 8


def test_tenants_do_not_share_cached_blocks():
    requests = completions("same prompt!", tenant="a") + completions("same prompt!", tenant="b")
    assert lint_requests(requests, CharEncoder(), block_size=4).reused_tokens_now == 0


def test_cache_salts_partition_the_cache():
    requests = [parse_body({"prompt": "same prompt!", "cache_salt": salt}) for salt in "xy"]
    assert lint_requests(requests, CharEncoder(), block_size=4).reused_tokens_now == 0


def test_consecutive_requests_diverge_at_the_first_differing_token():
    report = lint_requests(completions("0123456789abcdef-x", "0123456789abcdef-y"), CharEncoder(),
                           block_size=4)
    divergence = report.tenants[0].first_divergence
    assert divergence["pairs"] == 1
    assert divergence["min_token"] == 18  # BOS + 17 shared characters


# -- volatile values in the static region -------------------------------------------------


def timestamped(n: int) -> list[PromptRequest]:
    policy = "".join(f"Policy line {word}.\n" for word in "abcdefgh")
    return completions(*(f"Current time: 2026-10-05T09:{m:02d}:00Z\n{policy}\nQuestion {q}?"
                         for m, q in zip(range(n), "qrstuvwxyz")))


def test_a_timestamp_on_top_is_found_with_its_line_and_token():
    report = lint_requests(timestamped(6), CharEncoder(), block_size=4)
    finding, = report.tenants[0].findings
    assert finding.kind == TIMESTAMP
    assert finding.requests_affected == 6
    assert finding.example_where == "log:2"
    assert finding.token == 15  # BOS + len("Current time: ")
    assert "Current time: 2026-10-05T09:01:00Z" in finding.example


def test_moving_the_timestamp_behind_the_static_region_raises_the_hit_rate():
    report = lint_requests(timestamped(6), CharEncoder(), block_size=4)
    # now: the minutes differ at token 29, block 7 of each request: 7 blocks = 28 tokens
    # reused by each of the five later requests.
    assert report.reused_tokens_now == 5 * 28
    assert report.token_hit_rate_after > 0.5 > report.token_hit_rate_now


SUPPORT = "You are the support bot of Acme: answer briefly and politely, and cite the policy."


def system_prompts(system, n: int = 6) -> list[PromptRequest]:
    """n chats whose one-line system prompt is ``system(m)`` (m = 0, 1, ...; the minute) and
    whose user asks "Question q?", "Question r?", ..."""
    return chats([{"messages": [{"role": "system", "content": system(m)},
                                {"role": "user", "content": f"Question {q}?"}]}
                  for m, q in zip(range(n), "qrstuvwxyz")])


def one_line_system_prompts(n: int) -> list[PromptRequest]:
    return system_prompts(lambda m: f"Current time: 2026-10-05T09:{m:02d}:00Z. {SUPPORT}", n)


def test_a_timestamp_opening_a_one_line_system_prompt_is_found():
    # The line goes on with 84 characters of static text after the time (". " and SUPPORT):
    # not a value that ends the static region but one that breaks it.
    report = lint_requests(one_line_system_prompts(6), CharEncoder(), block_size=4)
    finding, = report.tenants[0].findings
    assert finding.kind == TIMESTAMP
    assert finding.token == len("<system>Current time: ")
    # now: "<system>Current time: 2026-10-05T09:0" (37 characters) is common, then the
    # minutes differ: 9 full blocks = 36 tokens reused by each of the five later requests.
    assert report.reused_tokens_now == 5 * 36


def test_only_the_timestamps_sentence_moves_and_the_rest_of_the_line_stays_on_top():
    report = lint_requests(one_line_system_prompts(6), CharEncoder(), block_size=4)
    # after: "<system>" + SUPPORT + "\n" + "<user>Question " is common to all six, 8 + 82 + 1
    # + 15 = 106 characters: 26 full blocks = 104 tokens reused by each of the five later
    # requests (the time went to the end of the user's message).
    assert report.reused_tokens_after == 5 * 104


def test_a_fixed_value_after_the_timestamp_is_static_text_like_the_rest():
    requests = system_prompts(lambda m: f"Current time: 2026-10-05T09:{m:02d}:00Z. {SUPPORT} "
                                        f"Refunds take up to 3 days.")
    report = lint_requests(requests, CharEncoder(), block_size=4)
    assert [f.kind for f in report.tenants[0].findings] == [TIMESTAMP]
    # after: "<system>" + SUPPORT + " Refunds take up to 3 days." + "\n" + "<user>Question "
    # = 8 + 82 + 27 + 1 + 15 = 133 characters: 33 full blocks = 132 tokens, five times.
    assert report.reused_tokens_after == 5 * 132


def test_changing_values_in_two_sentences_move_without_the_static_one_between():
    requests = system_prompts(lambda m: f"Ticket #{100 + m}. {SUPPORT} Current time: "
                                        f"2026-10-05T09:{m:02d}:00Z.")
    report = lint_requests(requests, CharEncoder(), block_size=4)
    assert {f.kind for f in report.tenants[0].findings} == {COUNTER, TIMESTAMP}
    # after: both sentences went to the end of the user's message; "<system>" + SUPPORT +
    # "\n" + "<user>Question " = 106 characters stay common: 26 blocks = 104 tokens, five times.
    assert report.reused_tokens_after == 5 * 104


def test_a_date_that_never_changes_is_static():
    requests = completions(*(f"Knowledge cutoff: 2024-06-01\nAnswer well.\n\nQ{n}" for n in range(4)))
    assert lint_requests(requests, CharEncoder()).tenants[0].findings == []


@pytest.mark.parametrize("template, values, kind", [
    ("Request id: {}\n", ["req_8f7a6b5c4d", "req_1a2b3c4d5e", "req_99aa88bb77"], REQUEST_ID),
    ("Conversation number {}\n", ["41", "42", "43"], COUNTER),
    ("User: {}\n", ["Alice Smith", "Bob Jones", "Carol White"], USER_NAME),
    ("Reply to {}\n", ["alice@example.com", "bob@example.org", "carol@example.net"], EMAIL),
])
def test_volatile_values_of_each_kind_are_found(template, values, kind):
    static = "You are a support assistant.\nBe brief.\n\n"
    requests = completions(*(template.format(v) + static + f"Question {n}" for n, v in
                             enumerate(values)))
    assert kinds(lint_requests(requests, CharEncoder()), "t") == {kind}


def test_volatile_values_after_the_static_region_are_not_findings():
    requests = completions(*(f"You are a support assistant.\n\nAt 09:{m:02d} user asked {m}"
                             for m in range(5)))
    assert lint_requests(requests, CharEncoder()).tenants[0].findings == []


# -- structure -----------------------------------------------------------------------------


def test_the_same_tools_in_another_order_are_a_reordered_tool_list():
    report = lint_requests(chats(fixtures.shuffled_tools(6)), CharEncoder())
    assert kinds(report, "globex") == {REORDERED_TOOLS}
    assert report.token_hit_rate_after > report.token_hit_rate_now


def test_schema_keys_in_another_order_are_found():
    report = lint_requests(chats(fixtures.shuffled_tools(6, key_order_every=2)), CharEncoder())
    assert TOOL_KEY_ORDER in kinds(report, "globex")


def test_changed_tool_definitions_are_found():
    bodies = fixtures.clean(4)
    bodies[2]["tools"] = bodies[2]["tools"][:2]
    assert CHANGED_TOOLS in kinds(lint_requests(chats(bodies), CharEncoder()), "hooli")


def test_shuffled_few_shot_examples_are_found_and_fixed_by_one_order():
    report = lint_requests(chats(fixtures.shuffled_examples(8)), CharEncoder())
    assert kinds(report, "umbrella") == {SHUFFLED_EXAMPLES}
    tenant = tenant_report(report, "umbrella")
    assert tenant.token_hit_rate_after > tenant.token_hit_rate_now


def test_a_rewritten_earlier_turn_is_found_and_not_repaired_by_layout():
    report = lint_requests(chats(fixtures.rewritten_turns(3)), CharEncoder())
    tenant = tenant_report(report, "initech")
    assert kinds(report, "initech") == {REWRITTEN_TURN}
    assert tenant.findings[0].requests_affected == 3  # the third turn of each conversation
    assert tenant.token_hit_rate_after == tenant.token_hit_rate_now


def test_a_resent_last_turn_that_was_trimmed_is_a_rewritten_turn():
    system = {"role": "system", "content": "You are a support assistant."}
    question = "Where is my order 123456? It has not arrived and I need it for Friday."
    bodies = [
        {"messages": [system, {"role": "user", "content": question}]},
        {"messages": [system, {"role": "user", "content": question[:30]},
                      {"role": "assistant", "content": "It ships today."},
                      {"role": "user", "content": "Thanks!"}]},
    ]
    finding, = lint_requests(chats(bodies), CharEncoder()).tenants[0].findings
    assert finding.kind == REWRITTEN_TURN
    assert finding.token == len("<system>You are a support assistant.\n<user>") + 30


def test_interleaved_conversations_that_append_are_not_rewrites():
    system = {"role": "system", "content": "You are a support assistant."}

    def turn(question: str, *history: str) -> dict:
        messages = [system]
        for n, text in enumerate(history):
            messages.append({"role": "user" if n % 2 == 0 else "assistant", "content": text})
        return {"messages": messages + [{"role": "user", "content": question}]}

    bodies = [turn("Where is order 1?"), turn("Can I pay with PayPal?"),
              turn("And the tracking number?", "Where is order 1?", "It ships today."),
              turn("And in euros?", "Can I pay with PayPal?", "Yes.")]
    assert lint_requests(chats(bodies), CharEncoder()).tenants[0].findings == []


def test_requests_with_a_different_static_region_are_a_changed_template():
    old = "You are a support assistant.\nBe brief.\n\n"
    new = "You are a sales assistant.\nBe brief.\n\n"
    requests = completions(*([old + f"Q{n}" for n in range(6)] + [new + f"Q{n}" for n in range(4)]))
    report = lint_requests(requests, CharEncoder())
    finding, = report.tenants[0].findings
    assert finding.kind == CHANGED_TEMPLATE
    assert (finding.requests_affected, finding.example_where) == (4, "log:7")


def test_a_clean_layout_has_no_findings():
    report = lint_requests(chats(fixtures.clean(8)), CharEncoder())
    assert report.tenants[0].findings == []
    assert report.token_hit_rate_after == report.token_hit_rate_now


def test_a_clean_layout_diverges_only_after_the_static_region():
    report = lint_requests(chats(fixtures.clean(8)), CharEncoder())
    assert report.tenants[0].first_divergence["causes"] == {AFTER_STATIC_REGION: 7}


def test_divergences_are_explained_by_the_rule_that_caused_them():
    tools = lint_requests(chats(fixtures.shuffled_tools(6)), CharEncoder())
    assert tools.tenants[0].first_divergence["causes"] == {REORDERED_TOOLS: 5}
    examples = lint_requests(chats(fixtures.shuffled_examples(6)), CharEncoder())
    assert examples.tenants[0].first_divergence["causes"] == {SHUFFLED_EXAMPLES: 5}


def test_the_report_has_stable_json_keys():
    data = lint_requests(timestamped(3), CharEncoder()).to_dict()
    assert {"block_size", "requests", "total_tokens", "token_hit_rate_now",
            "token_hit_rate_after", "tenants", "cache_model"} <= set(data)
    assert {"tenant", "requests", "static_region_units", "static_region_tokens",
            "first_divergence", "findings"} <= set(data["tenants"][0])
    json.dumps(data)


def test_token_id_prompts_need_no_encoder():
    requests = [parse_body({"prompt": list(range(1, 40))}) for _ in range(2)]
    assert lint_requests(requests, None, block_size=16).reused_tokens_now == 32


def test_text_prompts_need_an_encoder():
    with pytest.raises(InputError, match="log:1"):
        lint_requests(completions("hello"), None)


# -- the log format ------------------------------------------------------------------------


def test_log_lines_name_their_file_and_line_in_errors():
    with pytest.raises(InputError, match=r"^log\.jsonl:2: not valid JSON"):
        parse_log(['{"prompt": "a"}', '{"prompt": '], "log.jsonl")


def test_a_log_mixing_chat_and_completions_is_refused_at_the_first_odd_line():
    lines = ['{"prompt": "a"}', "", '{"prompt": "b"}', '{"messages": [{"role": "user", "content": "c"}]}']
    with pytest.raises(InputError, match=r"log\.jsonl:4: mixed formats.*log\.jsonl:1"):
        parse_log(lines, "log.jsonl")


def test_a_body_without_messages_or_prompt_is_refused():
    with pytest.raises(InputError, match="log:1: neither messages"):
        parse_body({"model": "x"}, "log:1")


def test_content_parts_are_flattened_like_vllm_does():
    request = parse_body({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert request.messages[0]["content"] == "a\nb"


# -- realistic fixtures through the tiny BPE tokenizer -------------------------------------


@pytest.fixture(scope="module")
def tools_tokenizer(tiny_tokenizer_dir, tmp_path_factory):
    return load_tokenizer(copy_with_template(tiny_tokenizer_dir, tmp_path_factory.mktemp("tools"),
                                             TOOLS_CHAT_TEMPLATE))


def test_each_realistic_fixture_shows_its_own_finding(tools_tokenizer):
    bodies = (fixtures.timestamp_on_top() + fixtures.shuffled_tools() + fixtures.rewritten_turns()
              + fixtures.shuffled_examples() + fixtures.clean())
    report = lint_requests(chats(bodies), tools_tokenizer)
    assert kinds(report, "acme") == {TIMESTAMP}
    assert kinds(report, "globex") == {REORDERED_TOOLS}
    assert kinds(report, "initech") == {REWRITTEN_TURN}
    assert kinds(report, "umbrella") == {SHUFFLED_EXAMPLES}
    assert kinds(report, "hooli") == set()
    assert tenant_report(report, "acme").first_divergence["causes"] == {TIMESTAMP: 11}


def test_the_time_on_top_costs_almost_every_cached_token(tiny_tokenizer_dir):
    tokenizer = load_tokenizer(tiny_tokenizer_dir)  # template without tools: the time is first
    report = lint_requests(chats(fixtures.timestamp_on_top(12)), tokenizer)
    tenant = report.tenants[0]
    assert tenant.first_divergence["max_token"] < 32
    assert tenant.token_hit_rate_now < 0.1
    assert tenant.token_hit_rate_after > 0.6
    assert tenant.findings[0].token < 16
