"""Request checks and response shapes of the emulator's OpenAI API (vLLM 0.32's)."""

from __future__ import annotations

import orjson
import pytest

from prefixroute.core.identity.identity import Adapter
from prefixroute.edges.emulator.protocol import (
    APIError,
    ServedModels,
    parse_chat,
    parse_completion,
    parse_lora_module,
    usage,
)
from prefixroute.edges.emulator.tokens import PromptEncoder

MODELS = ServedModels("tiny", "/models/tiny", 100,
                      adapters={"sql": (Adapter("sql", "/adapters/sql"), 1)})
ENCODER = PromptEncoder()  # the fallback tokenizer


def completion(**body):
    return parse_completion({"model": "tiny", **body}, MODELS, ENCODER, vocab_size=1000)


def error(fn, **body) -> APIError:
    with pytest.raises(APIError) as caught:
        fn(**body)
    return caught.value


def test_max_tokens_defaults_to_16_and_is_capped_by_the_context_left():
    assert completion(prompt=[1] * 10).max_tokens == [16]
    assert completion(prompt=[1] * 90, max_tokens=50).max_tokens == [10]  # 100 - 90


def test_a_prompt_filling_the_context_leaves_no_room_for_a_token():
    # vLLM's wording for this case: the clamped max_tokens is 0.
    assert error(completion, prompt=[1] * 100, max_tokens=1).message.startswith(
        "max_tokens must be at least 1, got 0.")


def test_a_prompt_longer_than_the_context_is_rejected_with_vllms_message():
    err = error(completion, prompt=[1] * 101)
    assert err.status == 400 and err.param == "input_tokens"
    assert "maximum context length is 100 tokens" in err.message


def test_max_tokens_above_the_context_is_rejected():
    err = error(completion, prompt=[1], max_tokens=101)
    assert err.message.startswith("max_tokens=101 cannot be greater than max_model_len=100.")


def test_token_ids_must_be_in_the_vocabulary():
    assert error(completion, prompt=[1, 1000]).message == "Token id 1000 is out of vocabulary"


def test_an_adapter_name_selects_the_adapter_and_its_id():
    request = completion(prompt="x", model="sql")
    assert (request.model, request.adapter, request.lora_id) == \
        ("sql", Adapter("sql", "/adapters/sql"), 1)
    err = error(completion, prompt="x", model="other")
    assert (err.status, err.err_type, err.param) == (404, "NotFoundError", "model")
    assert err.message == "The model `other` does not exist. Valid aliases: tiny, sql."


@pytest.mark.parametrize("salt", ["", "a/b", "a@b", "x" * 129, 7])
def test_cache_salts_follow_vllms_rules(salt):
    assert error(completion, prompt="x", cache_salt=salt).param == "cache_salt"


def test_batch_prompts_give_one_prompt_each():
    request = completion(prompt=["a b", "c"], max_tokens=2)
    assert len(request.prompts) == 2 and request.max_tokens == [2, 2]
    assert request.prompts[0].token_ids[0] == 1  # the fallback tokenizer's BOS


def test_n_above_one_is_refused_explicitly():
    assert "not supported" in error(completion, prompt="x", n=2).message


def test_stream_options_need_stream():
    assert error(completion, prompt="x", stream_options={"include_usage": True}).param == \
        "stream_options"


def test_full_report_mode_and_session_id_come_from_vllm_xargs():
    request = completion(prompt="x", vllm_xargs={"kv_cache_report_mode": "full",
                                                 "session_id": "s1"})
    assert request.report_full and request.session_id == "s1"


def test_chat_without_max_tokens_replies_16_tokens_and_stops():
    request = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, MODELS, ENCODER,
                         None)
    assert request.max_tokens == [16] and request.finish_reason == "stop"
    request = parse_chat({"messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 3}, MODELS, ENCODER, None)
    assert request.max_tokens == [3] and request.finish_reason == "length"


def test_an_empty_conversation_is_rejected_as_vllm_does():
    err = error(parse_chat, body={"messages": []}, models=MODELS, encoder=ENCODER,
                vocab_size=None)
    assert err.message.startswith("Cannot apply chat template to an empty conversation")


def test_usage_shapes_match_vllm():
    assert usage(10, 2, 4, "completion") == {
        "prompt_tokens": 10, "total_tokens": 12, "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 4, "created_cache_tokens": None,
                                  "multimodal_tokens": None},
        "completion_tokens_details": None}
    assert usage(10, 2, 4, "chat", full=False) == {
        "prompt_tokens": 10, "total_tokens": 12, "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 4, "created_cache_tokens": 0}}
    assert usage(10, 1, None, "completion", full=False) == {
        "prompt_tokens": 10, "total_tokens": 11, "completion_tokens": 1}


def test_lora_modules_parse_both_forms():
    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a/b"}') == ("sql", "/a/b")
    with pytest.raises(ValueError):
        parse_lora_module("sql")


def test_json_is_orjson_compact_and_utf8_like_vllms_answers():
    from prefixroute.edges.emulator import protocol

    assert protocol.dumps is orjson.dumps and protocol.loads is orjson.loads
    assert protocol.dumps({"text": "héllo ✓", "ids": [1, None], "ok": True}) == \
        '{"text":"héllo ✓","ids":[1,null],"ok":true}'.encode()
    assert protocol.loads(b'{"prompt": [1, 2]}') == {"prompt": [1, 2]}
    with pytest.raises(protocol.JSONDecodeError):
        protocol.loads(b'{"prompt": ')
    assert issubclass(protocol.JSONDecodeError, ValueError)


def test_priority_is_read_as_vllms_pydantic_reads_an_int64():
    # Checked against vLLM 0.32's request model (pydantic, lax mode): numbers written as
    # strings, booleans and whole floats are integers; null, fractions and text are not.
    assert completion(prompt=[1, 2]).priority == 0
    for given, read in ((-5, -5), ("3", 3), (" 4 ", 4), ("2.0", 2), ("1_000", 1000),
                        (True, 1), (2.0, 2), ((1 << 63) - 1, (1 << 63) - 1)):
        assert completion(prompt=[1, 2], priority=given).priority == read
    for bad in (None, 1.5, "0x10", "three", "2.", "\u0663", 1 << 63, [1]):
        caught = error(completion, prompt=[1, 2], priority=bad)
        assert caught.param == "priority" and caught.status == 400


def test_an_input_image_part_is_media_with_its_url_as_payload():
    # OpenAI Responses-style {"type": "input_image", "image_url": "<url>"}: vLLM reads the URL
    # from "image_url", so two different pictures are two media identities.
    def prompt(url):
        content = [{"type": "input_image", "image_url": url}, {"type": "text", "text": "what"}]
        return parse_chat({"messages": [{"role": "user", "content": content}]}, MODELS,
                          ENCODER, None)
    a, b = prompt("https://e/a.png"), prompt("https://e/b.png")
    (item_a,), (item_b,) = a.prompts[0].media, b.prompts[0].media
    assert item_a.identifier != item_b.identifier
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_requests_reuse_only_their_own_salts_tokenizations(kind):
    from prefixroute.edges.emulator.tokens import FallbackTokenizer

    text = f"one {kind} text sent by two tenants"
    if kind == "completion":
        def send(**body):
            return completion(prompt=text, **body)
    else:
        def send(**body):
            return parse_chat({"model": "tiny", "messages": [{"role": "user", "content": text}],
                               **body}, MODELS, ENCODER, vocab_size=None)
    send(cache_salt="tenant-a")
    before = FallbackTokenizer._encode_text.cache_info()
    send(cache_salt="tenant-b")
    send()
    middle = FallbackTokenizer._encode_text.cache_info()
    send(cache_salt="tenant-b")
    after = FallbackTokenizer._encode_text.cache_info()
    assert middle.misses - before.misses == 2 and middle.hits == before.hits
    assert after.hits - middle.hits == 1
