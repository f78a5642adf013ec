"""gateway.yaml: what loads, what is refused, and how the refusal names file, line and field."""

import textwrap

import pytest

from prefixroute.core.errors import InputError
from prefixroute.core.routing.registry import policy_names
from prefixroute.edges.gateway.config import (RateLimit, default_policy_spec, hash_api_key,
                                             load_config)

SECRET = "s" * 64
KEY_A = hash_api_key("key-a")


def write(tmp_path, text, name="gateway.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL = f"""\
server_secret: {{env: PR_TEST_SECRET}}
backends:
  - url: http://127.0.0.1:8001
    models: [tiny]
tenants:
  - name: a
    api_key_sha256: {KEY_A}
"""


@pytest.fixture(autouse=True)
def secret_env(monkeypatch):
    monkeypatch.setenv("PR_TEST_SECRET", SECRET)


def error_of(tmp_path, text) -> str:
    with pytest.raises(InputError) as info:
        load_config(write(tmp_path, text))
    return str(info.value)


def test_minimal_config_fills_documented_defaults(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert config.backends[0].name == "r0"
    assert config.backends[0].models == ("tiny",)
    assert config.tenants[0].trust_group == "a"  # defaults to the tenant's name
    assert config.server_secret == SECRET.encode()
    assert config.hashing.block_size == 16 and config.hashing.algo == "sha256"
    assert config.retries == 2
    assert config.caller_cache_salt == "reject"
    assert config.limits.max_body_bytes == 4 * 1024 * 1024
    assert config.limits.max_header_bytes == 64 * 1024
    assert (config.limits.header_timeout_s, config.limits.body_timeout_s) == (10.0, 60.0)
    assert config.policy == default_policy_spec()
    assert config.busy_poll_s == 0.0  # off: the loop sleeps when idle


def test_request_limits_are_read_and_checked(tmp_path):
    text = MINIMAL + "limits:\n  max_header_bytes: 8192\n  header_timeout_s: 2.5\n" \
        "  body_timeout_s: 30\n"
    limits = load_config(write(tmp_path, text)).limits
    assert (limits.max_header_bytes, limits.header_timeout_s, limits.body_timeout_s) == \
        (8192, 2.5, 30.0)
    message = error_of(tmp_path, MINIMAL + "limits:\n  header_timeout_s: 0\n")
    assert "limits.header_timeout_s" in message and "greater than 0" in message


def test_default_policy_is_decided_in_one_place():
    names = policy_names()
    expected = next(n for n in ("prefixroute", "hybrid", "least_loaded") if n in names)
    assert default_policy_spec() == expected


def test_example_config_in_the_repo_is_valid(monkeypatch):
    monkeypatch.setenv("PREFIXROUTE_SERVER_SECRET", SECRET)
    config = load_config("examples/gateway.yaml")
    assert [b.name for b in config.backends] == ["r0", "r1"]
    assert config.backends[0].kv_events.bind is True  # a concrete tcp address: vLLM connects
    assert config.tenants[0].api_key_hashes == (hash_api_key("sk-acme-example-key"),)


def test_missing_backends_names_the_field(tmp_path):
    message = error_of(tmp_path, MINIMAL.replace("backends:", "other:"))
    assert "gateway.yaml:" in message and "'backends'" in message


def test_bad_backend_url_names_file_line_and_field(tmp_path):
    message = error_of(tmp_path, MINIMAL.replace("http://127.0.0.1:8001", "ftp://x"))
    assert "gateway.yaml:3:" in message
    assert "backends[0].url" in message


def test_unknown_key_is_a_typo_not_ignored(tmp_path):
    message = error_of(tmp_path, MINIMAL + "retrys: 3\n")
    assert "gateway.yaml:8:" in message and "unknown key 'retrys'" in message


def test_a_misspelt_required_key_is_named_as_the_typo(tmp_path):
    message = error_of(tmp_path, MINIMAL.replace("  - url:", "  - ulr:"))
    assert "gateway.yaml:3:" in message
    assert "unknown key 'ulr': did you mean 'url'?" in message
    assert "backends[0].ulr" in message


def test_a_valid_key_beside_a_missing_one_is_not_called_its_typo(tmp_path):
    events = MINIMAL.replace("    models: [tiny]\n", "    models: [tiny]\n    kv_events:\n"
                             "      replay_endpoint: tcp://127.0.0.1:5560\n      topic: kv\n")
    message = error_of(tmp_path, events)
    assert "backends[0].kv_events.endpoint" in message and "did you mean" not in message


def test_plain_text_api_key_is_refused(tmp_path):
    message = error_of(tmp_path, MINIMAL.replace(KEY_A, "key-a"))
    assert "64 hex characters" in message and "tenants[0].api_key_sha256" in message


def test_same_key_for_two_tenants_is_refused(tmp_path):
    text = MINIMAL + f"  - name: b\n    api_key_sha256: {KEY_A}\n"
    assert "already belongs to tenant 'a'" in error_of(tmp_path, text)


def test_short_server_secret_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PR_TEST_SECRET", "short")
    message = error_of(tmp_path, MINIMAL)
    assert "at least 32" in message and "server_secret.env" in message


def test_unset_secret_variable_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("PR_TEST_SECRET")
    assert "PR_TEST_SECRET is not set" in error_of(tmp_path, MINIMAL)


def test_server_secret_from_a_file_relative_to_the_config(tmp_path):
    (tmp_path / "secret.txt").write_text("f" * 64 + "\n")
    text = MINIMAL.replace("{env: PR_TEST_SECRET}", "{file: secret.txt}")
    assert load_config(write(tmp_path, text)).server_secret == b"f" * 64


def test_a_secret_written_in_the_config_is_refused_without_echoing_it(tmp_path):
    value = "0123456789abcdef-the-secret-itself-0123456789abcdef"
    message = error_of(tmp_path, MINIMAL.replace("{env: PR_TEST_SECRET}", value))
    assert "server_secret" in message and "openssl rand -hex 32" in message
    assert "0123456789" not in message and "secret-itself" not in message


@pytest.mark.parametrize("value, accepted", [
    ("ab" * 16, False),  # openssl rand -hex 16: 32 characters, 16 bytes of key
    ("ab" * 32, True),  # openssl rand -hex 32
    ("QUJD" * 10 + "QQ==", False),  # base64 of 31 bytes (openssl rand -base64 31)
    ("QUJD" * 10 + "QUJD", True),  # base64 of 33 bytes
    ("x" * 42, False),  # text: at most 6 bits a character, 42 * 6 // 8 = 31 bytes
    ("x" * 43, True),  # 32 bytes
])
def test_the_secret_needs_32_bytes_of_key_in_its_written_form(tmp_path, monkeypatch, value,
                                                              accepted):
    monkeypatch.setenv("PR_TEST_SECRET", value)
    if accepted:
        assert load_config(write(tmp_path, MINIMAL)).server_secret == value.encode()
        return
    message = error_of(tmp_path, MINIMAL)
    assert "at least 32" in message and "openssl rand -hex 32" in message
    assert value not in message


def test_a_binary_secret_file_counts_its_bytes(tmp_path):
    (tmp_path / "secret.bin").write_bytes(bytes(range(128, 160)))  # 32 raw bytes
    text = MINIMAL.replace("{env: PR_TEST_SECRET}", "{file: secret.bin}")
    assert load_config(write(tmp_path, text)).server_secret == bytes(range(128, 160))


def test_unknown_policy_is_refused_with_the_known_ones(tmp_path):
    message = error_of(tmp_path, MINIMAL + "policy: nope\n")
    assert "unknown policy 'nope'" in message and "field 'policy'" in message


def test_policy_parameters_are_checked(tmp_path):
    assert "no parameter" in error_of(tmp_path, MINIMAL + "policy: hybrid:bogus=1\n")


def test_prefixroute_parameters_reach_the_policy_and_removed_ones_say_why(tmp_path):
    config = load_config(write(tmp_path, MINIMAL + "policy: prefixroute:priority_slack=0\n"))
    assert config.policy == "prefixroute:priority_slack=0"
    assert "no parameter 'bogus'" in error_of(tmp_path, MINIMAL + "policy: prefixroute:bogus=1\n")
    message = error_of(tmp_path, MINIMAL + "policy: prefixroute:replicate=true\n")
    assert "'replicate': removed: it lost" in message and "field 'policy'" in message
    message = error_of(tmp_path, MINIMAL + "policy: prefixroute:cold_cap=0.5\n")
    assert "cold_cap must be 0 (off) or at least 1" in message


def test_xxhash_needs_the_engines_hash_seed(tmp_path):
    message = error_of(tmp_path, MINIMAL + "hashing: {algo: xxhash}\n")
    assert "PYTHONHASHSEED" in message and "hashing.none_hash_seed" in message


def test_wildcard_kv_endpoint_means_connect(tmp_path):
    text = MINIMAL.replace("    models: [tiny]\n", "    models: [tiny]\n    kv_events:\n"
                           "      endpoint: tcp://*:5557\n")
    events = load_config(write(tmp_path, text)).backends[0].kv_events
    assert events.bind is False and events.endpoint == "tcp://127.0.0.1:5557"


def test_invalid_yaml_names_the_line(tmp_path):
    message = error_of(tmp_path, MINIMAL + "limits: [unclosed\n")
    assert "not valid YAML" in message and "gateway.yaml:" in message


def test_duplicate_key_is_refused(tmp_path):
    assert "duplicate key 'retries'" in error_of(tmp_path, MINIMAL + "retries: 1\nretries: 2\n")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_tokenizer_directory_must_hold_tokenizer_json(tmp_path):
    (tmp_path / "tok").mkdir()
    assert "no tokenizer.json" in error_of(tmp_path, MINIMAL + "tokenizer: tok\n")


def test_rate_limit_needs_a_rate(tmp_path):
    text = MINIMAL + "    rate_limit: {burst: 3}\n"
    assert "tenants[0].rate_limit.requests_per_second" in error_of(tmp_path, text)


def test_a_prompt_token_limit_alone_defaults_its_burst_to_one_second(tmp_path):
    text = MINIMAL + "    rate_limit: {prompt_tokens_per_second: 5000}\n"
    limit = load_config(write(tmp_path, text)).tenants[0].rate_limit
    assert limit == RateLimit(None, 0, 5000.0, 5000)


def test_both_limits_together(tmp_path):
    text = MINIMAL + ("    rate_limit: {requests_per_second: 2, burst: 4, "
                      "prompt_tokens_per_second: 1000, prompt_tokens_burst: 8000}\n")
    limit = load_config(write(tmp_path, text)).tenants[0].rate_limit
    assert limit == RateLimit(2.0, 4, 1000.0, 8000)


def test_a_token_burst_without_its_rate_is_refused_with_its_field(tmp_path):
    text = MINIMAL + ("    rate_limit: {requests_per_second: 2, "
                      "prompt_tokens_burst: 8000}\n")
    assert "tenants[0].rate_limit.prompt_tokens_burst" in error_of(tmp_path, text)


def test_a_measured_prefill_speed_reaches_the_replica_view(tmp_path):
    text = MINIMAL.replace("    models: [tiny]\n", "    models: [tiny]\n"
                           "    prefill_s_per_token: 2.5e-5\n")
    assert load_config(write(tmp_path, text)).backends[0].prefill_s_per_token == 2.5e-5


def test_busy_poll_takes_seconds_and_refuses_negative_ones(tmp_path):
    assert load_config(write(tmp_path, MINIMAL + "busy_poll_s: 0.1\n")).busy_poll_s == 0.1
    message = error_of(tmp_path, MINIMAL + "busy_poll_s: -1\n")
    assert message.endswith("gateway.yaml:8: must be non-negative and finite, got -1 "
                            "(field 'busy_poll_s')")
    # .inf would poll for ever after the first request: refused too
    assert "got inf" in error_of(tmp_path, MINIMAL + "busy_poll_s: .inf\n")
