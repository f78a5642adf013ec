"""Prompt encoding (fallback tokenizer, chat media placeholders) and the dummy reply."""

from __future__ import annotations

import time

from prefixroute.core.identity.identity import MediaItem
from prefixroute.core.identity.media_parts import MEDIA_PART_TYPES
from prefixroute.edges.emulator.tokens import (
    DummyOutput,
    FallbackTokenizer,
    PromptEncoder,
    media_identity,
)


def test_the_fallback_tokenizer_is_deterministic_and_word_sized():
    tokenizer = FallbackTokenizer()
    ids = tokenizer.encode("Hello, world! 12345")
    assert ids == FallbackTokenizer().encode("Hello, world! 12345")
    # BOS, "Hello", ",", " world", "!", " 123", "45"
    assert len(ids) == 7 and ids[0] == FallbackTokenizer.BOS_ID
    assert all(t >= FallbackTokenizer.FIRST_ID for t in ids[1:])
    assert tokenizer.decode(ids[1:]) == "Hello, world! 12345"


def test_the_fallback_chat_template_marks_roles():
    encoder = PromptEncoder()
    prompt = encoder.encode_chat([{"role": "system", "content": "a"},
                                  {"role": "user", "content": "b"}])
    ids = prompt.token_ids
    roles = FallbackTokenizer.ROLE_IDS
    assert ids[0] == roles["system"] and ids[-1] == roles["assistant"]
    assert roles["user"] in ids


def test_images_become_placeholder_runs_with_their_identities():
    encoder = PromptEncoder(mm_item_tokens=8)
    content = [{"type": "text", "text": "look"},
               {"type": "image_url", "image_url": {"url": "data:x"}, "uuid": "img-1"},
               {"type": "text", "text": "and"},
               {"type": "image_url", "image_url": {"url": "https://e/b.png"}}]
    prompt = encoder.encode_chat([{"role": "user", "content": content}])
    first, second = prompt.media
    assert first == MediaItem("img-1", first.offset, 8)
    assert second.identifier == media_identity(content[3], MEDIA_PART_TYPES["image_url"])
    for item in prompt.media:
        run = prompt.token_ids[item.offset:item.offset + 8]
        assert run == [FallbackTokenizer.MEDIA_ID] * 8
    assert second.offset > first.offset + 8


def test_a_media_identity_is_its_uuid_or_a_digest_of_its_payload():
    assert media_identity({"uuid": "u"}, MEDIA_PART_TYPES["image_url"]) == "u"
    a = media_identity({"image_url": {"url": "https://e/a.png"}}, MEDIA_PART_TYPES["image_url"])
    b = media_identity({"image_url": {"url": "https://e/b.png"}}, MEDIA_PART_TYPES["image_url"])
    assert a != b and len(a) == 64


def test_chat_with_a_tokenizer_directory_renders_its_template(tiny_tokenizer_dir):
    from prefixroute.edges.tokenization import load_tokenizer

    encoder = PromptEncoder(tiny_tokenizer_dir)
    messages = [{"role": "user", "content": "def f(): pass"}]
    expected = load_tokenizer(tiny_tokenizer_dir).encode_chat(messages)
    assert encoder.encode_chat(messages).token_ids == expected


def test_the_dummy_reply_repeats_a_fixed_text_and_honours_allowed_token_ids():
    dummy = DummyOutput(PromptEncoder())
    ids = dummy.token_ids(200)
    assert ids[:len(dummy.cycle)] == dummy.cycle and len(ids) == 200
    assert dummy.text(3) == "".join(dummy.pieces[:3])
    assert dummy.token_ids(4, allowed=[7, 8]) == [7, 8, 7, 8]
    assert DummyOutput(PromptEncoder(), seed=1).cycle[0] == dummy.cycle[1]


def _first_encoding_seconds(encode, texts) -> float:
    """The fastest of several first encodings of distinct texts (the minimum is what noise on
    a loaded machine cannot lower)."""
    best = float("inf")
    for text in texts:
        start = time.perf_counter()
        encode(text)
        best = min(best, time.perf_counter() - start)
    return best


def test_the_fallback_tokenizing_cache_is_partitioned_by_cache_salt():
    tokenizer = FallbackTokenizer()
    text = "a prompt that tenant A sent first " * 4
    tokenizer.encode(text, partition="salt-a")
    before = FallbackTokenizer._encode_text.cache_info()
    assert tokenizer.encode(text, partition="salt-a") == tokenizer.encode(text, partition="salt-b")
    after = FallbackTokenizer._encode_text.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 1)


def test_another_trust_groups_text_is_not_faster_to_encode():
    """Tenant B's first sight of a text tenant A just sent costs a full tokenization, not a
    cache lookup: with a text-keyed cache B's time was about a thousandth of A's."""
    encoder = PromptEncoder()
    words = " ".join(f"w{i}" for i in range(20_000))
    texts = [f"{n} {words}" for n in range(5)]
    cold = _first_encoding_seconds(lambda t: encoder.encode_text(t, cache_salt="salt-a"), texts)
    other = _first_encoding_seconds(lambda t: encoder.encode_text(t, cache_salt="salt-b"), texts)
    warm = _first_encoding_seconds(lambda t: encoder.encode_text(t, cache_salt="salt-a"), texts)
    assert other > 0.25 * cold  # generous: equal work, only machine noise between them
    assert other > 10 * warm  # the cache still serves the tenant who sent the text


def test_chat_requests_are_cached_per_salt_with_a_real_tokenizer(tiny_tokenizer_dir):
    encoder = PromptEncoder(tiny_tokenizer_dir)
    messages = [{"role": "user", "content": "the same question from two tenants"}]
    segments = encoder.tokenizer.segments  # counts the pieces it had to tokenize
    start = segments.encoded
    first = encoder.encode_chat(messages, cache_salt="salt-a").token_ids
    once = segments.encoded - start
    assert encoder.encode_chat(messages, cache_salt="salt-b").token_ids == first
    assert segments.encoded - start == 2 * once >= 2  # nothing of salt-a's reused
