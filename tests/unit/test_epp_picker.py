"""The Endpoint Picker's exchange, message by message, as Envoy sends them (ext_proc v3
protobufs), over a started :class:`Gateway` whose replicas answer health checks through
``httpx.MockTransport``. Real Envoy and emulator replicas are in
``tests/integration/test_epp_envoy.py``."""

import asyncio
import json

import httpx
import orjson
import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext  # noqa: E402

from prefixroute.core.clock import ManualClock  # noqa: E402
from prefixroute.core.identity.identity import derive_trust_group_salt  # noqa: E402
from prefixroute.edges.epp.config import EppSettings  # noqa: E402
from prefixroute.edges.epp.picker import EndpointPicker, ExchangeRun, _Collected  # noqa: E402
from prefixroute.edges.epp.protocol import ACCESS_LOG_METHOD, DESTINATION, SERVED  # noqa: E402
from prefixroute.edges.gateway.app import Gateway  # noqa: E402
from prefixroute.edges.gateway.config import hash_api_key, parse_config  # noqa: E402
from tests.helpers.loop import from_callback  # noqa: E402
from tests.helpers.redis_server import RedisServer, needs_redis  # noqa: E402

SECRET = "5e" * 32  # 64 hex digits: a 32-byte key
STREAMED_BODY = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
R0, R1, R2 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def make_config(monkeypatch, **extra):
    monkeypatch.setenv("PR_EPP_TEST_SECRET", SECRET)
    data = {
        "server_secret": {"env": "PR_EPP_TEST_SECRET"},
        "backends": [{"name": f"r{i}", "url": f"http://{e}", "models": ["tiny"]}
                     for i, e in enumerate((R0, R1, R2))],
        "tenants": [{"name": "alice", "api_key_sha256": hash_api_key("key-alice"),
                     "trust_group": "g1"},
                    {"name": "ops", "api_key_sha256": hash_api_key("key-ops"),
                     "admin": True}],
        "hashing": {"block_size": 4},
        "policy": "least_loaded",
        "health": {"interval_s": 60, "metrics_interval_s": 60},
    }
    data.update(extra)
    return parse_config(data, "test.yaml")


async def replica(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
        return httpx.Response(200)
    return httpx.Response(200, text="vllm:num_requests_running 0\n")


def headers(**pairs) -> ext.ProcessingRequest:
    end = pairs.pop("end_of_stream", False)
    values = [base_pb2.HeaderValue(key=k.replace("_", "-").replace("-path", ":path")
                                   .replace("-method", ":method").replace("-status",
                                                                          ":status"),
                                   raw_value=v.encode()) for k, v in pairs.items()]
    return ext.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end)


def request_headers(path="/v1/chat/completions", key="key-alice", **extra):
    pairs = {"_path": path, "_method": "POST", **extra}
    if key is not None:
        pairs["authorization"] = f"Bearer {key}"
    return ext.ProcessingRequest(request_headers=headers(**pairs))


def request_body(body: dict) -> ext.ProcessingRequest:
    return ext.ProcessingRequest(request_body=ext.HttpBody(body=json.dumps(body).encode(),
                                                           end_of_stream=True))


def response_headers(status=200, served=None) -> ext.ProcessingRequest:
    pairs = {"_status": str(status)}
    if served:
        pairs[SERVED] = served
    return ext.ProcessingRequest(response_headers=headers(**pairs))


def response_body(data: bytes, end=False) -> ext.ProcessingRequest:
    return ext.ProcessingRequest(response_body=ext.HttpBody(body=data, end_of_stream=end))


class Harness:
    def __init__(self, config, settings=None):
        self.gateway = Gateway(config, transport=httpx.MockTransport(replica),
                               clock=ManualClock())
        self.picker = EndpointPicker(self.gateway, settings or EppSettings())

    async def __aenter__(self):
        await self.gateway.start()
        return self

    async def __aexit__(self, *exc):
        await self.gateway.stop()

    async def process(self, *messages) -> list[ext.ProcessingResponse]:
        """One ext_proc stream: ``messages`` in, the EPP's answers out, then the end."""
        async def stream():
            for message in messages:
                yield message
        return [r async for r in self.picker.Process(stream())]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))



CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}


def set_headers(common: ext.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in common.header_mutation.set_headers}


def test_a_missing_key_is_refused_at_the_headers_with_an_openai_401(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            [answer] = await h.process(request_headers(key=None))
            refusal = answer.immediate_response
            assert refusal.status.code == 401
            assert orjson.loads(refusal.body)["error"]["code"] == "missing_api_key"
            assert h.gateway.open_requests == 0
    run(scenario())


def test_the_body_is_salted_and_the_picked_replica_named_first_then_fallbacks(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            continued, routed = await h.process(request_headers(), request_body(CHAT))
            assert continued.HasField("request_headers")
            common = routed.request_body.response
            sent = orjson.loads(common.body_mutation.body)
            assert sent["cache_salt"] == derive_trust_group_salt(SECRET.encode(), "g1")
            values = set_headers(common)
            assert values["content-length"] == str(len(common.body_mutation.body))
            # least_loaded, all idle: replica 0 first; two fallbacks (retries: 2 by default).
            assert values[DESTINATION] == f"{R0},{R1},{R2}"
            lb = routed.dynamic_metadata.fields["envoy.lb"].struct_value
            assert lb.fields[DESTINATION].string_value == values[DESTINATION]
            assert "authorization" in common.header_mutation.remove_headers
            # The stream ended without a response: the caller left before any answer.
            [decision] = h.gateway.router.recent(5)
            assert decision["outcome"] == "abandoned"
            assert h.gateway.admission.active == 0 and h.gateway.open_requests == 0
    run(scenario())


def test_a_caller_salt_gets_the_gateways_400(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            _, refused = await h.process(request_headers(),
                                         request_body({**CHAT, "cache_salt": "mine"}))
            assert refused.immediate_response.status.code == 400
            assert orjson.loads(refused.immediate_response.body)["error"]["code"] == \
                "caller_cache_salt"
            assert h.gateway.admission.active == 0
    run(scenario())


def test_a_fallback_that_served_fails_the_picked_replica_and_books_the_served(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            usage = {"prompt_tokens": 9, "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": 4}}
            await h.process(request_headers(), request_body(CHAT),
                            response_headers(200, served=R1),
                            response_body(orjson.dumps({"choices": [], "usage": usage}),
                                          end=True))
            served, picked = h.gateway.router.recent(2)
            assert (picked["replica"], picked["attempt"], picked["outcome"]) == \
                ("r0", 0, "failed:envoy_retry")
            assert (served["replica"], served["attempt"], served["outcome"]) == ("r1", 1, "ok")
            assert served["reported_cached_tokens"] == 4
            backends = h.gateway.pool.backends
            assert [b.in_flight for b in backends] == [0, 0, 0]
            assert backends[0].breaker.consecutive_failures == 1
    run(scenario())


def test_the_usage_chunk_the_caller_did_not_ask_for_is_dropped_from_the_stream(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            usage = {"prompt_tokens": 9, "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            event = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            tail = b"data: " + orjson.dumps({"choices": [], "usage": usage}) + \
                b"\n\ndata: [DONE]\n\n"
            answers = await h.process(
                request_headers(), request_body({**CHAT, "stream": True}),
                response_headers(200, served=R0),
                response_body(event), response_body(tail[:20]), response_body(tail[20:]),
                response_body(b"", end=True))
            _, routed, head, first, part, rest, end = answers
            assert orjson.loads(routed.request_body.response.body_mutation.body)[
                "stream_options"] == {"include_usage": True}
            assert SERVED in head.response_headers.response.header_mutation.remove_headers
            assert not first.response_body.response.HasField("body_mutation")  # unchanged
            # Half an event waits for the rest; the usage event is then left out.
            assert part.response_body.response.body_mutation.body == b""
            assert rest.response_body.response.body_mutation.body == b"data: [DONE]\n\n"
            [decision] = h.gateway.router.recent(1)
            assert decision["outcome"] == "ok" and decision["reported_cached_tokens"] == 0
            assert h.gateway.admission.active == 0
    run(scenario())


def test_a_trusted_tenant_header_names_the_tenant_without_a_key(monkeypatch):
    async def scenario():
        settings = EppSettings(trusted_tenant_header="x-tenant")
        async with Harness(make_config(monkeypatch), settings) as h:
            _, routed = await h.process(request_headers(key=None, x_tenant="alice"),
                                        request_body(CHAT))
            sent = orjson.loads(routed.request_body.response.body_mutation.body)
            assert sent["cache_salt"] == derive_trust_group_salt(SECRET.encode(), "g1")
            [refused] = await h.process(request_headers(key="key-alice", x_tenant="mallory"))
            assert refused.immediate_response.status.code == 401
    run(scenario())


def test_a_replica_error_status_ends_the_attempt_failed(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            await h.process(request_headers(), request_body(CHAT),
                            response_headers(503, served=R0),
                            response_body(b'{"error":{"message":"x"}}', end=True))
            [decision] = h.gateway.router.recent(1)
            assert decision["outcome"] == "failed:http_503"
            assert h.gateway.pool.backends[0].in_flight == 0
    run(scenario())


def test_without_a_headers_message_the_attributes_say_who_served(monkeypatch):
    """The bootstrap skips response headers: status and served replica arrive as the
    ``response.code`` and ``upstream.address`` attributes of the first body message."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            usage = {"prompt_tokens": 9, "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": 8}}
            answer = response_body(orjson.dumps({"choices": [], "usage": usage}), end=True)
            answer.attributes["envoy.filters.http.ext_proc"].update(
                {"response.code": 200, "upstream.address": R2})
            _, routed, passed = await h.process(request_headers(), request_body(CHAT), answer)
            # No mode override: Envoy honours one only in a headers answer.
            assert not routed.HasField("mode_override")
            assert not passed.response_body.response.HasField("body_mutation")
            served, picked = h.gateway.router.recent(2)
            assert (picked["replica"], picked["outcome"]) == ("r0", "failed:envoy_retry")
            assert (served["replica"], served["outcome"]) == ("r2", "ok")
            assert served["reported_cached_tokens"] == 8
            # Envoy went past r0 and r1 to reach r2: both breakers count a failure.
            assert [b.breaker.consecutive_failures for b in h.gateway.pool.backends] == \
                [1, 1, 0]
    run(scenario())


def attributes_body(body: dict, **attributes: str) -> ext.ProcessingRequest:
    """The fast route's only request message: the body, the head as attributes."""
    message = request_body(body)
    message.attributes["envoy.filters.http.ext_proc"].update(attributes)
    return message


def test_a_whole_json_answer_ends_the_exchange_and_the_stream_before_its_end(monkeypatch):
    """A non-streamed answer parsed whole from its first message is booked there and the
    EPP closes the stream without answering it (Envoy then passes the body on as it is):
    neither that message nor Envoy's end-of-stream message that follows gets an answer.
    One in two halves ends at the second."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            usage = {"prompt_tokens": 9, "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": 4}}
            whole = orjson.dumps({"choices": [], "usage": usage})
            answer = response_body(whole)
            answer.attributes["envoy.filters.http.ext_proc"].update(
                {"response.code": 200, "upstream.address": R0})
            answers = await h.process(request_headers(), request_body(CHAT), answer,
                                      response_body(b"", end=True))
            assert len(answers) == 2  # headers, body: the answer's messages get none
            [decision] = h.gateway.router.recent(1)
            assert (decision["outcome"], decision["reported_cached_tokens"]) == ("ok", 4)
            assert h.gateway.admission.active == 0
            assert [b.in_flight for b in h.gateway.pool.backends] == [0, 0, 0]

            first = response_body(whole[:10])
            first.attributes["envoy.filters.http.ext_proc"].update(
                {"response.code": 200, "upstream.address": R0})
            answers = await h.process(request_headers(), request_body(CHAT), first,
                                      response_body(whole[10:]), response_body(b"", end=True))
            # The first half is answered and waited past; the second completes the object.
            assert len(answers) == 3
            [decision] = h.gateway.router.recent(1)
            assert (decision["outcome"], decision["reported_cached_tokens"]) == ("ok", 4)
    run(scenario())


def test_without_a_headers_message_the_head_comes_from_the_body_attributes(monkeypatch):
    """The bootstrap's fast route skips the request headers: path, method, API key and
    Envoy's request id arrive as attributes of the body message, and the endpoint goes
    back by metadata (Envoy applies no header change then)."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            head = {"request.path": "/v1/chat/completions", "request.method": "POST",
                    "request.headers['authorization']": "Bearer key-alice",
                    "request.headers['x-request-id']": "envoy-id-1"}
            [routed] = await h.process(attributes_body(CHAT, **head))
            common = routed.request_body.response
            assert orjson.loads(common.body_mutation.body)["cache_salt"] == \
                derive_trust_group_salt(SECRET.encode(), "g1")
            lb = routed.dynamic_metadata.fields["envoy.lb"].struct_value
            assert lb.fields[DESTINATION].string_value == f"{R0},{R1},{R2}"
            # Envoy applies no header change on this route (it drops content-length itself
            # as the body changed), so the answer carries none.
            assert not common.HasField("header_mutation")
            [decision] = h.gateway.router.recent(1)
            # Envoy's id leads; a random tail keeps it unique (a caller can set Envoy's).
            assert decision["request_id"].startswith("envoy-id-1.")
            # A wrong key is refused exactly as at the headers.
            [refused] = await h.process(attributes_body(
                CHAT, **{**head, "request.headers['authorization']": "Bearer nope"}))
            assert refused.immediate_response.status.code == 401
            assert h.gateway.open_requests == 0 and h.gateway.admission.active == 0
    run(scenario())


def test_a_streamed_body_is_answered_once_whole_headers_answer_first(monkeypatch):
    """FULL_DUPLEX_STREAMED: the headers answer waits for the last chunk; then the
    headers answer (endpoint, metadata) and the body's, as one streamed response."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            head = request_headers()
            head.protocol_config.request_body_mode = STREAMED_BODY
            raw = json.dumps(CHAT).encode()
            chunks = [ext.ProcessingRequest(request_body=ext.HttpBody(body=raw[:10])),
                      ext.ProcessingRequest(request_body=ext.HttpBody(body=raw[10:],
                                                                      end_of_stream=True))]
            headers_answer, body_answer = await h.process(head, *chunks)
            mutation = headers_answer.request_headers.response.header_mutation
            named = {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
            assert named[DESTINATION] == f"{R0},{R1},{R2}"
            assert "content-length" not in named
            lb = headers_answer.dynamic_metadata.fields["envoy.lb"].struct_value
            assert lb.fields[DESTINATION].string_value == named[DESTINATION]
            streamed = body_answer.request_body.response.body_mutation.streamed_response
            assert streamed.end_of_stream
            assert orjson.loads(streamed.body)["cache_salt"] == \
                derive_trust_group_salt(SECRET.encode(), "g1")
    run(scenario())


def test_a_streamed_body_past_the_limit_is_refused_before_its_end(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch, limits={"max_body_bytes": 1024})) as h:
            head = request_headers()
            head.protocol_config.request_body_mode = STREAMED_BODY
            chunk = ext.ProcessingRequest(request_body=ext.HttpBody(body=b"x" * 600))
            [refused] = await h.process(head, chunk, chunk)
            assert refused.immediate_response.status.code == 413
            assert h.gateway.open_requests == 0
    run(scenario())


def subset_hint(message: ext.ProcessingRequest, endpoints: list[str]) -> ext.ProcessingRequest:
    message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": endpoints})
    return message


def test_the_endpoint_subset_restricts_the_pick_and_its_fallbacks(monkeypatch):
    """least_loaded with all replicas idle picks r0; the gateway allows only r2 and r1."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            _, routed = await h.process(subset_hint(request_headers(), [R2, R1]),
                                        request_body(CHAT))
            assert set_headers(routed.request_body.response)[DESTINATION] == f"{R1},{R2}"
    run(scenario())


def test_an_endpoint_subset_naming_no_known_replica_gets_503(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            for allowed in (["10.9.9.9:8000"], []):
                _, refused = await h.process(subset_hint(request_headers(), allowed),
                                             request_body(CHAT))
                assert refused.immediate_response.status.code == 503
                assert orjson.loads(refused.immediate_response.body)["error"]["code"] == \
                    "replicas_unavailable"
            assert h.gateway.admission.active == 0 and h.gateway.open_requests == 0
    run(scenario())


def test_discovered_replicas_are_named_by_address_and_a_host_name_never(monkeypatch, tmp_path):
    """A membership file adds a replica listed by host name (Envoy routes by address, so
    the EPP cannot name it) and one by IP: least_loaded's first choice, the named one, is
    passed over for the addressed one, which the static list never had."""
    members = tmp_path / "members.yaml"
    members.write_text("- {name: by-name, url: 'http://replica-b.internal:8000', models: [tiny]}\n"
                       "- {name: by-ip, url: 'http://10.0.0.9:8000', models: [tiny]}\n")
    config = make_config(monkeypatch, backends=[], discovery={"file": str(members)})

    async def scenario():
        async with Harness(config, EppSettings(fallback_endpoints=2)) as h:
            assert [b.name for b in h.gateway.pool.backends] == ["by-name", "by-ip"]
            _, routed = await h.process(request_headers(), request_body(CHAT))
            assert set_headers(routed.request_body.response)[DESTINATION] == "10.0.0.9:8000"
    run(scenario())


def test_a_request_that_waits_for_nothing_is_answered_in_the_call_that_brought_it(
        monkeypatch):
    """No task and no turn of the event loop between Envoy's message and the EPP's answer:
    the answer is there when the transport's callback returns, so it leaves in the write of
    the read that brought the message."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            sink = _Collected()
            run_ = ExchangeRun(h.picker, sink)
            await from_callback(run_.take, request_headers())
            await from_callback(run_.take, request_body(CHAT))
            assert run_.task is None
            assert [a.WhichOneof("response") for a in sink.answers] == [
                "request_headers", "request_body"]
            assert set_headers(sink.answers[1].request_body.response)[DESTINATION]
            run_.reset()
    run(scenario())


@needs_redis
def test_a_fleet_rate_limit_asked_of_redis_on_the_requests_path(monkeypatch, tmp_path):
    """Started in the read's callback, outside any task: a tenant's first request under a
    fleet limit (in Redis, a burst of one) asks Redis on its path, in a task, and is routed;
    the next (the harness's clock stands still, so nothing refills) gets the 429."""
    async def scenario(url):
        config = make_config(monkeypatch, shared_state={"redis": url, "namespace": "eager"},
                             tenants=[{"name": "alice", "api_key_sha256":
                                       hash_api_key("key-alice"),
                                       "rate_limit": {"requests_per_second": 100,
                                                      "burst": 1}}])
        async with Harness(config) as h:
            shared = h.gateway.shared
            for _ in range(200):
                if shared.link.usable():
                    break
                await asyncio.sleep(0.05)
            assert shared.link.usable()
            answers = []
            for _ in range(2):
                sink = _Collected()
                run_ = ExchangeRun(h.picker, sink)
                await from_callback(run_.take, request_headers())
                await run_.settled()
                await from_callback(run_.take, request_body(CHAT))
                await run_.settled()
                assert sink.status is None, sink.status
                answers.append(sink.answers)
                run_.reset()
            assert shared.limiter.counts["path"] == 1
            routed, refused = answers
            assert set_headers(routed[-1].request_body.response)[DESTINATION]
            assert refused[0].immediate_response.status.code == 429

    with RedisServer(tmp_path) as redis:
        run(scenario(redis.url))


def test_a_backend_render_is_called_inside_a_task(monkeypatch):
    """With ``tokenization: backend`` the render call (under ``asyncio.timeout``, which needs
    a task) goes on in a task; these replicas cannot render, so the request is routed on the
    local fallback."""
    async def scenario():
        async with Harness(make_config(monkeypatch, tokenization="backend")) as h:
            sink = _Collected()
            run_ = ExchangeRun(h.picker, sink)
            await from_callback(run_.take, request_headers())
            await from_callback(run_.take, request_body(CHAT))
            await run_.settled()
            assert sink.status is None, sink.status
            assert set_headers(sink.answers[-1].request_body.response)[DESTINATION]
            assert h.gateway.metrics.registry.get_sample_value(
                "prefixroute_gateway_tokenize_fallbacks_total") == 1
            run_.reset()
    run(scenario())


def test_a_stream_cut_while_its_request_waits_for_a_slot_leaks_neither_slot_nor_booking(
        monkeypatch):
    """Envoy resets a stream whose request waits in the admission queue, at each point of
    the slot's hand-over (the slot may be granted just as the wait is cancelled): once the
    exchange's task has ended, no slot is held, no request counted open, no replica booked."""
    async def scenario():
        config = make_config(monkeypatch, limits={"max_concurrent": 1, "max_queued": 4})
        async with Harness(config) as h:
            for turns in range(6):
                holder = ExchangeRun(h.picker, _Collected())
                holder.take(request_headers())
                await holder.settled()
                holder.take(request_body(CHAT))
                await holder.settled()
                assert h.gateway.admission.active == 1
                waiter = ExchangeRun(h.picker, _Collected())
                await from_callback(waiter.take, request_headers())
                await waiter.settled()
                await from_callback(waiter.take, request_body(CHAT))
                assert h.gateway.admission.waiting == 1
                holder.take(response_headers(200, served=R0))
                holder.take(response_body(b"", end=True))  # the slot goes to the waiter
                for _ in range(turns):
                    await asyncio.sleep(0)
                waiter.reset()
                await waiter.settled()
                holder.reset()
                assert h.gateway.admission.active == 0, turns
                assert h.gateway.open_requests == 0, turns
                assert [b.in_flight for b in h.gateway.pool.backends] == [0, 0, 0], turns
    run(scenario())


def test_a_stream_cut_in_the_read_that_brought_its_request_takes_no_slot(monkeypatch):
    """The request reaches the full admission queue inside the read, and Envoy's reset
    comes in that same read, before the request's task took a step: the wait is cancelled,
    the slot freed later goes to nobody, and the queue counts stay right."""
    async def scenario():
        config = make_config(monkeypatch, limits={"max_concurrent": 1, "max_queued": 4})
        async with Harness(config) as h:
            holder = ExchangeRun(h.picker, _Collected())
            await from_callback(holder.take, request_headers())
            await from_callback(holder.take, request_body(CHAT))
            assert holder.task is None and h.gateway.admission.active == 1
            waiter = ExchangeRun(h.picker, _Collected())
            await from_callback(waiter.take, request_headers())
            await from_callback(waiter.take, request_body(CHAT),
                                then=lambda _: waiter.reset())
            await waiter.settled()
            assert h.gateway.admission.waiting == 0 and h.gateway.open_requests == 1
            holder.take(response_headers(200, served=R0))
            holder.take(response_body(b"", end=True))
            holder.reset()
            assert h.gateway.admission.active == 0 and h.gateway.open_requests == 0
            assert [b.in_flight for b in h.gateway.pool.backends] == [0, 0, 0]
            # One slot, free: a new request takes it at once, and a second waits.
            first, second = ExchangeRun(h.picker, _Collected()), ExchangeRun(h.picker,
                                                                              _Collected())
            for each in (first, second):
                await from_callback(each.take, request_headers())
                await from_callback(each.take, request_body(CHAT))
            assert first.task is None and second.task is not None
            assert h.gateway.admission.active == 1 and h.gateway.admission.waiting == 1
            first.reset()
            second.reset()
            await second.settled()
            assert h.gateway.admission.active == 0 and h.gateway.admission.waiting == 0
            assert h.gateway.open_requests == 0
    run(scenario())


# -- answers by access log ---------------------------------------------------------------
# A data plane that logs answers to the EPP (``prefixroute envoy-config`` with one EPP) says
# so in its ext_proc stream's initial metadata; the EPP then closes a non-streamed request's
# stream once routed and learns its end from Envoy's access log entry.

BY_ACCESS_LOG = [(b"x-prefixroute-answers", b"access-log")]


def log_entry(tag: str | None, status: int = 200, served: str | None = R0,
              request_id: str = "", flags: tuple[str, ...] = (), **usage: int):
    """An entry as Envoy's gRPC access log writes it (``tag`` ``None``: untagged)."""
    from envoy.data.accesslog.v3 import accesslog_pb2

    entry = accesslog_pb2.HTTPAccessLogEntry()
    if tag is not None:
        ours = entry.common_properties.metadata.filter_metadata["prefixroute"]
        ours.update({"exchange": tag, **usage})  # Envoy's json_to_metadata writes numbers
    if status:
        entry.response.response_code.value = status
    if served:
        host, port = served.rsplit(":", 1)
        address = entry.common_properties.upstream_remote_address.socket_address
        address.address, address.port_value = host.strip("[]"), int(port)
    entry.request.request_id = request_id
    for flag in flags:
        setattr(entry.common_properties.response_flags, flag, True)
    return entry


def access_log(*entries) -> bytes:
    from envoy.service.accesslog.v3 import als_pb2

    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(entries)
    return message.SerializeToString()


class Recorded(_Collected):
    """A sink that also notes which answers left in one write with the close."""

    def __init__(self) -> None:
        super().__init__()
        self.closed_with: list[ext.ProcessingResponse] | None = None

    def send_and_close(self, payloads: list[bytes]) -> None:
        self.closed_with = [ext.ProcessingResponse.FromString(p) for p in payloads]
        super().send_and_close(payloads)


async def routed_by_access_log(h: Harness, body: dict, envoy_id: str = "envoy-id-1"
                               ) -> tuple[ExchangeRun, Recorded, str | None]:
    """One request on the fast route (no headers message: its head, with Envoy's request
    id, as attributes of the body) through a stream that declares the access log: its run,
    its sink, and the tag its routing answer carries (``None``: none)."""
    sink = Recorded()
    run_ = h.picker.open(sink, "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                         BY_ACCESS_LOG)
    message = request_body(body)
    message.attributes["envoy.filters.http.ext_proc"].update({
        "request.path": "/v1/chat/completions", "request.method": "POST",
        "request.headers['authorization']": "Bearer key-alice",
        "request.headers['x-request-id']": envoy_id})
    await from_callback(run_.message, message.SerializeToString())
    await run_.settled()
    routed = sink.answers[-1]
    ours = routed.dynamic_metadata.fields.get("prefixroute")
    return run_, sink, ours.struct_value.fields["exchange"].string_value if ours else None


def test_by_access_log_the_routed_stream_closes_and_the_log_entry_ends_the_request(
        monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            _, sink, tag = await routed_by_access_log(h, CHAT)
            # The routing answer and the close left together: Envoy needs the EPP no more.
            assert sink.status == 0 and [a.WhichOneof("response") for a in
                                         sink.closed_with] == ["request_body"]
            assert tag
            # The request still runs: slot held, replica booked, nothing decided yet.
            assert h.gateway.admission.active == 1 and h.gateway.open_requests == 1
            assert [b.in_flight for b in h.gateway.pool.backends] == [1, 0, 0]
            logs = h.picker.open(_Collected(), ACCESS_LOG_METHOD, [])
            logs.message(access_log(log_entry("not-ours"),
                                    log_entry(tag, prompt_tokens=9, completion_tokens=1,
                                              cached_tokens=8)))
            [decision] = h.gateway.router.recent(1)
            assert decision["outcome"] == "ok" and decision["reported_cached_tokens"] == 8
            assert h.gateway.admission.active == 0 and h.gateway.open_requests == 0
            assert [b.in_flight for b in h.gateway.pool.backends] == [0, 0, 0]
            assert h.picker.handed_off == {}
    run(scenario())


def test_by_access_log_a_streamed_answer_stays_on_its_stream(monkeypatch):
    """The usage chunk the caller did not ask for is cut from a streamed answer, which
    takes an answer to each message: that stream stays open, untagged."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            stream, sink, tag = await routed_by_access_log(h, {**CHAT, "stream": True})
            assert tag is None and sink.status is None and sink.closed_with is None
            assert h.picker.handed_off == {} and h.gateway.open_requests == 1
            stream.reset()  # the caller left
            await stream.settled()
            assert h.gateway.open_requests == 0
    run(scenario())


def test_a_log_entry_with_no_status_ends_the_request_abandoned_and_a_fallback_is_booked(
        monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            *_, left = await routed_by_access_log(h, CHAT, "id-left")
            *_, retried = await routed_by_access_log(h, CHAT, "id-retried")
            logs = h.picker.open(_Collected(), ACCESS_LOG_METHOD, [])
            # The caller left before any answer (r0); the other, routed to r1 (least loaded),
            # failed there and Envoy's retry went to the first fallback, r2.
            logs.message(access_log(log_entry(left, status=0, served=None),
                                    log_entry(retried, served=R2, cached_tokens=0)))
            outcomes = [(d["replica"], d["outcome"]) for d in h.gateway.router.recent(4)]
            assert sorted(outcomes) == [("r0", "abandoned"), ("r1", "failed:envoy_retry"),
                                        ("r2", "ok")]
            assert h.gateway.admission.active == 0 and h.gateway.open_requests == 0
    run(scenario())


def test_a_request_whose_log_entry_never_comes_ends_abandoned_after_the_wait(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            # The wait is the route's timeout plus a grace; shortened here.
            assert h.picker.log_wait_s == h.gateway.config.timeouts.read_s + 30
            h.picker.log_wait_s = 0.05
            await routed_by_access_log(h, CHAT)
            assert h.gateway.admission.active == 1
            await asyncio.sleep(0.2)
            [decision] = h.gateway.router.recent(1)
            assert decision["outcome"] == "abandoned"
            assert h.gateway.admission.active == 0 and h.picker.handed_off == {}
    run(scenario())


def test_a_request_whose_caller_left_as_it_was_routed_ends_by_its_request_id(monkeypatch):
    """The caller left just as the routing answer went out: Envoy never applied the tag,
    and logs the request untagged (for its caller leaving); the EPP finds it by the
    request id Envoy logs, and the slot goes back at once."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            *_, tag = await routed_by_access_log(h, CHAT, "envoy-7")
            logs = h.picker.open(_Collected(), ACCESS_LOG_METHOD, [])
            logs.message(access_log(log_entry(None, status=0, served=None,
                                              request_id="somebody-else",
                                              flags=("downstream_connection_termination",))))
            assert h.gateway.admission.active == 1  # not this one's id
            logs.message(access_log(log_entry(None, status=0, served=None,
                                              request_id="envoy-7",
                                              flags=("downstream_connection_termination",))))
            [decision] = h.gateway.router.recent(1)
            assert decision["outcome"] == "abandoned"
            assert h.gateway.admission.active == 0
            assert h.picker.handed_off == {} and h.picker.tags_by_id == {}
    run(scenario())


def test_an_answer_cut_short_after_its_status_ends_abandoned_not_ok(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            *_, tag = await routed_by_access_log(h, CHAT)
            logs = h.picker.open(_Collected(), ACCESS_LOG_METHOD, [])
            logs.message(access_log(log_entry(tag, flags=("upstream_remote_reset",))))
            [decision] = h.gateway.router.recent(1)
            assert decision["outcome"] == "abandoned"
            assert h.gateway.pool.backends[0].in_flight == 0
    run(scenario())


def test_an_ipv6_replica_that_served_as_a_fallback_is_booked(monkeypatch):
    v6 = ["[fd00::1]:8000", "[fd00::2]:8000"]
    config = make_config(monkeypatch, backends=[
        {"name": f"r{i}", "url": f"http://{e}", "models": ["tiny"]} for i, e in enumerate(v6)])

    async def scenario():
        async with Harness(config) as h:
            *_, tag = await routed_by_access_log(h, CHAT)
            logs = h.picker.open(_Collected(), ACCESS_LOG_METHOD, [])
            logs.message(access_log(log_entry(tag, served=v6[1], cached_tokens=3)))
            served, picked = h.gateway.router.recent(2)
            assert (picked["replica"], picked["outcome"]) == ("r0", "failed:envoy_retry")
            assert (served["replica"], served["outcome"]) == ("r1", "ok")
            assert served["reported_cached_tokens"] == 3
    run(scenario())


def test_at_shutdown_requests_waiting_for_their_entry_end_and_log_streams_close(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            await routed_by_access_log(h, CHAT)
            log_sink = _Collected()
            h.picker.open(log_sink, ACCESS_LOG_METHOD, [])
            h.picker.shutdown()
            assert h.gateway.admission.active == 0 and h.picker.handed_off == {}
            assert log_sink.status == 0 and h.picker.logs == set()
            assert h.picker.open_ids == {} and h.picker.tags_by_id == {}
    run(scenario())


def test_instances_sharing_state_keep_answers_on_each_requests_stream(monkeypatch):
    """Several EPP processes (shared state) may sit behind one address: an access log
    entry could reach another than the one that routed the request."""
    config = make_config(monkeypatch, shared_state={"redis": "redis://127.0.0.1:1"})

    async def scenario():
        h = Harness(config)  # (not started: no Redis here; opening a stream needs none)
        run_ = h.picker.open(Recorded(), "/envoy.service.ext_proc.v3.ExternalProcessor/"
                             "Process", BY_ACCESS_LOG)
        assert run_.exchange.by_access_log is False
    run(scenario())


def test_on_the_full_route_a_caller_leaving_is_found_by_envoys_own_request_id(monkeypatch):
    """With a headers message, the routing answer also sets the EPP's own request id; an
    answer Envoy dropped set nothing, so Envoy logs the id the request came with."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            run_ = h.picker.open(Recorded(), "/envoy.service.ext_proc.v3.ExternalProcessor/"
                                 "Process", BY_ACCESS_LOG)
            for message in (request_headers(x_request_id="envoy-9"), request_body(CHAT)):
                run_.message(message.SerializeToString())
                await run_.settled()
            assert h.gateway.admission.active == 1
            logs = h.picker.open(_Collected(), ACCESS_LOG_METHOD, [])
            logs.message(access_log(log_entry(None, status=0, served=None,
                                              request_id="envoy-9",
                                              flags=("downstream_connection_termination",))))
            assert h.gateway.router.recent(1)[0]["outcome"] == "abandoned"
            assert h.gateway.admission.active == 0 and h.picker.open_ids == {}
    run(scenario())


def test_a_request_id_two_open_requests_share_finds_neither(monkeypatch):
    """A caller may reuse a request id: the entry of one request that left must not end
    another with the same id, so such an id finds no request (its tag still does)."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            stream, _, none = await routed_by_access_log(h, {**CHAT, "stream": True}, "dup")
            *_, tag = await routed_by_access_log(h, CHAT, "dup")
            assert none is None and h.picker.tags_by_id == {"dup": None}
            logs = h.picker.open(_Collected(), ACCESS_LOG_METHOD, [])
            logs.message(access_log(log_entry(None, status=0, served=None, request_id="dup",
                                              flags=("downstream_connection_termination",))))
            assert tag in h.picker.handed_off  # still waiting for its own entry
            logs.message(access_log(log_entry(tag, served=R1, cached_tokens=1)))
            stream.reset()
            await stream.settled()
            assert sorted(d["outcome"] for d in h.gateway.router.recent(2)) == \
                ["abandoned", "ok"]
            assert h.picker.open_ids == {} and h.picker.tags_by_id == {}
    run(scenario())


def test_envoys_own_503_after_the_replica_failed_fails_the_request(monkeypatch):
    """Retries spent on resets, Envoy answers 503 itself (flag: upstream reset): the
    request failed on its replica, as on its own stream, rather than being abandoned."""
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            *_, tag = await routed_by_access_log(h, CHAT)
            logs = h.picker.open(_Collected(), ACCESS_LOG_METHOD, [])
            logs.message(access_log(log_entry(tag, status=503, served=None,
                                              flags=("upstream_remote_reset",))))
            assert h.gateway.router.recent(1)[0]["outcome"] == "failed:http_503"
    run(scenario())
