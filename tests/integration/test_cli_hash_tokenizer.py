"""``hash`` and ``tokenizer`` as a newcomer runs them: the offline tokenizer, ids versus text,
multimodal items, event ids a JavaScript reader can keep, and usage errors that name the
subcommand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def prefixroute(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixroute", *map(str, args)],
                          capture_output=True, text=True, timeout=180)


@pytest.fixture()
def tokens_100(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(list(range(100))))
    return path


def test_tokenizer_tiny_writes_a_directory_that_lint_and_hash_read(tmp_path):
    directory = tmp_path / "tok"
    result = prefixroute("tokenizer", "--tiny", directory)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in directory.iterdir()) == ["tokenizer.json",
                                                          "tokenizer_config.json"]
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("You are a helpful assistant. " * 20)
    hashed = prefixroute("hash", "--tokenizer", directory, prompt, "--json")
    assert hashed.returncode == 0, hashed.stderr
    assert len(json.loads(hashed.stdout)["block_digests"]) >= 5
    again = prefixroute("tokenizer", "--tiny", directory)
    assert again.returncode == 2 and "exists" in again.stderr


def test_tokenizer_tiny_under_a_file_is_a_usage_error_not_a_traceback(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    result = prefixroute("tokenizer", "--tiny", tmp_path / "notes.txt" / "tok")
    assert result.returncode == 2, result.stderr
    assert "cannot write" in result.stderr and "notes.txt" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_shared_test_tokenizer_is_the_one_the_command_writes(tmp_path, tiny_tokenizer_dir):
    directory = tmp_path / "tok"
    assert prefixroute("tokenizer", "--tiny", directory).returncode == 0
    assert (directory / "tokenizer.json").read_text() == \
        (tiny_tokenizer_dir / "tokenizer.json").read_text()


def test_every_tokenizer_flag_names_the_offline_command():
    for command in ("diff", "lint", "hash", "doctor", "replica"):
        text = " ".join(prefixroute(command, "--help").stdout.split())
        assert "prefixroute tokenizer --tiny DIR" in text, command


def test_hash_with_tokenizer_reads_a_file_of_token_ids_as_ids(tokens_100, tiny_tokenizer_dir):
    plain = prefixroute("hash", tokens_100, "--json")
    with_tokenizer = prefixroute("hash", "--tokenizer", tiny_tokenizer_dir, tokens_100, "--json")
    assert with_tokenizer.returncode == 0, with_tokenizer.stderr
    # 100 ids are 6 full blocks of 16; the JSON text tokenized would be hundreds of tokens.
    assert json.loads(with_tokenizer.stdout) == json.loads(plain.stdout)
    assert len(json.loads(plain.stdout)["block_digests"]) == 6
    assert "holds 100 token ids" in with_tokenizer.stderr


def test_hash_takes_several_media_items_after_one_mm(tokens_100):
    one_flag = prefixroute("hash", "--mm", "img1:10:20", "img2:40:10", tokens_100, "--json")
    repeated = prefixroute("hash", "--mm", "img1:10:20", "--mm", "img2:40:10", tokens_100,
                           "--json")
    assert one_flag.returncode == 0, one_flag.stderr
    assert json.loads(one_flag.stdout) == json.loads(repeated.stdout)
    plain = prefixroute("hash", tokens_100, "--json")
    assert json.loads(one_flag.stdout) != json.loads(plain.stdout)


def test_hash_refuses_a_media_item_beyond_the_prompt(tokens_100):
    result = prefixroute("hash", "--mm", "img:500:20", tokens_100)
    assert result.returncode == 2
    assert "spans tokens 500-519, but the prompt has 100 tokens" in result.stderr
    assert result.stdout == ""


def test_hash_json_gives_event_ids_also_as_strings(tokens_100):
    out = json.loads(prefixroute("hash", tokens_100, "--json").stdout)
    events, strings = out["event_block_hashes"], out["event_block_hash_strings"]
    assert strings == [str(e) for e in events]
    assert any(e > 2 ** 53 for e in events)  # what a double would round


def test_an_unknown_flag_shows_the_subcommands_usage(tokens_100):
    result = prefixroute("hash", "--bogus", tokens_100)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: prefixroute hash ")
    assert "unrecognized arguments: --bogus" in result.stderr
