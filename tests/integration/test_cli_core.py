"""The ``hash`` and ``repro`` subcommands, run as a user runs them."""

import json
import subprocess
import sys

import pytest

from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import CacheIdentity


def cli(*args, check=False):
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=120, check=check)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(list(range(1, 101))))
    return path


def test_hash_json_prints_vllm_digests_and_event_ids(token_file):
    out = cli("hash", "--profile", "vllm", "--algo", "sha256", "--block-size", "32",
              "--cache-salt", "S", str(token_file), "--json", check=True)
    result = json.loads(out.stdout)
    expected = BlockHasher("vllm", "sha256", 32).block_hashes(list(range(1, 101)),
                                                              CacheIdentity(cache_salt="S"))
    assert result["block_digests"] == [d.hex() for d in expected]
    assert result["event_block_hashes"] == [int.from_bytes(d[-8:], "big") for d in expected]


def test_hash_with_lora_and_mm_changes_the_digests(token_file):
    plain = json.loads(cli("hash", "--block-size", "32", str(token_file), "--json").stdout)
    lora = json.loads(cli("hash", "--block-size", "32", "--lora", "a", "/a", str(token_file),
                          "--json").stdout)
    mm = json.loads(cli("hash", "--block-size", "32", "--mm", "img:40:10", str(token_file),
                        "--json").stdout)
    assert all(p != q for p, q in zip(plain["block_digests"], lora["block_digests"]))
    # the image covers tokens 40..49: block 0 is untouched, block 1 and later change
    assert mm["block_digests"][0] == plain["block_digests"][0]
    assert mm["block_digests"][1] != plain["block_digests"][1]


@pytest.mark.parametrize("args,message", [
    (["--profile", "nope"], "unknown --profile"),
    (["--algo", "md5"], "unknown vllm hash algorithm"),
    (["--block-size", "0"], "at least 1"),
])
def test_hash_bad_settings_exit_2_with_one_clear_line(token_file, args, message):
    result = cli("hash", *args, str(token_file))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_hash_malformed_token_file_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2,\n")
    result = cli("hash", str(bad))
    assert result.returncode == 2 and f"{bad}:2" in result.stderr
    bad.write_text('[1, "x"]')
    result = cli("hash", str(bad))
    assert result.returncode == 2 and "token 1" in result.stderr


def test_repro_json_has_the_spec_numbers():
    result = json.loads(cli("repro", "--json", check=True).stdout)
    conv = result["conversation"]
    assert conv["total_reused_tokens"] == 3950 and conv["full_block_reused_total"] == 3904
    routing = result["routing"]
    assert [routing[p]["reused_prefix_tokens"] for p in ("round_robin", "affinity_only",
                                                        "hybrid")] == [10000, 13800, 12000]
    assert result["universal_prefix"]["warmup_saving_tokens"] == 800
    assert result["isolation"]["cross_tenant_hit_with_distinct_salts"] is False
    assert [round(result["fleet"][k], 3) for k in ("random", "prefix_aware",
                                                   "timestamp_at_top")] == [0.837, 0.968, 0.0]
    assert round(result["economics"]["break_even"]["5m_1.25x"], 3) == 0.217


def test_repro_human_output_names_every_section():
    out = cli("repro", check=True).stdout
    for heading in ("Five-turn conversation", "Universal prefix", "Skewed routing trace",
                    "Fleet hit rates", "Economics", "Isolation"):
        assert heading in out


def test_a_replica_on_a_taken_port_exits_2_with_one_line():
    import socket

    from prefixroute.edges.listen import can_avoid_ephemeral_ports, free_port
    if not can_avoid_ephemeral_ports():
        pytest.skip("free_port falls back to the ephemeral range here (the message adds a hint)")
    port = free_port()  # outside the ephemeral range: no hint about choosing another port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = cli("replica", "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"prefixroute replica: error: cannot listen on "
                                     f"127.0.0.1:{port}: Address already in use")
