"""Spec of the tokenizer edge: vLLM's tokenization of completions and chat, and clear errors."""

from __future__ import annotations

import json
import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.errors import InputError
from prefixroute.edges.tokenization import SegmentCache, load_tokenizer
from tests.helpers.tiny_tokenizer import CHAT_TEMPLATE, copy_with_template


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def test_completions_text_gets_the_bos_of_the_post_processor(tokenizer):
    bos = tokenizer.tokenizer.token_to_id("<|bos|>")
    ids = tokenizer.encode("hello world")
    assert ids[0] == bos
    assert ids[1:] == tokenizer.encode("hello world", add_special_tokens=False)


def test_chat_renders_the_template_and_adds_no_special_tokens(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    assert tokenizer.encode_chat(messages) == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode_chat(messages)) == text


def test_content_parts_render_as_their_text(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                           {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(parts) == "<|user|>a\nb\n<|assistant|>"


WORDS = ["<|user|>", "<|assistant|>", " ", "\n", "\n\n", "  x", "def", "Zoë", "12:30", "€",
         "<|bos|>", "\t", "return", "(a, b)", "Word", "ÿ"]


def test_batches_through_the_segment_cache_equal_one_by_one_encoding(tokenizer):
    rng = random.Random(0)
    words = WORDS
    texts = ["".join(rng.choice(words) for _ in range(rng.randint(0, 30))) for _ in range(300)]
    for special in (True, False):
        expected = [tokenizer.tokenizer.encode(t, add_special_tokens=special).ids for t in texts]
        assert tokenizer.encode_batch(texts, add_special_tokens=special) == expected
        assert tokenizer.encode_batch(texts, add_special_tokens=special) == expected  # cached


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(WORDS), max_size=30), st.booleans(), st.sampled_from(["a", "b"]))
def test_single_texts_through_the_segment_cache_equal_the_library(tokenizer, words, special,
                                                                  partition):
    # The gateway's path: each piece between added tokens is encoded once per trust group
    # and joined; the ids are exactly the library's for the whole text, cached or not.
    text = "".join(words)
    expected = tokenizer.tokenizer.encode(text, add_special_tokens=special).ids
    assert tokenizer.encode(text, special, partition=partition) == expected
    assert tokenizer.encode(text, special, partition=partition) == expected  # cached


def test_a_chat_prompt_with_a_known_system_prompt_encodes_only_its_new_turn(tokenizer):
    system = {"role": "system", "content": "A long handbook. " * 40}
    first = tokenizer.apply_chat_template([system, {"role": "user", "content": "one?"}])
    second = tokenizer.apply_chat_template([system, {"role": "user", "content": "two?"}])
    segments = tokenizer.segments
    tokenizer.encode(first, False, partition="group-1")
    before = segments.encoded
    ids = tokenizer.encode(second, False, partition="group-1")
    assert segments.encoded == before + 1  # "two?\n" only; the handbook was known
    assert ids == tokenizer.tokenizer.encode(second, add_special_tokens=False).ids


def test_truncation_and_padding_in_tokenizer_json_are_ignored_as_vllm_does(tiny_tokenizer_dir):
    # transformers turns a tokenizer.json's truncation and padding off for every encode that
    # does not ask for them, so vLLM tokenizes the whole prompt, unpadded.
    loaded = load_tokenizer(tiny_tokenizer_dir)
    text = "<|user|>" + "many words here " * 10 + "<|assistant|>"
    full = loaded.encode(text, False)
    loaded.tokenizer.enable_truncation(8)
    loaded.tokenizer.enable_padding(length=400)
    configured = type(loaded)(loaded.tokenizer, loaded.chat_template_source,
                              loaded.special_tokens, loaded.path)
    assert len(full) > 8
    assert configured.encode(text, False) == full
    assert [list(ids) for ids in configured.encode_arrays(["hi", text], False)] == [
        configured.encode("hi", False), full]


def test_added_tokens_are_found_longest_first_with_thousands_of_them():
    # The splitter is a trie: "<unused12>" wins over "<unused1>" at one position, and a
    # text of 50,000 "<" costs a length of one token per position, not one try per token.
    import re
    import time

    from prefixroute.edges.tokenization import _trie_pattern
    tokens = [f"<unused{i}>" for i in range(6000)] + ["<", "<|user|>"]
    splitter = re.compile("(" + _trie_pattern(sorted(tokens, key=len, reverse=True)) + ")")
    assert splitter.split("a<unused12>b<unused1>c<|user|><x") == [
        "a", "<unused12>", "b", "<unused1>", "c", "<|user|>", "", "<", "x"]
    started = time.process_time()
    assert len(splitter.split("<" * 50_000)) == 100_001
    assert time.process_time() - started < 2.0  # about 0.02 s; a plain alternation takes > 1 s


def test_the_segment_cache_keeps_to_its_character_budget():
    cache = SegmentCache(max_entries=10, max_chars=10)
    cache.put("g", "abcd", array("I", [1]))
    cache.put("g", "efgh", array("I", [2]))
    cache.put("g", "ijkl", array("I", [3]))  # 12 characters: the oldest piece goes
    assert (cache.get("g", "abcd"), list(cache.get("g", "ijkl")), cache.chars) == (None, [3], 8)
    cache.put("g", "x" * 11, array("I", [4]))  # larger than the whole budget: not kept
    assert (cache.get("g", "x" * 11), len(cache)) == (None, 2)
    assert cache.get("h", "efgh") is None  # another partition sees nothing of "g"


def test_template_helpers_of_transformers_are_available(tiny_tokenizer_dir, tmp_path):
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                "{% endif %}{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}")
    tokenizer = load_tokenizer(copy_with_template(tiny_tokenizer_dir, tmp_path, template))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '<|bos|>{"role": "user", "content": "é"}')
    with pytest.raises(InputError, match="chat template failed: user first"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])


def test_a_chat_template_jinja_file_is_read_when_the_config_has_none(tiny_tokenizer_dir, tmp_path):
    copy_with_template(tiny_tokenizer_dir, tmp_path, CHAT_TEMPLATE)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_a_missing_directory_is_an_input_error_naming_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="tokenizer directory not found") as info:
        load_tokenizer("./tokenizer")
    assert info.value.where == str(tmp_path / "tokenizer")


def test_a_directory_without_tokenizer_json_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_a_broken_tokenizer_json_is_an_input_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(InputError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def test_a_broken_config_is_an_input_error(tiny_tokenizer_dir, tmp_path):
    copy_with_template(tiny_tokenizer_dir, tmp_path, CHAT_TEMPLATE)
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(InputError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_a_template_that_does_not_compile_is_an_input_error(tiny_tokenizer_dir, tmp_path):
    with pytest.raises(InputError, match="does not compile"):
        load_tokenizer(copy_with_template(tiny_tokenizer_dir, tmp_path, "{% for %}"))


def test_a_tokenizer_without_template_refuses_chat(tiny_tokenizer_dir, tmp_path):
    copy_with_template(tiny_tokenizer_dir, tmp_path, CHAT_TEMPLATE)
    (tmp_path / "tokenizer_config.json").unlink()
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("x")
    with pytest.raises(InputError, match="no chat_template"):
        tokenizer.encode_chat([{"role": "user", "content": "x"}])
