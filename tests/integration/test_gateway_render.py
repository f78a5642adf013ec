"""``tokenization: backend`` over real sockets: a gateway without a tokenizer asks emulator
replicas' render endpoints for token ids and media hashes. Its keys are the ids the replicas
publish in KV events (its predictions equal the replicas' reports, text and images alike),
its hit rate on a shared-prefix workload equals that of the same prompts sent as token ids,
and a fleet whose render endpoint fails still serves, on character blocks."""

from __future__ import annotations

import httpx
import pytest

from test_gateway_fleet import Fleet, needs_emulator, stop_process

pytestmark = needs_emulator

BLOCK = 16
POLICY = "hybrid:max_skew=64"
DOCS = [" ".join(f"doc{d}-word{i}" for i in range(120)) for d in range(4)]
QUESTIONS = [f" Question {q}: what does part {q} say?" for q in range(4)]
WORKLOAD = [DOCS[d] + QUESTIONS[q] for q in range(len(QUESTIONS)) for d in range(len(DOCS))]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with Fleet(tmp_path_factory.mktemp("render"), replicas=2, block_size=BLOCK,
               kv_events=True, replica_args=["--mm-item-tokens", "20"],
               gateway={"tokenization": "backend", "policy": POLICY}) as running:
        yield running


def restart(fleet: Fleet) -> None:
    """A fresh gateway in front of cold replicas."""
    stop_process(fleet.gateway)
    for i in range(len(fleet.ports)):
        response = httpx.post(fleet.replica_url(i) + "/reset_prefix_cache", timeout=10)
        assert response.json() == {"success": True}
    fleet.start_gateway()


def hit_rate(fleet: Fleet, prompts) -> tuple[float, list[str]]:
    client = fleet.client("a")
    cached = total = 0
    for prompt in prompts:
        usage = client.completions.create(model=fleet.model, prompt=prompt, max_tokens=2).usage
        cached += usage.prompt_tokens_details.cached_tokens
        total += usage.prompt_tokens
    decisions = list(reversed(fleet.decisions(len(prompts))))
    return cached / total, [d["replica"] for d in decisions]


def test_render_keys_are_the_replicas_event_ids_for_text_and_images(fleet):
    restart(fleet)
    client = fleet.client("a")
    picture = {"type": "image_url", "image_url": {"url": "http://example.test/cat.png"}}
    messages = [{"role": "system", "content": DOCS[0]},
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, picture]}]
    reported = []
    for turn in range(3):
        result = client.chat.completions.create(model=fleet.model, messages=messages,
                                                max_tokens=4)
        reported.append(result.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": result.choices[0].message.content},
                     {"role": "user", "content": [picture, {"type": "text",
                                                            "text": f"And turn {turn}?"}]}]
    decisions = list(reversed(fleet.decisions(3)))
    assert [d["tokenization"] for d in decisions] == ["backend"] * 3
    assert [d["predicted_cached_tokens"] for d in decisions] == reported
    assert [d["reported_cached_tokens"] for d in decisions] == reported
    assert reported[0] == 0 and reported[1] > 0 and reported[2] > reported[1]
    # Another picture after the same text: the keys part where the picture starts.
    other = {"type": "image_url", "image_url": {"url": "http://example.test/dog.png"}}
    changed = [{"role": "system", "content": DOCS[0]},
               {"role": "user", "content": [{"type": "text", "text": "Look:"}, other]}]
    result = client.chat.completions.create(model=fleet.model, messages=changed, max_tokens=4)
    last = fleet.decisions(1)[0]
    assert last["predicted_cached_tokens"] == result.usage.prompt_tokens_details.cached_tokens
    assert 0 < last["predicted_cached_tokens"] < reported[1]
    assert fleet.metric("prefixroute_gateway_render_calls_total", outcome="ok") >= 4
    assert fleet.metric("prefixroute_gateway_tokenize_fallbacks_total") == 0


@pytest.mark.slow
def test_render_mode_hits_as_often_as_token_id_prompts(fleet):
    restart(fleet)
    text_rate, text_route = hit_rate(fleet, WORKLOAD)
    rendered = [httpx.post(fleet.replica_url(0) + "/v1/completions/render",
                           json={"model": fleet.model, "prompt": p}, timeout=10
                           ).json()[0]["token_ids"] for p in WORKLOAD]
    restart(fleet)
    ids_rate, ids_route = hit_rate(fleet, rendered)
    print(f"token hit rate: backend {text_rate:.3f}, token ids {ids_rate:.3f}")
    assert text_rate == ids_rate and text_route == ids_route
    assert text_rate > 0.5  # 4 documents x 4 questions: every repeat hits its document


def test_a_failing_render_endpoint_falls_back_to_character_blocks(tmp_path_factory):
    # A replica port that answers nothing: the gateway's render calls fail to connect, and
    # requests still go through (on character blocks) to the healthy replica.
    with Fleet(tmp_path_factory.mktemp("render-down"), replicas=1, block_size=BLOCK,
               gateway={"tokenization": "backend", "policy": POLICY,
                        "timeouts": {"render_s": 0.5}}) as fleet:
        config = fleet.config()
        assert config["tokenization"] == "backend"
        stop_process(fleet.gateway)
        fleet.gateway_extra["backends"] = config["backends"] + [
            {"name": "gone", "url": "http://127.0.0.1:9", "models": [fleet.model]}]
        fleet.gateway_extra["health"] = {"interval_s": 60, "metrics_interval_s": 60}
        fleet.start_gateway()
        client = fleet.client("a")
        modes = []
        for i in range(4):
            result = client.completions.create(model=fleet.model, prompt=f"{DOCS[1]} {i}",
                                               max_tokens=2)
            assert result.choices[0].text
            modes.append(fleet.decisions(1)[0]["tokenization"])
        # Render calls alternate between the two replicas; the one on port 9 fails.
        assert "chars" in modes and "backend" in modes
        assert fleet.metric("prefixroute_gateway_render_calls_total", outcome="connect") >= 1
        assert fleet.metric("prefixroute_gateway_tokenize_fallbacks_total") >= 1
