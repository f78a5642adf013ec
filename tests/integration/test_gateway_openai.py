"""The official ``openai`` client against a real gateway (real sockets, uvicorn) in front of
emulator replicas: chat, completions, streaming, errors, models, isolation, affinity."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from test_gateway_fleet import KEYS, Fleet, needs_emulator

pytestmark = needs_emulator

PREFIX = "You are the support assistant of a small bookshop. Be brief and precise. " * 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # hybrid's default max_skew of 1 lets cumulative assignments from earlier tests pull a
    # conversation away; a generous cap makes affinity the behaviour under test.
    with Fleet(tmp_path_factory.mktemp("fleet"), replicas=2,
               gateway={"policy": "hybrid:max_skew=64"}) as running:
        yield running


def cached(result) -> int:
    details = result.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_chat_completion(fleet):
    result = fleet.client().chat.completions.create(
        model=fleet.model, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert result.choices[0].message.content
    assert result.usage.prompt_tokens > 0


def test_completion_with_token_ids(fleet):
    result = fleet.client().completions.create(model=fleet.model, prompt=list(range(10, 60)),
                                               max_tokens=3)
    assert result.usage.prompt_tokens == 50


def test_chat_stream_arrives_in_several_chunks_without_the_usage_chunk(fleet):
    stream = fleet.client().chat.completions.create(
        model=fleet.model, messages=[{"role": "user", "content": "count"}], max_tokens=6,
        stream=True)
    chunks = list(stream)
    assert len(chunks) >= 2
    assert all(chunk.usage is None for chunk in chunks)


def test_completion_stream_keeps_usage_when_asked(fleet):
    stream = fleet.client().completions.create(model=fleet.model, prompt="count to three",
                                               max_tokens=4, stream=True,
                                               stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_repeat_hits_for_a_tenant_and_never_for_another(fleet):
    messages = [{"role": "system", "content": "isolation " + PREFIX},
                {"role": "user", "content": "opening hours?"}]
    a, b = fleet.client("a"), fleet.client("b")
    first = a.chat.completions.create(model=fleet.model, messages=messages, max_tokens=2)
    repeat = a.chat.completions.create(model=fleet.model, messages=messages, max_tokens=2)
    other = b.chat.completions.create(model=fleet.model, messages=messages, max_tokens=2)
    assert cached(first) == 0
    n = repeat.usage.prompt_tokens
    assert cached(repeat) == (n - 1) // fleet.block_size * fleet.block_size
    assert cached(other) == 0


def test_a_conversation_stays_on_its_replica(fleet):
    client = fleet.client("a")
    messages = [{"role": "system", "content": "affinity " + PREFIX}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"question {turn}?"})
        result = client.chat.completions.create(model=fleet.model, messages=messages,
                                                max_tokens=3)
        messages.append({"role": "assistant", "content": result.choices[0].message.content})
    recent = fleet.decisions(4)
    assert len({d["replica"] for d in recent}) == 1
    assert all(d["reported_cached_tokens"] > 0 for d in recent[:3])


def test_errors_reach_the_client_as_openai_errors(fleet):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fleet.url + "/v1", api_key="wrong", max_retries=0) \
            .models.list()
    with pytest.raises(openai.BadRequestError) as info:
        fleet.client().completions.create(model=fleet.model, prompt="x",
                                          extra_body={"cache_salt": "guess"})
    assert info.value.body["param"] == "cache_salt"
    with pytest.raises(openai.NotFoundError):
        fleet.client().completions.create(model="no-such-model", prompt="x")


def test_models_lists_the_backends_models(fleet):
    assert [m.id for m in fleet.client().models.list().data] == [fleet.model]


def test_concurrent_requests_all_answered_and_counted(fleet):
    before = fleet.metric("prefixroute_gateway_requests_total", endpoint="completions")

    async def burst():
        client = fleet.async_client("b")
        results = await asyncio.gather(*(
            client.completions.create(model=fleet.model, prompt=f"burst {i} " + PREFIX,
                                      max_tokens=2) for i in range(40)))
        await client.close()
        return results

    results = asyncio.run(burst())
    assert all(r.choices for r in results)
    deadline = time.monotonic() + 5
    while fleet.metric("prefixroute_gateway_requests_total",
                       endpoint="completions") - before < 40:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_metrics_compare_predicted_and_reported_cached_tokens(fleet):
    text = httpx.get(fleet.url + "/metrics", timeout=10).text
    for name in ("prefixroute_gateway_predicted_cached_tokens_total",
                 "prefixroute_gateway_reported_cached_tokens_total",
                 "prefixroute_gateway_ttft_seconds_bucket",
                 "prefixroute_gateway_decisions_total"):
        assert name in text


def test_admin_sees_replica_state(fleet):
    response = httpx.get(fleet.url + "/debug/decisions?n=1",
                         headers={"authorization": f"Bearer {KEYS['ops']}"}, timeout=10)
    assert [r["name"] for r in response.json()["replicas"]] == ["r0", "r1"]
