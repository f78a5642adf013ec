"""The Endpoint Picker records its traffic through the same recorder as ``serve`` (both end
a request in the gateway's ``_job_done``): one line per request with what the served replica
reported."""

import json

import orjson
import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from tests.unit.test_epp_picker import (CHAT, R1, Harness, make_config,  # noqa: E402
                                        request_body, request_headers, response_body,
                                        response_headers, run)


def test_a_request_through_the_epp_is_recorded_with_the_served_replica(monkeypatch, tmp_path):
    config = make_config(monkeypatch, record={"path": str(tmp_path / "rec")})

    async def scenario():
        async with Harness(config) as h:
            usage = {"prompt_tokens": 9, "completion_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": 4}}
            await h.process(request_headers(), request_body(CHAT),
                            response_headers(200, served=R1),
                            response_body(orjson.dumps({"choices": [], "usage": usage}),
                                          end=True))
    run(scenario())
    [file] = sorted((tmp_path / "rec").glob("*.jsonl"))
    header, line = (json.loads(text) for text in file.read_text().splitlines())
    assert (header["policy"], header["replicas"]) == ("least_loaded", 3)
    # Envoy's first pick (r0) failed over to r1, which served: two attempts.
    assert (line["live_replica"], line["attempts"], line["status"]) == ("r1", 2, "200")
    assert (line["live_prompt_tokens"], line["live_cached_tokens"]) == (9, 4)
    assert line["output_length"] == 3
    assert "hello there" not in file.read_text()
