"""Tokenization modes of the gateway (``prompts.PromptPreparer``, ``render``): ``backend``
asks a replica's render endpoint, falls back per request, caches; media contributes its
identity to the keys in every mode. Keys are checked by hand against vLLM's formula
``sha256(pickle((parent, tokens, extra_keys)))``, low 64 bits."""

import asyncio
import hashlib
import json
import pickle

import httpx
import pytest

from prefixroute.core.errors import InputError
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import CacheIdentity, MediaItem
from prefixroute.edges.gateway.config import HashingConfig, load_config
from prefixroute.edges.gateway.prompts import (
    BACKEND,
    CHARS,
    TOKENIZER,
    PromptPreparer,
    _render_body,
)
from prefixroute.edges.gateway.render import (
    Rendered,
    RenderClient,
    RenderError,
    media_items,
    parse_render,
)
from prefixroute.edges.gateway.sanitize import CHAT, COMPLETIONS, CheckedRequest
from prefixroute.edges.http1 import HttpxClient

BLOCK = 4
SALT = "s" * 64
HASHING = HashingConfig(block_size=BLOCK)


def vllm_id(parent: bytes, tokens, extra) -> tuple[bytes, int]:
    digest = hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra), protocol=5)).digest()
    return digest, int.from_bytes(digest, "big") & ((1 << 64) - 1)


NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


def completion(prompt, salt=SALT, **extra) -> CheckedRequest:
    return CheckedRequest(COMPLETIONS, {"model": "tiny", "prompt": prompt, "cache_salt": salt,
                                        "max_tokens": 3, **extra}, "tiny", False, False)


def chat(messages, salt=SALT, **extra) -> CheckedRequest:
    return CheckedRequest(CHAT, {"model": "tiny", "messages": messages, "cache_salt": salt,
                                 **extra}, "tiny", False, False)


class FakeRender:
    """A render function: fixed answers per prompt text, or a failure; records its calls."""

    def __init__(self, token_ids=None, media=(), error=None):
        self.token_ids = token_ids or list(range(100, 110))
        self.media = tuple(media)
        self.error = error
        self.calls = []

    async def __call__(self, endpoint, body, backends):
        self.calls.append((endpoint, body, list(backends)))
        if self.error is not None:
            raise self.error
        return Rendered(list(self.token_ids), self.media)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# -- backend mode ------------------------------------------------------------------------


def test_backend_keys_are_vllm_block_hashes_of_the_rendered_tokens_with_the_salt():
    render = FakeRender(token_ids=[7, 8, 9, 10, 11, 12, 13, 14, 15])  # two full blocks of 4
    preparer = PromptPreparer(HASHING, mode=BACKEND, render=render)
    prepared = run(preparer.prepare_async(completion("hello there"), None, ["r0"]))
    first, first_id = vllm_id(NONE_HASH, [7, 8, 9, 10], (("cache_salt", SALT),))
    _, second_id = vllm_id(first, [11, 12, 13, 14], None)
    assert prepared.block_keys == (first_id, second_id)
    assert prepared.mode == BACKEND and prepared.num_tokens == 9
    assert list(prepared.token_ids) == [7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert prepared.fallback_reason is None
    endpoint, body, backends = render.calls[0]
    assert endpoint == COMPLETIONS and backends == ["r0"]
    # The render call needs no salt and asks for hashes and placements, not tensors.
    assert body == {"model": "tiny", "prompt": "hello there", "mm_payload": "none"}


def test_backend_media_items_enter_the_keys_as_vllm_extra_keys():
    tokens = list(range(20, 32))  # three blocks; an image over tokens 2..5
    image = MediaItem("c0ffee", 2, 4)
    preparer = PromptPreparer(HASHING, mode=BACKEND, render=FakeRender(tokens, [image]))
    prepared = run(preparer.prepare_async(chat([{"role": "user", "content": "x"}])))
    b0, k0 = vllm_id(NONE_HASH, tokens[0:4], (("mm", "c0ffee", 2), ("cache_salt", SALT)))
    b1, k1 = vllm_id(b0, tokens[4:8], (("mm", "c0ffee", -2),))
    _, k2 = vllm_id(b1, tokens[8:12], None)
    assert prepared.block_keys == (k0, k1, k2)
    # Another image at the same place: every block from the image's on differs.
    other = PromptPreparer(HASHING, mode=BACKEND, render=FakeRender(
        tokens, [MediaItem("beef", 2, 4)]))
    keys = run(other.prepare_async(chat([{"role": "user", "content": "x"}]))).block_keys
    assert all(a != b for a, b in zip(keys, prepared.block_keys))


def test_render_results_are_cached_per_salt_and_prompt():
    render = FakeRender()
    preparer = PromptPreparer(HASHING, mode=BACKEND, render=render)
    a = run(preparer.prepare_async(completion("same")))
    b = run(preparer.prepare_async(completion("same", max_tokens=50)))  # sampling: same render
    assert a is b and len(render.calls) == 1
    c = run(preparer.prepare_async(completion("same", salt="t" * 64)))
    assert len(render.calls) == 2 and c.block_keys != a.block_keys
    run(preparer.prepare_async(completion("same", add_special_tokens=False)))
    assert len(render.calls) == 3  # a field that changes the tokens is part of the key


def test_token_id_prompts_are_not_rendered():
    render = FakeRender()
    preparer = PromptPreparer(HASHING, mode=BACKEND, render=render)
    prepared = run(preparer.prepare_async(completion([1, 2, 3, 4, 5])))
    assert prepared.mode == "token_ids" and not render.calls
    assert _render_body(completion([[1, 2], [3]])) is None


def test_a_failed_render_falls_back_to_characters_for_that_request_only():
    render = FakeRender(error=RenderError("timeout", "r0: no answer within 1 s"))
    preparer = PromptPreparer(HASHING, mode=BACKEND, render=render)
    first = run(preparer.prepare_async(completion("a prompt of some length")))
    chars = PromptPreparer(HASHING).prepare(completion("a prompt of some length"))
    assert first.mode == CHARS and first.block_keys == chars.block_keys
    assert first.fallback_reason == "render failed: timeout: r0: no answer within 1 s"
    render.error = None  # the replica answers again: the next request renders
    second = run(preparer.prepare_async(completion("a prompt of some length")))
    assert second.mode == BACKEND and second.fallback_reason is None
    assert len(render.calls) == 2


def test_a_failed_render_falls_back_to_the_tokenizer_when_one_is_configured(tiny_tokenizer_dir):
    from prefixroute.edges.tokenization import load_tokenizer

    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    preparer = PromptPreparer(HASHING, tokenizer, mode=BACKEND,
                              render=FakeRender(error=RenderError("http_403", "r0: forbidden")))
    prepared = run(preparer.prepare_async(completion("hello world, again and again")))
    local = PromptPreparer(HASHING, tokenizer).prepare(completion("hello world, again and again"))
    assert prepared.mode == TOKENIZER and prepared.block_keys == local.block_keys
    assert "http_403" in prepared.fallback_reason


def test_render_body_keeps_the_fields_that_change_tokens_and_drops_the_rest():
    request = chat([{"role": "user", "content": "hi"}], tools=[{"type": "function"}],
                   add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False},
                   temperature=0.5, stream=True, stream_options={"include_usage": True})
    assert _render_body(request) == {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function"}], "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False}, "mm_payload": "none"}
    assert _render_body(completion(["first", "second"]))["prompt"] == "first"


def test_modes_default_as_before():
    assert PromptPreparer(HASHING).mode == CHARS
    assert PromptPreparer(HASHING, tokenizer=object()).mode == TOKENIZER
    assert PromptPreparer(HASHING, tokenizer=object(), mode=CHARS).tokenizer is None
    with pytest.raises(ValueError):
        PromptPreparer(HASHING, mode=TOKENIZER)


# -- media in the local modes ------------------------------------------------------------


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_character_blocks_tell_different_images_apart():
    preparer = PromptPreparer(HASHING)
    text = {"type": "text", "text": "Describe this picture in one careful sentence please."}
    a = preparer.prepare(chat([{"role": "user", "content": [text, image("http://x/a.png")]}]))
    b = preparer.prepare(chat([{"role": "user", "content": [text, image("http://x/b.png")]}]))
    a2 = preparer.prepare(chat([{"role": "user", "content": [text, image("http://x/a.png")]}]))
    assert a.block_keys == a2.block_keys
    # The text before the image is one full 16-character block: equal; then they differ.
    assert a.block_keys[0] == b.block_keys[0] and a.block_keys[-1] != b.block_keys[-1]
    # Text-only messages route exactly as before media counted.
    plain = preparer.prepare(chat([{"role": "user", "content": [text]}]))
    assert plain.block_keys == preparer.prepare(
        chat([{"role": "user", "content": text["text"]}])).block_keys


def test_the_same_image_in_two_trust_groups_gets_two_routing_identities():
    from prefixroute.edges.gateway.prompts import media_routing_id

    part = image("http://x/a.png")
    assert media_routing_id(part, "g1") != media_routing_id(part, "g2")
    assert media_routing_id(part, "g1") == media_routing_id(dict(part), "g1")
    assert media_routing_id({**part, "uuid": "u1"}, "g1") != media_routing_id(part, "g1")


def test_tokenizer_mode_places_one_media_token_with_the_identity(tiny_tokenizer_dir):
    from prefixroute.edges.gateway.prompts import MEDIA_PLACEHOLDER_ID, media_routing_id
    from prefixroute.edges.tokenization import load_tokenizer

    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    preparer = PromptPreparer(HashingConfig(block_size=16), tokenizer)
    text = {"type": "text", "text": "Describe the picture below carefully, please, " * 3}
    msgs = [{"role": "user", "content": [text, image("http://x/a.png"),
                                         {"type": "text", "text": "Thanks."}]}]
    prepared = preparer.prepare(chat(msgs))
    ids = list(prepared.token_ids)
    at = ids.index(MEDIA_PLACEHOLDER_ID)
    # Recompute: the same tokens with the media item as an extra key give the same keys.
    hasher = BlockHasher("vllm", "sha256", 16)
    item = MediaItem(media_routing_id(image("http://x/a.png"), SALT), at, 1)
    expected = [hasher.event_block_hash(d) for d in
                hasher.block_hashes(ids, CacheIdentity(cache_salt=SALT), [item])]
    assert list(prepared.block_keys) == expected
    other = preparer.prepare(chat([{"role": "user", "content": [
        text, image("http://x/b.png"), {"type": "text", "text": "Thanks."}]}]))
    n_before = at // 16
    assert other.block_keys[:n_before] == prepared.block_keys[:n_before]
    assert other.block_keys[n_before:] != prepared.block_keys[n_before:]


# -- the render answer and the client -----------------------------------------------------


def test_parse_render_flattens_media_of_all_modalities_by_offset():
    body = {"request_id": "chatcmpl-1", "token_ids": list(range(40)), "token_offsets": None,
            "features": {"mm_hashes": {"image": ["i0", "i1"], "audio": ["a0"]},
                         "mm_placeholders": {"image": [{"offset": 2, "length": 8},
                                                       {"offset": 30, "length": 8}],
                                             "audio": [{"offset": 12, "length": 8}]},
                         "kwargs_data": None, "mm_metadata": None}}
    rendered = parse_render(json.dumps(body).encode(), CHAT)
    assert rendered.token_ids == list(range(40))
    assert rendered.media == (MediaItem("i0", 2, 8), MediaItem("a0", 12, 8),
                              MediaItem("i1", 30, 8))
    assert parse_render(json.dumps([{"token_ids": [1, 2]}]).encode(), COMPLETIONS).media == ()
    for bad in (b"nope", b"{}", json.dumps({"token_ids": ["a"]}).encode(),
                json.dumps({"token_ids": [1], "features": {"mm_hashes": {"image": ["x"]},
                                                           "mm_placeholders": {}}}).encode()):
        with pytest.raises(ValueError):
            parse_render(bad, CHAT)
    assert media_items(None) == ()


class FakeBackend:
    def __init__(self, name, up=True):
        self.name, self.url, self.headers, self.up = name, f"http://{name}.test", {}, up

    def available(self):
        return self.up


def client_for(handler, timeout_s=1.0):
    async def route(request):
        return await handler(request)

    http = httpx.AsyncClient(transport=httpx.MockTransport(route))
    return RenderClient(timeout_s, client=HttpxClient(http))


def test_render_client_takes_turns_among_available_replicas_and_parses():
    seen = []

    async def handler(request):
        seen.append((request.url.host, request.url.path, json.loads(request.content)))
        return httpx.Response(200, json=[{"token_ids": [5, 6, 7]}])

    client = client_for(handler)
    backends = [FakeBackend("r0"), FakeBackend("r1", up=False), FakeBackend("r2")]
    for _ in range(4):
        rendered = run(client.render(COMPLETIONS, {"model": "tiny", "prompt": "x"}, backends))
        assert rendered.token_ids == [5, 6, 7]
    assert sorted({host for host, _, _ in seen}) == ["r0.test", "r2.test"]
    assert [host for host, _, _ in seen].count("r0.test") == 2
    assert seen[0][1] == "/v1/completions/render"
    assert client.calls.labels("ok")._value.get() == 4


@pytest.mark.parametrize("answer, reason", [
    ("403", "http_403"), ("500", "http_500"), ("garbage", "bad_response"),
    ("connect", "connect"), ("slow", "timeout")])
def test_render_client_failures_are_render_errors_with_a_reason(answer, reason):
    async def handler(request):
        if answer == "connect":
            raise httpx.ConnectError("refused", request=request)
        if answer == "slow":
            await asyncio.sleep(5)
        if answer == "garbage":
            return httpx.Response(200, content=b"<html>")
        return httpx.Response(int(answer), json={"error": {"message": "Scale-out endpoints "
                                                           "are disabled."}})

    client = client_for(handler, timeout_s=0.2)
    with pytest.raises(RenderError) as caught:
        run(client.render(CHAT, {"model": "tiny", "messages": []}, [FakeBackend("r0")]))
    assert caught.value.reason == reason and "r0" in caught.value.detail
    if answer == "403":
        assert "--enable-scale-out" in caught.value.detail
    assert client.calls.labels(reason)._value.get() == 1


def test_no_available_replica_is_a_render_error():
    client = client_for(None)
    with pytest.raises(RenderError) as caught:
        run(client.render(CHAT, {}, [FakeBackend("r0", up=False)]))
    assert caught.value.reason == "no_replica"


# -- configuration ------------------------------------------------------------------------

BASE = """\
server_secret: {env: PR_TOKENIZATION_TEST_SECRET}
backends:
  - url: http://127.0.0.1:8001
tenants:
  - name: a
    api_key_sha256: "%s"
""" % ("0" * 64)


def load(tmp_path, monkeypatch, extra, tokenizer_dir=None):
    monkeypatch.setenv("PR_TOKENIZATION_TEST_SECRET", "x" * 64)
    text = BASE + extra
    if tokenizer_dir is not None:
        text += f"tokenizer: {tokenizer_dir}\n"
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return load_config(path)


def test_config_tokenization_defaults_to_auto_and_accepts_the_modes(tmp_path, monkeypatch,
                                                                    tiny_tokenizer_dir):
    assert load(tmp_path, monkeypatch, "").tokenization == "auto"
    config = load(tmp_path, monkeypatch, "tokenization: backend\ntimeouts: {render_s: 0.5}\n")
    assert config.tokenization == "backend" and config.timeouts.render_s == 0.5
    assert load(tmp_path, monkeypatch, "").timeouts.render_s == 1.0
    assert load(tmp_path, monkeypatch, "tokenization: tokenizer\n",
                tiny_tokenizer_dir).tokenization == "tokenizer"
    assert load(tmp_path, monkeypatch, "tokenization: backend\n",
                tiny_tokenizer_dir).tokenizer is not None


@pytest.mark.parametrize("extra, with_tokenizer, line, field, words", [
    ("tokenization: sometimes\n", False, 7, "tokenization", "must be one of auto, tokenizer"),
    ("tokenization: tokenizer\n", False, 7, "tokenization", "needs 'tokenizer'"),
    ("tokenization: chars\n", True, 7, "tokenization", "does not use the configured"),
    ("timeouts:\n  render_s: 0\n", False, 8, "timeouts.render_s", "greater than 0"),
])
def test_config_errors_name_file_line_and_field(tmp_path, monkeypatch, tiny_tokenizer_dir,
                                                extra, with_tokenizer, line, field, words):
    with pytest.raises(InputError) as caught:
        load(tmp_path, monkeypatch, extra, tiny_tokenizer_dir if with_tokenizer else None)
    message = str(caught.value)
    assert f"gateway.yaml:{line}" in message, message
    assert f"field '{field}'" in message and words in message, message


# -- prefixroute doctor without a tokenizer: the render endpoint ---------------------------


def test_doctor_without_a_tokenizer_checks_the_render_endpoint(tiny_tokenizer_dir):
    from prefixroute.edges.gateway.doctor import OK, WARN
    from prefixroute.edges.tokenization import load_tokenizer
    from tests.unit.test_gateway_doctor import FakeEngine, by_name, doctor_for

    engine = FakeEngine(load_tokenizer(tiny_tokenizer_dir))
    checks = by_name(doctor_for(engine).run())
    assert checks["render_completion"].status == OK, checks["render_completion"].detail
    assert checks["render_chat"].status == OK, checks["render_chat"].detail
    assert "tokenize" not in checks
    engine = FakeEngine(load_tokenizer(tiny_tokenizer_dir), render=False)
    doctor = doctor_for(engine)
    checks = by_name(doctor.run())
    assert checks["render_chat"].status == WARN and doctor.ok
    assert "--enable-scale-out" in checks["render_chat"].detail


# -- the app in backend mode (fake replicas behind httpx.MockTransport) --------------------


def test_the_app_routes_on_rendered_tokens_and_falls_back_when_render_is_off(monkeypatch):
    from tests.unit.test_gateway_app import Harness, make_config

    renders = []

    def with_render(replica):
        handle = replica.handle

        async def handle_with_render(request):
            if request.url.path.endswith("/render"):
                body = json.loads(request.content)
                renders.append((replica.name, body))
                if replica.fault == "render_off":
                    return httpx.Response(403, json={"error": {"message": "Scale-out endpoints "
                                                               "are disabled."}})
                ids = [1, *(ord(c) for c in body["prompt"])]
                return httpx.Response(200, json=[{"request_id": "cmpl-1", "token_ids": ids,
                                                  "features": None}])
            return await handle(request)
        replica.handle = handle_with_render

    config = make_config(monkeypatch, tokenization="backend")

    async def scenario():
        async with Harness(config) as h:
            for replica in h.replicas.values():
                with_render(replica)
            prompt = "a prompt long enough for a few blocks"
            await h.openai().completions.create(model="tiny", prompt=prompt)
            await h.openai().completions.create(model="tiny", prompt=prompt)  # cached
            record = h.gateway.router.decisions[-1]
            assert record.tokenization == "backend"
            assert record.full_blocks == (len(prompt) + 1) // BLOCK
            assert len(renders) == 1 and "cache_salt" not in renders[0][1]
            for replica in h.replicas.values():
                replica.fault = "render_off"
            await h.openai().completions.create(model="tiny", prompt="another prompt here")
            assert h.gateway.router.decisions[-1].tokenization == "chars"
            metrics = (await h.http.get("/metrics")).text
            assert "prefixroute_gateway_tokenize_fallbacks_total 1.0" in metrics
            assert 'prefixroute_gateway_render_calls_total{outcome="http_403"} 1.0' in metrics
            assert 'prefixroute_gateway_render_calls_total{outcome="ok"} 1.0' in metrics
    run(scenario())


def test_character_block_feedback_is_converted_to_estimated_tokens():
    from prefixroute.edges.gateway.router import cached_in_routing_units
    # 15,453 characters / 4 = 15,453 estimated tokens for a prompt the engine counts as
    # 10,302 tokens: 1.5 estimated per real token. Blocks of 16.
    assert cached_in_routing_units(0, 10_302, 15_453, 16) == 0
    # 10,000 cached: credited up to the end of the next engine block, (10,000 + 16) x 1.5.
    assert cached_in_routing_units(10_000, 10_302, 15_453, 16) == 15_024
    # As far as the engine ever reports, floor(10,301 / 16) x 16 = 10,288: wholly cached.
    assert cached_in_routing_units(10_288, 10_302, 15_453, 16) == 15_453
    # Without the usage's prompt_tokens the figure is passed on as reported.
    assert cached_in_routing_units(160, None, 300, 16) == 160


@pytest.mark.parametrize("request_for", [completion, lambda text, salt: chat(
    [{"role": "user", "content": text}], salt)], ids=["completion", "chat"])
def test_a_text_tokenized_for_one_trust_group_is_not_cached_for_another(tiny_tokenizer_dir,
                                                                         request_for):
    # A text cache shared across salts would answer tenant B faster because tenant A sent
    # the same text: a timing channel the salt exists to close.
    from prefixroute.edges.tokenization import load_tokenizer

    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    preparer = PromptPreparer(HASHING, tokenizer)
    text = "one text two tenants send, word for word"
    segments = tokenizer.segments
    start = segments.encoded
    preparer.prepare(request_for(text, "a" * 64))
    first = segments.encoded - start
    preparer.prepare(request_for(text, "b" * 64))
    assert segments.encoded - start == 2 * first >= 2  # every piece tokenized anew
    preparer.prepare(request_for(text + " and more", "a" * 64))
    assert segments.encoded - start == 2 * first + 1  # within one group, only the new piece
