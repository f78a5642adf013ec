"""Recording served traffic: what a recording holds and what it must never hold, how its
files rotate, and that the request path never waits for it. The gateway runs in one process
(fake replicas behind ``httpx.MockTransport``, as in ``test_gateway_app``); the files are
read back with the simulator's reader."""

import json
import threading

import pytest

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.identity.identity import derive_trust_group_salt
from prefixroute.edges.gateway.config import RecordConfig
from prefixroute.edges.gateway.recorder import (TrafficRecorder, block_id, output_tokens_of,
                                                trust_group_id)
from prefixroute.edges.traces.recording import RECORDING_KEY, Recording
from tests.unit.test_gateway_app import BLOCK, SECRET, Harness, make_config, run

# 13 distinct words, 90 characters: 23 estimated tokens (4 characters each, rounded up) and
# 5 full character blocks of 16 characters (BLOCK 4 x 4).
PROMPT = ("zebra quartz violin mango harbor pencil glacier saffron tundra orbit lantern "
          "cobalt meadow")


def lines_of(directory):
    files = sorted(directory.glob("*.jsonl"))
    out = []
    for file in files:
        out.append([json.loads(line) for line in file.read_text().splitlines()])
    return out


def test_a_recorded_request_has_the_documented_fields_and_no_prompt_text(monkeypatch,
                                                                         tmp_path):
    config = make_config(monkeypatch, record={"path": str(tmp_path / "rec")})

    async def scenario():
        async with Harness(config) as h:
            await h.openai().completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
            stream = await h.openai().completions.create(model="tiny", prompt=PROMPT,
                                                         max_tokens=5, stream=True)
            async for _ in stream:
                pass
    run(scenario())
    [file] = lines_of(tmp_path / "rec")
    header, first, second = file
    assert header == {RECORDING_KEY: 1, "block_size": BLOCK, "policy": "hybrid:max_skew=4",
                      "replicas": 2, "cache_blocks": None,
                      "started_unix_ms": header["started_unix_ms"]}
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids",
                          "trust_group", "model", "live_replica", "live_prompt_tokens",
                          "live_cached_tokens", "live_ttft_ms", "live_latency_ms", "status",
                          "attempts", "input_estimated"}
    # Character blocks (no tokenizer); the fake replica says 2 completion tokens.
    assert (first["input_length"], len(first["hash_ids"]), first["output_length"]) == (23, 5, 2)
    assert first["status"] == "200" and first["live_ttft_ms"] is None  # not streamed
    assert second["live_ttft_ms"] is not None
    assert second["hash_ids"] == first["hash_ids"]  # same group, same prompt, same ids
    text = "\n".join(json.dumps(line) for line in file)
    for word in PROMPT.split():
        assert word not in text
    salt = derive_trust_group_salt(config.server_secret, "g1")
    for secret in ("alice", "key-alice", salt, SECRET, "tiny"):  # "tiny": the model's name
        assert secret not in text


def test_the_same_prompt_gets_other_ids_in_another_trust_group(monkeypatch, tmp_path):
    config = make_config(monkeypatch, record={"path": str(tmp_path / "rec")})

    async def scenario():
        async with Harness(config) as h:
            for key in ("key-alice", "key-bob", "key-alice"):
                await h.openai(key).completions.create(model="tiny", prompt=PROMPT,
                                                       max_tokens=2)
    run(scenario())
    [[_, alice, bob, alice_again]] = lines_of(tmp_path / "rec")
    assert alice["trust_group"] == alice_again["trust_group"] != bob["trust_group"]
    assert alice["hash_ids"] == alice_again["hash_ids"]
    assert not set(alice["hash_ids"]) & set(bob["hash_ids"])


def test_block_ids_are_keyed_with_the_secret_and_scoped_to_the_group():
    # Equal inputs give equal ids; another group or another secret gives another id.
    assert block_id(b"s" * 32, "tg-a", 7) == block_id(b"s" * 32, "tg-a", 7)
    assert block_id(b"s" * 32, "tg-a", 7) != block_id(b"s" * 32, "tg-b", 7)
    assert block_id(b"s" * 32, "tg-a", 7) != block_id(b"t" * 32, "tg-a", 7)
    assert 0 <= block_id(b"s" * 32, "tg-a", 2**64 - 1) < 2**32  # the reader's uint32
    assert trust_group_id(b"s" * 32, "salt-1") != trust_group_id(b"t" * 32, "salt-1")
    assert trust_group_id(b"s" * 32, "salt-1").startswith("tg-")
    assert "salt-1" not in trust_group_id(b"s" * 32, "salt-1")


def test_output_length_is_the_reply_else_the_cap_else_one():
    assert output_tokens_of({"completion_tokens": 7}, {"max_tokens": 50}) == 7
    assert output_tokens_of(None, {"max_tokens": 50}) == 50
    assert output_tokens_of(None, {"max_completion_tokens": 9}) == 9
    assert output_tokens_of({"completion_tokens": 0}, {}) == 1
    assert output_tokens_of(None, {}) == 1


class FinishedJob:
    """The fields of a finished ``Job`` the recorder reads, for the writer-level tests."""

    def __init__(self, started, keys=(1, 2, 3), salt="salt-a"):
        from types import SimpleNamespace
        self.started = started
        self.checked = SimpleNamespace(body={"cache_salt": salt, "max_tokens": 4},
                                       model="m")
        self.prompt = SimpleNamespace(block_keys=tuple(keys), num_tokens=len(keys) * 16,
                                      mode="token_ids")
        self.usage = {"prompt_tokens": len(keys) * 16, "completion_tokens": 4}
        self.replica, self.cached_tokens, self.ttft_s = "r0", 16, 0.01
        self.status, self.attempts = "200", 1


def recorder(tmp_path, **fields):
    from prometheus_client import CollectorRegistry
    config = RecordConfig(tmp_path / "rec", **fields)
    registry = CollectorRegistry()
    rec = TrafficRecorder(config, b"k" * 32, registry, block_size=16,
                          policy="prefixroute", fleet=lambda: {"replicas": 2,
                                                               "cache_blocks": 100},
                          now=lambda: 0.0, wall=lambda: 1_800_000_000.0)
    rec.check_directory()
    rec.registry = registry
    return rec


def written(rec):
    return rec.registry.get_sample_value("prefixroute_gateway_trace_records_total")


def dropped(rec, reason):
    return rec.registry.get_sample_value("prefixroute_gateway_trace_records_dropped_total",
                                         {"reason": reason})


def test_rotation_keeps_the_newest_k_files(tmp_path):
    # A header is about 135 bytes and a line of 40 ids about 700: with 0.001 MB (1,000-byte)
    # files the second line crosses the limit, so each file holds 2 records; 12 records
    # make 6 files (00000 to 00005), and keep=2 leaves the last two.
    rec = recorder(tmp_path, rotate_mb=0.001, keep=2)
    rec.start()
    for i in range(12):
        rec.record(FinishedJob(float(i), keys=range(1000 + 40 * i, 1040 + 40 * i)), i + 0.5)
    rec.close()
    files = sorted((tmp_path / "rec").glob("*.jsonl"))
    assert [f.name[-11:] for f in files] == ["00004.jsonl", "00005.jsonl"]
    for file in files:
        assert RECORDING_KEY in json.loads(file.read_text().splitlines()[0])
    requests = list(Recording(tmp_path / "rec"))
    assert len(requests) == 4  # the two newest files' records, each file whole
    assert written(rec) == 12


def test_a_full_queue_drops_and_counts_without_waiting(tmp_path):
    rec = recorder(tmp_path, queue=2)  # no writer started: nothing drains the queue
    for i in range(5):
        rec.record(FinishedJob(float(i)), i + 0.5)  # returns at once every time
    assert dropped(rec, "queue_full") == 3
    rec.start()
    rec.close()
    assert len(list(Recording(tmp_path / "rec"))) == 2


def test_records_written_out_of_order_replay_in_arrival_order(tmp_path):
    rec = recorder(tmp_path)
    rec.start()
    # A long request that arrived first ends last, after two short ones.
    rec.record(FinishedJob(2.0), 2.1)
    rec.record(FinishedJob(3.0), 3.1)
    rec.record(FinishedJob(1.0), 9.0)
    rec.close()
    recording = Recording(tmp_path / "rec")
    arrivals = [r.arrival_s for r in recording]
    assert arrivals == [0.0, 1.0, 2.0]
    assert [round(o.latency_s, 3) for o in recording.live] == [8.0, 0.1, 0.1]


def test_an_unwritable_directory_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="record.path"):
        recorder(tmp_path / "file")


def test_the_record_section_is_checked_like_the_rest(monkeypatch):
    with pytest.raises(InputError) as info:
        make_config(monkeypatch, record={"path": "rec", "rotate_mb": 0})
    assert info.value.field == "record.rotate_mb"
    with pytest.raises(InputError) as info:
        make_config(monkeypatch, record={"path": "rec", "keeep": 3})
    assert "keeep" in str(info.value)
    with pytest.raises(InputError) as info:
        make_config(monkeypatch, record={"rotate_mb": 5})
    assert info.value.field == "record.path"


def test_a_write_error_is_counted_and_the_writer_goes_on(tmp_path):
    rec = recorder(tmp_path)
    rec.start()
    done = threading.Event()
    original = rec.line

    def failing(item):
        if not done.is_set():
            done.set()
            raise OSError(28, "No space left on device")
        return original(item)

    rec.line = failing
    rec.record(FinishedJob(1.0), 1.5)
    rec.record(FinishedJob(2.0), 2.5)
    rec.close()
    assert dropped(rec, "write_error") == 1
    assert len(list(Recording(tmp_path / "rec"))) == 1


def test_a_prompt_without_tokens_is_counted_not_recorded(tmp_path):
    # An empty prompt in character blocks measures 0 tokens: a replay has nothing to
    # prefill, and the reader refuses a line with input_length 0.
    rec = recorder(tmp_path)
    rec.start()
    rec.record(FinishedJob(1.0, keys=()), 1.5)
    rec.record(FinishedJob(2.0), 2.5)
    rec.close()
    assert dropped(rec, "empty_prompt") == 1
    assert len(list(Recording(tmp_path / "rec"))) == 1



def test_a_reload_changing_the_policy_leaves_queued_records_in_the_old_policys_file(tmp_path):
    # Two requests end under prefixroute and wait in the queue (no writer yet); a reload
    # switches to round_robin; a third ends. The first file must name prefixroute and hold
    # the two, the second name round_robin and hold the third.
    rec = recorder(tmp_path)
    rec.record(FinishedJob(1.0), 1.5)
    rec.record(FinishedJob(2.0), 2.5)
    rec.set_policy("round_robin")
    rec.record(FinishedJob(3.0), 3.5)
    rec.start()
    rec.close()
    files = sorted((tmp_path / "rec").glob("*.jsonl"))
    contents = [f.read_text().splitlines() for f in files]
    assert [json.loads(lines[0])["policy"] for lines in contents] == ["prefixroute",
                                                                      "round_robin"]
    assert [len(lines) - 1 for lines in contents] == [2, 1]
