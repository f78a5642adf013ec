"""``prefixroute doctor`` against a fake engine that hashes blocks like vLLM (salted chained
keys, the last-token rule), with switchable faults: the findings each fault must produce."""

import json
import queue

import httpx
import pytest

from prefixroute.core.caches.base import cacheable_tokens
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import CacheIdentity
from prefixroute.core.kvevents import BlockStored, EventBatch
from prefixroute.edges.gateway.doctor import (FAIL, OK, PROBE_TOKENS, WARN, Doctor,
                                              parse_cache_config)
from prefixroute.edges.tokenization import load_tokenizer
from tests.helpers.tiny_tokenizer import copy_with_template


class FakeEngine:
    def __init__(self, tokenizer, block_size=32, honour_salt=True, report_cached=True,
                 export_config=True, render=True):
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.hasher = BlockHasher("vllm", "sha256", block_size)
        self.honour_salt = honour_salt
        self.report_cached = report_cached
        self.export_config = export_config
        self.render = render
        self.held: set[bytes] = set()
        self.events = None  # an EventStream, when the engine publishes KV events

    def publish(self, ids, salt, first, count):
        """BlockStored for blocks ``first..count-1``, ids from the stream's hash function."""
        if self.events is None or first == count:
            return
        hasher = self.events.hasher
        keys = hasher.block_hashes(ids, CacheIdentity(cache_salt=salt))[first:count]
        stored = BlockStored(block_hashes=tuple(hasher.event_block_hash(k) for k in keys),
                             parent_block_hash=None, block_size=self.block_size,
                             token_ids=tuple(ids[first * self.block_size:
                                                 len(keys) * self.block_size]))
        self.events.send(stored)

    def tokens(self, path, body):
        if path.startswith("/v1/chat"):
            text = self.tokenizer.apply_chat_template(body["messages"])
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = body["prompt"]
        return prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if path == "/metrics":
            line = (f'vllm:cache_config_info{{block_size="{self.block_size}",'
                    'enable_prefix_caching="True",prefix_caching_hash_algo="sha256",'
                    'num_gpu_blocks="500"} 1.0\n') if self.export_config else ""
            return httpx.Response(200, text=line)
        body = json.loads(request.content)
        ids = self.tokens(path.removesuffix("/render"), body)
        if path.endswith("/render"):
            if not self.render:
                return httpx.Response(404)
            item = {"token_ids": ids}
            return httpx.Response(200, json=[item] if path.startswith("/v1/completions")
                                  else item)
        salt = body.get("cache_salt") if self.honour_salt else None
        keys = self.hasher.block_hashes(ids, CacheIdentity(cache_salt=salt))
        hit = 0
        for key in keys:
            if key not in self.held:
                break
            hit += 1
        self.publish(ids, salt, hit, len(keys))
        self.held.update(keys)
        cached = min(hit * self.block_size, cacheable_tokens(len(ids), self.block_size))
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": cached}
                 if self.report_cached else None}
        return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": usage})


class Received:
    def __init__(self, events):
        self.batch = EventBatch(ts=0.0, events=(events,))


class EventStream:
    """The subscriber's side of an engine's KV events: nothing published before the
    subscription is up (``joins_after`` requests, ZeroMQ's slow joiner) is delivered."""

    def __init__(self, engine, joins_after=0, hasher=None):
        self.joins_after = joins_after
        self.hasher = hasher or engine.hasher
        self.queue = queue.Queue()
        self.sent = 0

    def send(self, event):
        self.sent += 1
        if self.sent > self.joins_after:
            self.queue.put(Received(event))

    def get(self, timeout=None):
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None


def with_events(engine, **kwargs):
    engine.events = EventStream(engine, **kwargs)
    return engine.events


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def doctor_for(engine, **kwargs):
    client = httpx.Client(transport=httpx.MockTransport(engine.handle), base_url="http://e")
    return Doctor(client, **kwargs)


def by_name(checks):
    return {c.name: c for c in checks}


def test_agreeing_engine_passes_every_check(tokenizer):
    doctor = doctor_for(FakeEngine(tokenizer), tokenizer=tokenizer)
    checks = by_name(doctor.run())
    assert doctor.ok, [c.as_dict() for c in checks.values() if c.status == FAIL]
    assert checks["prefix_hit"].data["cached_tokens"] == 480  # floor(504 / 32) * 32
    assert checks["tokenize_chat"].status == OK
    assert checks["tokenize_completion"].status == OK


def test_a_given_block_size_the_hit_contradicts_fails_and_names_the_real_one(tokenizer):
    engine = FakeEngine(tokenizer, block_size=64, export_config=False)
    checks = by_name(doctor_for(engine, block_size=16).run())
    assert checks["prefix_hit"].status == FAIL
    assert "looks like 64" in checks["prefix_hit"].detail  # 504 // 64 * 64 = 448


def test_an_unknown_block_size_is_measured_from_the_hit(tokenizer):
    engine = FakeEngine(tokenizer, block_size=64, export_config=False)
    doctor = doctor_for(engine, tokenizer=tokenizer)
    checks = by_name(doctor.run())
    assert checks["prefix_hit"].status == OK and doctor.block_size == 64
    assert doctor.ok


def test_configured_block_size_that_differs_from_the_engines_fails(tokenizer):
    checks = by_name(doctor_for(FakeEngine(tokenizer, block_size=32), block_size=16).run())
    assert checks["engine_config"].status == FAIL
    assert "engine uses 32" in checks["engine_config"].detail


def test_engine_that_ignores_the_salt_fails_isolation(tokenizer):
    checks = by_name(doctor_for(FakeEngine(tokenizer, honour_salt=False)).run())
    assert checks["salt_isolation"].status == FAIL


def test_missing_cached_tokens_says_which_flag_to_set(tokenizer):
    checks = by_name(doctor_for(FakeEngine(tokenizer, report_cached=False)).run())
    assert checks["cached_tokens"].status == FAIL
    assert "--enable-prompt-tokens-details" in checks["cached_tokens"].detail


def test_a_different_chat_template_is_caught_through_render(tokenizer, tiny_tokenizer_dir,
                                                           tmp_path):
    engine_tokenizer = load_tokenizer(copy_with_template(
        tiny_tokenizer_dir, tmp_path,
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"))
    checks = by_name(doctor_for(FakeEngine(engine_tokenizer), tokenizer=tokenizer).run())
    assert checks["tokenize_chat"].status == FAIL
    assert "differ from the gateway's at token" in checks["tokenize_chat"].detail
    assert checks["tokenize_completion"].status == OK


def test_a_different_chat_template_is_caught_through_the_cache_without_render(
        tokenizer, tiny_tokenizer_dir, tmp_path):
    engine_tokenizer = load_tokenizer(copy_with_template(
        tiny_tokenizer_dir, tmp_path,
        "<|system|>injected\n{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"))
    engine = FakeEngine(engine_tokenizer, render=False)
    checks = by_name(doctor_for(engine, tokenizer=tokenizer).run())
    chat = checks["tokenize_chat"]
    assert chat.status == FAIL and chat.data["cached_tokens"] == 0
    assert "mismatch" in chat.detail


def test_probe_length_separates_the_common_block_sizes():
    hits = {b: cacheable_tokens(PROBE_TOKENS, b) for b in (16, 32, 64, 128)}
    assert hits == {16: 496, 32: 480, 64: 448, 128: 384}


def test_cache_config_labels_are_parsed():
    text = 'vllm:cache_config_info{block_size="32",num_gpu_blocks="9"} 1.0\n'
    assert parse_cache_config(text) == {"block_size": "32", "num_gpu_blocks": "9"}


def test_cache_config_labels_are_read_as_the_exposition_format_defines_them():
    # Label values may hold '}' and escaped quotes (vLLM writes config fields with str()).
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{kv_offloading="{\'size\': 4}",model="a \\"b\\"",'
            'block_size="32"} 1.0\n')
    assert parse_cache_config(text) == {"kv_offloading": "{'size': 4}", "model": 'a "b"',
                                        "block_size": "32"}


def test_a_page_the_parser_refuses_has_no_cache_config():
    assert parse_cache_config('vllm:cache_config_info{block_size="32" 1.0\n') == {}
def test_kv_event_ids_equal_to_the_gateways_keys_pass(tokenizer):
    engine = FakeEngine(tokenizer)
    events = with_events(engine)
    checks = by_name(doctor_for(engine, events=events).run())
    assert checks["kv_events"].status == OK
    assert checks["kv_events"].data["matched_blocks"] == 15  # 505 // 32


def test_events_lost_before_the_subscription_joined_are_no_failure(tokenizer, monkeypatch):
    # The stream joins late: the events of the first four requests (the prefix and salt
    # probes, and more) are lost. The doctor once compared the probe it sent before with the
    # events that did arrive and reported "only 0 of 15 probe blocks match".
    monkeypatch.setattr("prefixroute.edges.gateway.doctor.EVENT_WAIT_S", 0.5)
    engine = FakeEngine(tokenizer)
    events = with_events(engine, joins_after=4)
    checks = by_name(doctor_for(engine, events=events).run())
    assert checks["kv_events"].status == OK, checks["kv_events"].detail


def test_ids_from_another_hash_algorithm_fail(tokenizer):
    engine = FakeEngine(tokenizer)
    events = with_events(engine, hasher=BlockHasher("vllm", "sha256_cbor", 32))
    check = by_name(doctor_for(engine, events=events).run())["kv_events"]
    assert check.status == FAIL and "0 of 15" in check.detail


def test_a_stream_that_never_carries_the_probe_warns_that_it_cannot_tell(tokenizer,
                                                                          monkeypatch):
    monkeypatch.setattr("prefixroute.edges.gateway.doctor.EVENT_WAIT_S", 0.3)
    engine = FakeEngine(tokenizer)
    events = with_events(engine)
    events.queue.put(Received(BlockStored(block_hashes=(7,), parent_block_hash=None,
                                          token_ids=tuple(range(32)), block_size=32)))
    engine.events = None  # the engine's own events never arrive, but one stranger's did
    check = by_name(doctor_for(engine, events=events).run())["kv_events"]
    assert check.status == WARN and "cannot tell" in check.detail
