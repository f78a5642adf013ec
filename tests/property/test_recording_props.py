"""Invariants of a recording, whatever the traffic: read back, requests come in arrival
order with their lengths, and two blocks get the same id exactly when they have the same
trust group and the same engine block key."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from prefixroute.edges.gateway.config import RecordConfig
from prefixroute.edges.gateway.recorder import Finished, TrafficRecorder
from prefixroute.edges.traces.recording import Recording

BLOCK = 16
START_S = 1_800_000_000.0
requests_strategy = st.lists(
    st.tuples(st.integers(0, 10**6),                        # arrival, milliseconds
              st.integers(0, 50_000),                       # time until it ended, ms
              st.sampled_from(["salt-a", "salt-b", None]),  # trust group's salt
              st.lists(st.integers(0, 40), max_size=6),     # engine block keys (few: repeats)
              st.integers(1, BLOCK - 1)),                   # tokens past the last full block
    min_size=1, max_size=20, unique_by=lambda request: request[0])


def record(directory, sent):
    recorder = TrafficRecorder(RecordConfig(directory), b"p" * 32, CollectorRegistry(),
                               block_size=BLOCK, policy="prefixroute", now=lambda: 0.0,
                               wall=lambda: START_S)
    recorder.check_directory()
    recorder.start()
    # In the order requests end, as the gateway writes them.
    for arrival, took, salt, keys, extra in sorted(sent, key=lambda r: r[0] + r[1]):
        recorder.record_finished(Finished(
            START_S + arrival / 1000, salt, "m", tuple(keys), len(keys) * BLOCK + extra,
            False, 4, "r0", None, None, None, took / 1000, "200", 1))
    recorder.close()


@settings(max_examples=40, deadline=None)
@given(requests_strategy)
def test_a_recording_reads_back_in_arrival_order_with_ids_per_group(tmp_path_factory, sent):
    directory = tmp_path_factory.mktemp("rec")
    record(directory, sent)
    requests = list(Recording(directory))
    by_arrival = sorted(sent)
    first = by_arrival[0][0]
    assert [round(r.arrival_s * 1000) for r in requests] == [a - first for a, *_ in by_arrival]
    assert [(r.input_tokens, len(r.hash_ids)) for r in requests] == \
        [(len(keys) * BLOCK + extra, len(keys)) for _, _, _, keys, extra in by_arrival]
    # Every (salt, key) block against every other: same id exactly when both are equal
    # (at most 123 distinct blocks of 32-bit ids: an accidental collision has odds < 2e-6).
    blocks = {(salt, key): block for (_, _, salt, keys, _), request in zip(by_arrival, requests)
              for key, block in zip(keys, request.hash_ids)}
    for (a, id_a), (b, id_b) in itertools.combinations(blocks.items(), 2):
        assert id_a != id_b, (a, b)
    for (_, _, salt, keys, _), request in zip(by_arrival, requests):
        assert list(request.hash_ids) == [blocks[(salt, key)] for key in keys]
