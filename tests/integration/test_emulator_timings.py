"""The emulator's opt-in per-request timing records (PREFIXROUTE_EMULATOR_TIMINGS), over a
real socket: one record per generation request, with its id, and received <= first write."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from prefixroute.edges.emulator.process import EmulatorProcess
from prefixroute.edges.emulator.timings import ENV

MODEL = "timed"


@pytest.fixture(scope="module")
def timed():
    # A paced engine (50 ms steps) so the first event comes measurably after the request.
    env = {**os.environ, ENV: "4"}
    with EmulatorProcess(["--time-scale", "1", "--served-model-name", MODEL], env=env) as p:
        yield p


def _records(url: str) -> list[dict]:
    return httpx.get(url + "/debug/timings").json()["records"]


def test_a_streamed_request_leaves_one_record_with_its_ids(timed):
    httpx.delete(timed.url + "/debug/timings")
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True,
            "user": "tag-1"}
    started = time.perf_counter_ns()
    with httpx.stream("POST", timed.url + "/v1/completions", json=body,
                      headers={"x-request-id": "rid-1"}) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    ended = time.perf_counter_ns()
    assert events[-1] == "data: [DONE]"
    (record,) = _records(timed.url)
    assert record["request_id"] == "rid-1" and record["user"] == "tag-1"
    assert started <= record["received_ns"] <= record["first_event_ns"] <= ended


def test_non_generation_requests_leave_none_and_the_store_is_bounded(timed):
    httpx.delete(timed.url + "/debug/timings")
    httpx.get(timed.url + "/v1/models")
    assert _records(timed.url) == []
    for i in range(6):
        r = httpx.post(timed.url + "/v1/completions",
                       content=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1,
                                           "user": f"u{i}"}))
        assert r.status_code == 200
    records = _records(timed.url)
    assert [r["user"] for r in records] == ["u2", "u3", "u4", "u5"]  # the last 4
    assert all(r["request_id"] is None for r in records)
    assert all(r["received_ns"] <= r["first_event_ns"] for r in records)


def test_off_by_default(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != ENV}
    with EmulatorProcess(["--time-scale", "0"], env=env) as plain:
        assert httpx.get(plain.url + "/debug/timings").status_code == 404
