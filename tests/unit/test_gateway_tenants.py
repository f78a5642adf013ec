"""Tenants: authentication, trust-group salts, media identities, rate limits, body checks."""

import pytest

from prefixroute.core.clock import ManualClock
from prefixroute.core.identity.identity import derive_trust_group_salt
from prefixroute.core.identity.media_parts import MEDIA_PART_TYPES
from prefixroute.edges.gateway.config import RateLimit, TenantConfig, hash_api_key
from prefixroute.edges.gateway.errors import GatewayError
from prefixroute.edges.gateway.sanitize import CHAT, COMPLETIONS, check_request, parse_json_body
from prefixroute.edges.gateway.tenants import TenantRegistry, TokenBucket

SECRET = b"k" * 32


def registry(clock=None, rate=None):
    tenants = (
        TenantConfig("alice", (hash_api_key("key-alice"),), "team-1", rate),
        TenantConfig("bob", (hash_api_key("key-bob"),), "team-1"),
        TenantConfig("carol", (hash_api_key("key-carol"), hash_api_key("key-carol-2")),
                     "team-2"),
    )
    return TenantRegistry(tenants, SECRET, clock or ManualClock())


def test_bearer_key_finds_its_tenant():
    assert registry().authenticate("Bearer key-carol-2").name == "carol"


@pytest.mark.parametrize("header, code", [
    (None, "missing_api_key"), ("", "missing_api_key"), ("Basic abc", "invalid_api_key"),
    ("Bearer", "invalid_api_key"), ("Bearer wrong", "invalid_api_key"),
])
def test_missing_or_unknown_key_is_401(header, code):
    with pytest.raises(GatewayError) as info:
        registry().authenticate(header)
    assert info.value.status == 401 and info.value.code == code


def test_error_body_has_the_openai_shape():
    error = GatewayError(401, "no", code="invalid_api_key")
    assert error.body() == {"error": {"message": "no", "type": "authentication_error",
                                      "param": None, "code": "invalid_api_key"}}


def test_salt_is_the_hmac_of_the_trust_group():
    reg = registry()
    alice = reg.authenticate("Bearer key-alice")
    assert alice.cache_salt == derive_trust_group_salt(SECRET, "team-1")
    assert len(alice.cache_salt) == 64


def test_one_trust_group_shares_a_salt_and_another_does_not():
    reg = registry()
    alice, bob, carol = (reg.authenticate(f"Bearer key-{n}") for n in ("alice", "bob", "carol"))
    assert alice.cache_salt == bob.cache_salt
    assert alice.cache_salt != carol.cache_salt


def test_salt_depends_on_the_server_secret():
    tenants = (TenantConfig("alice", (hash_api_key("key-alice"),), "team-1"),)
    other = TenantRegistry(tenants, b"z" * 32, ManualClock())
    assert other.authenticate("Bearer key-alice").cache_salt != \
        registry().authenticate("Bearer key-alice").cache_salt


def test_token_bucket_allows_the_burst_then_refills_at_the_rate():
    clock = ManualClock()
    bucket = TokenBucket(2.0, 3, clock)
    assert [bucket.try_take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.try_take() == pytest.approx(0.5)  # one token takes 1/2 s at 2 per second
    clock.advance(0.5)
    assert bucket.try_take() == 0.0
    clock.advance(10.0)  # refills to the burst, not beyond
    assert [bucket.try_take() for _ in range(4)][-1] > 0


def test_rate_limit_is_429_with_retry_after():
    clock = ManualClock()
    reg = registry(clock, RateLimit(1.0, 1))
    alice = reg.authenticate("Bearer key-alice")
    reg.check_rate(alice)
    with pytest.raises(GatewayError) as info:
        reg.check_rate(alice)
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    assert info.value.headers["retry-after"] == "1"
    reg.check_rate(reg.authenticate("Bearer key-bob"))  # bob has no limit


def test_a_prompt_token_limit_takes_each_prompt_s_tokens():
    clock = ManualClock()
    reg = registry(clock, RateLimit(None, 0, prompt_tokens_per_second=1000.0,
                                    prompt_tokens_burst=3000))
    alice = reg.authenticate("Bearer key-alice")
    reg.check_rate(alice)  # requests are not limited
    reg.check_prompt_tokens(alice, 2000)
    with pytest.raises(GatewayError) as info:
        reg.check_prompt_tokens(alice, 1500)  # 1000 left: 500 more take 0.5 s
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    assert info.value.headers["retry-after"] == "1"
    assert "1500 prompt tokens" in info.value.message
    clock.advance(0.5)
    reg.check_prompt_tokens(alice, 1500)


def test_a_prompt_longer_than_the_token_burst_can_never_pass():
    reg = registry(ManualClock(), RateLimit(None, 0, 1000.0, 3000))
    with pytest.raises(GatewayError) as info:
        reg.check_prompt_tokens(reg.authenticate("Bearer key-alice"), 3001)
    assert info.value.status == 429 and "retry-after" not in info.value.headers
    assert "can never pass" in info.value.message


def test_a_reload_keeps_an_unchanged_token_bucket():
    clock = ManualClock()
    reg = registry(clock, RateLimit(None, 0, 1000.0, 3000))
    reg.check_prompt_tokens(reg.authenticate("Bearer key-alice"), 3000)
    tenants = (TenantConfig("alice", (hash_api_key("key-alice"),), "team-1",
                            RateLimit(None, 0, 1000.0, 3000)),)
    again = TenantRegistry(tenants, SECRET, clock, previous=reg)
    with pytest.raises(GatewayError):  # still empty: a reload does not refill it
        again.check_prompt_tokens(again.authenticate("Bearer key-alice"), 100)


def test_media_identity_is_scoped_to_the_trust_group():
    reg = registry()
    alice, bob, carol = (reg.authenticate(f"Bearer key-{n}") for n in ("alice", "bob", "carol"))
    assert reg.media_uuid(alice, "d1") == reg.media_uuid(bob, "d1")
    assert reg.media_uuid(alice, "d1") != reg.media_uuid(carol, "d1")
    assert reg.media_uuid(alice, "d1") != reg.media_uuid(alice, "d2")


# -- body checks -----------------------------------------------------------------------------

def checked(endpoint, body, policy="reject"):
    reg = registry()
    return check_request(endpoint, body, reg.authenticate("Bearer key-alice"), reg, policy)


def test_gateway_injects_the_trust_group_salt():
    result = checked(COMPLETIONS, {"model": "m", "prompt": "hi"})
    assert result.body["cache_salt"] == derive_trust_group_salt(SECRET, "team-1")


def test_caller_salt_is_rejected_by_default():
    with pytest.raises(GatewayError) as info:
        checked(COMPLETIONS, {"model": "m", "prompt": "hi", "cache_salt": "guess"})
    assert info.value.status == 400 and info.value.param == "cache_salt"


def test_caller_salt_is_replaced_when_configured_to_strip():
    result = checked(COMPLETIONS, {"model": "m", "prompt": "hi", "cache_salt": "guess"}, "strip")
    assert result.body["cache_salt"] == derive_trust_group_salt(SECRET, "team-1")


def test_caller_multimodal_uuid_is_rejected():
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}, "uuid": "cat"}]}]}
    with pytest.raises(GatewayError) as info:
        checked(CHAT, body)
    assert info.value.status == 400 and info.value.code == "caller_media_uuid"


def test_inline_media_gets_a_group_scoped_uuid_and_fetched_media_none():
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
        {"type": "text", "text": "what is this"}]}]}
    parts = checked(CHAT, body).body["messages"][0]["content"]
    assert parts[0]["uuid"].startswith("pr-") and "uuid" not in parts[1]


# One inline part of every content-part type vLLM 0.32 takes as media (MM_PARSER_MAP).
DATA_URL = "data:image/png;base64,AAAA"
INLINE_MEDIA = {
    "image_url": {"type": "image_url", "image_url": {"url": DATA_URL}},
    "input_image": {"type": "input_image", "image_url": DATA_URL},
    "image_pil": {"type": "image_pil", "image_pil": "AAAA"},
    "image_embeds": {"type": "image_embeds", "image_embeds": "AAAA"},
    "audio_url": {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    "audio_embeds": {"type": "audio_embeds", "audio_embeds": {"audio_embeds": "AAAA"}},
    "video_url": {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    "video_embeds": {"type": "video_embeds", "video_embeds": "AAAA"},
}


def media_uuid_for(tenant_key, part):
    reg = registry()
    body = {"model": "m", "messages": [{"role": "user", "content": [dict(part)]}]}
    checked_body = check_request(CHAT, body, reg.authenticate(f"Bearer {tenant_key}"), reg).body
    return checked_body["messages"][0]["content"][0].get("uuid")


def test_the_inline_examples_cover_every_media_part_type():
    assert set(INLINE_MEDIA) == set(MEDIA_PART_TYPES)


@pytest.mark.parametrize("kind", sorted(INLINE_MEDIA))
def test_every_inline_media_type_gets_a_trust_group_scoped_uuid(kind):
    part = INLINE_MEDIA[kind]
    alice, bob, carol = (media_uuid_for(f"key-{n}", part) for n in ("alice", "bob", "carol"))
    assert alice is not None and alice.startswith("pr-")
    assert alice == bob and alice != carol  # team-1 shares, team-2 does not


def test_a_media_part_without_type_is_still_given_an_identity():
    # vLLM takes a part without "type" as media by its payload key.
    assert media_uuid_for("key-alice", {"image_url": {"url": DATA_URL}}) is not None


def test_streaming_asks_the_replica_for_usage():
    result = checked(CHAT, {"model": "m", "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert result.body["stream_options"] == {"include_usage": True}
    assert result.caller_wants_usage is False


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
])
def test_bad_completions_bodies_are_400(body, param):
    with pytest.raises(GatewayError) as info:
        checked(COMPLETIONS, body)
    assert info.value.status == 400 and info.value.param == param


def test_bad_chat_messages_are_400():
    with pytest.raises(GatewayError) as info:
        checked(CHAT, {"model": "m", "messages": [{"content": "no role"}]})
    assert info.value.param == "messages[0]"


@pytest.mark.parametrize("raw, code", [(b"", "invalid_body"), (b"{not json", "invalid_json"),
                                       (b"[1, 2]", "invalid_body")])
def test_malformed_json_is_400(raw, code):
    with pytest.raises(GatewayError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and info.value.code == code


@pytest.mark.parametrize("raw", [b'{"max_tokens": 1e400}', b'{"temperature": NaN}',
                                 b'{"temperature": -Infinity}',
                                 b'{"top_p": ' + b"9" * 400 + b'.5}'])
def test_a_number_that_is_not_finite_is_400_not_sent_on_as_null(raw):
    with pytest.raises(GatewayError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and info.value.code == "number_not_finite"


def test_large_finite_numbers_still_parse():
    assert parse_json_body(b'{"a": 1e300, "b": -2.5e-300}') == {"a": 1e300, "b": -2.5e-300}
