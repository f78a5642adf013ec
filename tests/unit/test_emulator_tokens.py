"""Prompt encoding (fallback tokenizer, chat media placeholders) and the dummy reply."""

from __future__ import annotations

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
