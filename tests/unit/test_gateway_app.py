"""The gateway app in one process: the official ``openai`` client through an ASGI transport,
replicas faked behind ``httpx.MockTransport``. Real sockets and emulator replicas are in
``tests/integration/test_gateway_*.py``."""

import asyncio
import json

import httpx
import openai
import pytest

from prefixroute.core.clock import ManualClock
from prefixroute.core.identity.identity import derive_trust_group_salt
from prefixroute.edges.gateway.app import Gateway
from prefixroute.edges.gateway.config import hash_api_key, parse_config

SECRET = "q" * 64
BLOCK = 4


class FakeReplica:
    """Enough of a vLLM replica: completions and chat, streaming, ``cached_tokens`` by
    remembering (salt, prompt) pairs, and switchable faults."""

    def __init__(self, name):
        self.name = name
        self.bodies = []
        self.seen = set()
        self.fault = None  # None, "connect", "500", "400"

    def cached(self, salt, prompt, n):
        key = (salt, json.dumps(prompt))
        hit = key in self.seen
        self.seen.add(key)
        return (n - 1) // BLOCK * BLOCK if hit else 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.fault == "connect":
            raise httpx.ConnectError("refused", request=request)
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_waiting 0\n"
                                  "vllm:num_requests_running 0\n"
                                  "vllm:kv_cache_usage_perc 0.25\n")
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "tiny", "object": "model"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fault == "hang":
            await asyncio.sleep(3600)
        if self.fault == "500":
            return httpx.Response(500, json={"error": {"message": "boom", "type": "x"}})
        if self.fault == "400":
            return httpx.Response(400, json={"error": {"message": "too long", "type": "x",
                                                       "param": None, "code": 400}})
        prompt = body.get("messages") or body.get("prompt")
        n = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], int) else \
            len(json.dumps(prompt)) // 4
        cached = self.cached(body.get("cache_salt"), prompt, n)
        usage = {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        chat = path.endswith("chat/completions")
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=self._stream(chat, usage, body))
        choice = ({"index": 0, "message": {"role": "assistant", "content": "ok ok"},
                   "finish_reason": "stop"} if chat else
                  {"index": 0, "text": "ok ok", "finish_reason": "stop"})
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion" if chat else "text_completion",
            "created": 0, "model": body["model"], "choices": [choice], "usage": usage})

    async def _stream(self, chat, usage, body):
        kind = "chat.completion.chunk" if chat else "text_completion"
        for word in ("ok", " ok"):
            choice = ({"index": 0, "delta": {"content": word}, "finish_reason": None} if chat
                      else {"index": 0, "text": word, "finish_reason": None})
            chunk = {"id": "x", "object": kind, "created": 0, "model": body["model"],
                     "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if self.fault == "stall_stream":  # one event, then nothing until cut
                await asyncio.sleep(3600)
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"id": "x", "object": kind, "created": 0, "model": body["model"],
                     "choices": [], "usage": usage}
            yield f"data: {json.dumps(final)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def make_config(monkeypatch, **extra):
    monkeypatch.setenv("PR_GATEWAY_TEST_SECRET", SECRET)
    data = {
        "server_secret": {"env": "PR_GATEWAY_TEST_SECRET"},
        "backends": [{"name": "r0", "url": "http://r0.test", "models": ["tiny"]},
                     {"name": "r1", "url": "http://r1.test", "models": ["tiny"]}],
        "tenants": [
            {"name": "alice", "api_key_sha256": hash_api_key("key-alice"),
             "trust_group": "g1"},
            {"name": "bob", "api_key_sha256": hash_api_key("key-bob"), "trust_group": "g2"},
            {"name": "ops", "api_key_sha256": hash_api_key("key-ops"), "admin": True},
        ],
        "hashing": {"block_size": BLOCK},
        "policy": "hybrid:max_skew=4",
        "health": {"interval_s": 60, "metrics_interval_s": 60},
    }
    data.update(extra)
    return parse_config(data, "test.yaml")


class Harness:
    """A started gateway with two fake replicas, and clients for it."""

    def __init__(self, config, clock=None, wall_clock=None):
        self.replicas = {"r0.test": FakeReplica("r0"), "r1.test": FakeReplica("r1")}

        async def route(request):
            return await self.replicas[request.url.host].handle(request)

        self.gateway = Gateway(config, transport=httpx.MockTransport(route),
                               clock=clock or ManualClock(),
                               wall_clock=wall_clock or (lambda: 1_700_000_000.0))
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.gateway.app),
                                      base_url="http://gateway")

    def openai(self, key="key-alice", **kwargs):
        return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key,
                                  http_client=self.http, max_retries=0, **kwargs)

    def r(self, name):
        return self.replicas[f"{name}.test"]

    async def __aenter__(self):
        await self.gateway.start()
        return self

    async def __aexit__(self, *exc):
        await self.http.aclose()
        await self.gateway.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def config(monkeypatch):
    return make_config(monkeypatch)


# -- authentication and errors ---------------------------------------------------------------

def test_unknown_key_gets_401_authentication_error(config):
    async def scenario():
        async with Harness(config) as h:
            with pytest.raises(openai.AuthenticationError) as info:
                await h.openai("wrong").completions.create(model="tiny", prompt="hi")
            assert info.value.status_code == 401
            assert info.value.body["code"] == "invalid_api_key"
            assert set(info.value.body) == {"message", "type", "param", "code"}
    run(scenario())


def test_missing_key_gets_401(config):
    async def scenario():
        async with Harness(config) as h:
            response = await h.http.post("/v1/completions", json={"model": "tiny",
                                                                   "prompt": "x"})
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "missing_api_key"
            assert not h.r("r0").bodies and not h.r("r1").bodies
    run(scenario())


def test_caller_cache_salt_is_rejected_with_400(config):
    async def scenario():
        async with Harness(config) as h:
            with pytest.raises(openai.BadRequestError) as info:
                await h.openai().completions.create(model="tiny", prompt="hi",
                                                    extra_body={"cache_salt": "mine"})
            assert info.value.body["param"] == "cache_salt"
    run(scenario())


def test_unknown_model_is_404(config):
    async def scenario():
        async with Harness(config) as h:
            with pytest.raises(openai.NotFoundError) as info:
                await h.openai().completions.create(model="gpt-9", prompt="hi")
            assert info.value.body["code"] == "model_not_found"
    run(scenario())


def test_oversized_body_is_413(monkeypatch):
    config = make_config(monkeypatch, limits={"max_body_bytes": 2048})

    async def scenario():
        async with Harness(config) as h:
            response = await h.http.post("/v1/completions", json={
                "model": "tiny", "prompt": "x" * 5000},
                headers={"authorization": "Bearer key-alice"})
            assert response.status_code == 413
            assert response.json()["error"]["code"] == "body_too_large"
    run(scenario())


def test_malformed_json_is_400(config):
    async def scenario():
        async with Harness(config) as h:
            response = await h.http.post("/v1/chat/completions", content=b"{nope",
                                         headers={"authorization": "Bearer key-alice"})
            assert response.status_code == 400
            assert response.json()["error"]["type"] == "invalid_request_error"
    run(scenario())


def _chat_body(extra: bytes) -> bytes:
    return b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]' + extra + b"}"


@pytest.mark.parametrize("depth, code", [
    (126, None),  # with the body object and "x" itself: 127 levels, under the limit of 128
    (1_000, "json_too_deep"),  # orjson reads it; the limit refuses it
    (1_023, "json_too_deep"),
    (100_000, "json_too_deep"),  # orjson refuses it; so would the standard library
])
def test_deeply_nested_json_is_a_400_naming_the_depth(config, depth, code):
    raw = _chat_body(b', "x": ' + b"[" * depth + b"]" * depth)

    async def scenario():
        async with Harness(config) as h:
            response = await h.http.post("/v1/chat/completions", content=raw,
                                         headers={"authorization": "Bearer key-alice"})
            if code is None:
                assert response.status_code == 200
                return
            assert response.status_code == 400
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", code)
            assert "128 levels" in error["message"]
    run(scenario())


@pytest.mark.parametrize("extra, code, words", [
    (b', "max_tokens": ' + b"9" * 5_000, "number_too_large", "too large"),
    (b', "user": "a\\ud800b"', "invalid_unicode", "surrogate"),
], ids=["huge_integer", "lone_surrogate"])
def test_a_body_that_cannot_be_sent_on_is_a_400_naming_the_problem(config, extra, code,
                                                                    words):
    async def scenario():
        async with Harness(config) as h:
            response = await h.http.post("/v1/chat/completions", content=_chat_body(extra),
                                         headers={"authorization": "Bearer key-alice"})
            assert response.status_code == 400
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", code)
            assert words in error["message"]
            assert not h.r("r0").bodies and not h.r("r1").bodies
    run(scenario())


def test_a_lone_surrogate_in_the_content_is_a_400(config):
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'

    async def scenario():
        async with Harness(config) as h:
            response = await h.http.post("/v1/chat/completions", content=raw,
                                         headers={"authorization": "Bearer key-alice"})
            assert response.status_code == 400
            assert response.json()["error"]["code"] == "invalid_unicode"
    run(scenario())


def test_unknown_path_is_an_openai_style_404(config):
    async def scenario():
        async with Harness(config) as h:
            response = await h.http.get("/v1/nothing")
            assert response.status_code == 404 and "error" in response.json()
    run(scenario())


def test_rate_limited_tenant_gets_429(monkeypatch):
    config = make_config(monkeypatch)
    tenants = [{"name": "alice", "api_key_sha256": hash_api_key("key-alice"),
                "rate_limit": {"requests_per_second": 1, "burst": 2}}]
    config = make_config(monkeypatch, tenants=tenants)

    async def scenario():
        async with Harness(config) as h:
            client = h.openai()
            await client.completions.create(model="tiny", prompt="a")
            await client.completions.create(model="tiny", prompt="b")
            with pytest.raises(openai.RateLimitError) as info:
                await client.completions.create(model="tiny", prompt="c")
            assert info.value.response.headers["retry-after"] == "1"
    run(scenario())


def test_a_tenant_over_its_prompt_token_limit_gets_429(monkeypatch):
    tenants = [{"name": "alice", "api_key_sha256": hash_api_key("key-alice"),
                "rate_limit": {"prompt_tokens_per_second": 1, "prompt_tokens_burst": 10}}]
    config = make_config(monkeypatch, tenants=tenants)

    async def scenario():
        async with Harness(config) as h:
            client = h.openai()
            await client.completions.create(model="tiny", prompt=[1, 2, 3, 4, 5, 6], max_tokens=1)
            with pytest.raises(openai.RateLimitError) as info:  # 6 + 6 > a burst of 10
                await client.completions.create(model="tiny", prompt=[7, 8, 9, 10, 11, 12],
                                                max_tokens=1)
            assert info.value.response.headers["retry-after"] == "2"  # 2 tokens at 1 a second
            assert "prompt tokens per second" in info.value.message
            await client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=1)
    run(scenario())


# -- salting and routing ---------------------------------------------------------------------

def test_replica_receives_the_trust_groups_secret_salt(config):
    async def scenario():
        async with Harness(config) as h:
            await h.openai().completions.create(model="tiny", prompt="hello")
            body = (h.r("r0").bodies + h.r("r1").bodies)[0]
            assert body["cache_salt"] == derive_trust_group_salt(SECRET.encode(), "g1")
    run(scenario())


def test_repeat_hits_cache_for_the_same_tenant_and_not_for_another(config):
    async def scenario():
        async with Harness(config) as h:
            prompt = list(range(1, 41))
            alice, bob = h.openai(), h.openai("key-bob")
            first = await alice.completions.create(model="tiny", prompt=prompt)
            again = await alice.completions.create(model="tiny", prompt=prompt)
            other = await bob.completions.create(model="tiny", prompt=prompt)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert again.usage.prompt_tokens_details.cached_tokens == 36  # (40-1)//4*4
            assert other.usage.prompt_tokens_details.cached_tokens == 0
    run(scenario())


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(config):
    async def scenario():
        async with Harness(config) as h:
            client = h.openai()
            prefix = list(range(100, 164))
            await client.completions.create(model="tiny", prompt=prefix + [1, 2, 3])
            holder = "r0" if h.r("r0").bodies else "r1"
            for tail in range(5):
                await client.completions.create(model="tiny", prompt=prefix + [tail] * 9)
            # hybrid, max_skew 4: the holder wins while its assignments before routing are at
            # most 0 + 4, i.e. four more times; the fifth repeat goes to the idle replica.
            assert len(h.r(holder).bodies) == 5
            decisions = h.gateway.router.recent(6)
            assert [d["branch"] for d in reversed(decisions[:5])] == ["affinity"] * 4 + [
                "skew_cap"]
            assert decisions[1]["predicted_cached_tokens"] == 64
    run(scenario())


def test_reported_cached_tokens_reach_the_policy_and_metrics(config):
    async def scenario():
        async with Harness(config) as h:
            completed = []
            h.gateway.router.policy.on_completed = \
                lambda request, replica, cached: completed.append((replica, cached))
            client = h.openai()
            for _ in range(2):
                await client.completions.create(model="tiny", prompt=list(range(1, 21)))
            assert [c for _, c in completed] == [0, 16]
            text = (await h.http.get("/metrics")).text
            assert "prefixroute_gateway_reported_cached_tokens_total" in text
            assert 'prefixroute_gateway_requests_total{endpoint="completions",status="200"} 2.0' \
                in text
    run(scenario())


# -- streaming -------------------------------------------------------------------------------

def test_chat_stream_passes_through_and_hides_the_usage_chunk(config):
    async def scenario():
        async with Harness(config) as h:
            stream = await h.openai().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
            chunks = [chunk async for chunk in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ok ok"
            assert all(c.usage is None for c in chunks)
            record = h.gateway.router.decisions[-1]
            assert record.outcome == "ok" and record.reported_cached_tokens == 0
    run(scenario())


def test_stream_keeps_the_usage_chunk_when_the_caller_asks(config):
    async def scenario():
        async with Harness(config) as h:
            stream = await h.openai().completions.create(
                model="tiny", prompt="hello", stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    run(scenario())


# -- faults ----------------------------------------------------------------------------------

def test_connect_error_is_retried_on_the_other_replica(config):
    async def scenario():
        async with Harness(config) as h:
            h.r("r0").fault = "connect"
            h.r("r1").fault = None
            for i in range(4):
                result = await h.openai().completions.create(model="tiny", prompt=f"p{i}")
                assert result.choices[0].text == "ok ok"
            assert len(h.r("r1").bodies) == 4
    run(scenario())


def test_5xx_is_retried_and_then_the_breaker_opens(monkeypatch):
    config = make_config(monkeypatch, circuit_breaker={"failure_threshold": 2, "open_s": 30})

    async def scenario():
        async with Harness(config) as h:
            h.r("r0").fault = "500"
            for i in range(6):
                await h.openai().completions.create(model="tiny", prompt=f"q{i}")
            assert len(h.r("r0").bodies) <= 2  # opened after two failures
            assert h.gateway.pool.backends[0].breaker.state == "open"
            text = (await h.http.get("/metrics")).text
            assert 'prefixroute_gateway_replica_breaker_state{replica="r0"} 2.0' in text
    run(scenario())


def test_4xx_from_a_replica_is_passed_on_without_retry(config):
    async def scenario():
        async with Harness(config) as h:
            h.r("r0").fault = h.r("r1").fault = "400"
            with pytest.raises(openai.BadRequestError):
                await h.openai().completions.create(model="tiny", prompt="x")
            assert len(h.r("r0").bodies) + len(h.r("r1").bodies) == 1
    run(scenario())


def test_a_refused_prompt_is_not_expected_cached_by_the_default_policy(monkeypatch):
    # The replica answers 400: it never ran the prompt, so prefixroute must not expect its
    # blocks there next time (the approximate view forgets them; so does the policy).
    async def scenario():
        async with Harness(make_config(monkeypatch, policy="prefixroute")) as h:
            h.r("r0").fault = h.r("r1").fault = "400"
            prompt = list(range(1, 41))
            with pytest.raises(openai.BadRequestError):
                await h.openai().completions.create(model="tiny", prompt=prompt)
            refused = h.gateway.router.decisions[-1]
            h.r("r0").fault = h.r("r1").fault = None
            await h.openai().completions.create(model="tiny", prompt=prompt)
            index = next(b.index for b in h.gateway.pool.backends if b.name == refused.replica)
            assert h.gateway.router.decisions[-1].scores[index]["expected_cached_tokens"] == 0
    run(scenario())


def test_a_replica_back_from_the_dead_is_expected_to_hold_nothing(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch, policy="prefixroute")) as h:
            prompt = list(range(1, 41))  # 10 blocks of 4; 9 can hit (the last token is new)
            await h.openai().completions.create(model="tiny", prompt=prompt)
            backend = next(b for b in h.gateway.pool.backends if b.assignments)
            await h.openai().completions.create(model="tiny", prompt=prompt)
            scores = h.gateway.router.decisions[-1].scores
            assert scores[backend.index]["expected_cached_tokens"] == 36
            h.r(backend.name).fault = "connect"
            for _ in range(2):  # unhealthy_after: 2 failed checks (a restart, most likely)
                await backend.check_health(h.gateway.client, 1.0)
            h.r(backend.name).fault = None
            await backend.check_health(h.gateway.client, 1.0)
            assert backend.healthy
            await h.openai().completions.create(model="tiny", prompt=prompt)
            scores = h.gateway.router.decisions[-1].scores
            assert scores[backend.index]["expected_cached_tokens"] == 0
    run(scenario())


def test_all_replicas_down_is_a_clear_503(config):
    async def scenario():
        async with Harness(config) as h:
            h.r("r0").fault = h.r("r1").fault = "connect"
            response = await h.http.post("/v1/completions", json={"model": "tiny",
                                                                   "prompt": "x"},
                                         headers={"authorization": "Bearer key-alice"})
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "replicas_unavailable" and "r0" in error["message"]
    run(scenario())


# -- other endpoints -------------------------------------------------------------------------

def test_models_is_the_union_of_backends(monkeypatch):
    config = make_config(monkeypatch, backends=[
        {"name": "r0", "url": "http://r0.test", "models": ["tiny", "big"]},
        {"name": "r1", "url": "http://r1.test"}])  # discovered: tiny

    async def scenario():
        async with Harness(config) as h:
            models = await h.openai().models.list()
            assert sorted(m.id for m in models.data) == ["big", "tiny"]
    run(scenario())


def test_debug_decisions_shows_own_decisions_and_admin_sees_all(config):
    async def scenario():
        async with Harness(config) as h:
            await h.openai().completions.create(model="tiny", prompt="a")
            await h.openai("key-bob").completions.create(model="tiny", prompt="b")
            mine = (await h.http.get("/debug/decisions?n=5",
                                     headers={"authorization": "Bearer key-alice"})).json()
            assert [d["tenant"] for d in mine["decisions"]] == ["alice"]
            decision = mine["decisions"][0]
            assert {"candidates", "branch", "reason", "replica"} <= set(decision)
            assert "scores" in decision["candidates"][0]
            everyone = (await h.http.get("/debug/decisions?n=5",
                                         headers={"authorization": "Bearer key-ops"})).json()
            assert len(everyone["decisions"]) == 2 and len(everyone["replicas"]) == 2
            anonymous = await h.http.get("/debug/decisions")
            assert anonymous.status_code == 401
    run(scenario())


def test_health_reports_ok_with_healthy_replicas(config):
    async def scenario():
        async with Harness(config) as h:
            response = await h.http.get("/health")
            assert response.status_code == 200 and response.json()["status"] == "ok"
    run(scenario())


# -- robustness ------------------------------------------------------------------------------

def test_a_large_prompt_is_prepared_off_the_event_loop_and_routed(config):
    async def scenario():
        async with Harness(config) as h:
            prompt = "a long shared document " * 2000  # 46 KB
            await h.openai().completions.create(model="tiny", prompt=prompt)
            record = h.gateway.router.decisions[-1]
            assert record.tokenization == "chars"
            assert record.full_blocks == len(prompt) // (BLOCK * 4)
    run(scenario())


def test_a_policy_choosing_a_non_candidate_falls_back_to_least_loaded(config):
    async def scenario():
        async with Harness(config) as h:
            policy = h.gateway.router.policy
            original = policy.route

            def wrong(request, replicas):
                decision = original(request, replicas)
                decision.replica = 99
                return decision

            policy.route = wrong
            result = await h.openai().completions.create(model="tiny", prompt="x")
            assert result.choices[0].text == "ok ok"
            assert h.gateway.router.decisions[-1].branch == "policy_error_least_loaded"
    run(scenario())


def test_a_policy_that_raises_gives_a_500_error_object_and_is_counted(config):
    async def scenario():
        async with Harness(config) as h:
            def broken(request, replicas):
                raise RuntimeError("bug")

            h.gateway.router.policy.route = broken
            response = await h.http.post("/v1/completions", json={"model": "tiny",
                                                                   "prompt": "x"},
                                         headers={"authorization": "Bearer key-alice"})
            assert response.status_code == 500
            assert response.json()["error"]["code"] == "internal_error"
            text = (await h.http.get("/metrics")).text
            assert 'requests_total{endpoint="completions",status="500"} 1.0' in text
            assert h.gateway.admission.active == 0 and h.gateway.open_requests == 0
    run(scenario())


def test_a_cancelled_request_releases_its_replica_and_slot(config):
    async def scenario():
        async with Harness(config) as h:
            h.r("r0").fault = h.r("r1").fault = "hang"
            task = asyncio.create_task(h.http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "x"},
                headers={"authorization": "Bearer key-alice"}))
            backends = h.gateway.pool.backends
            for _ in range(200):
                if sum(b.in_flight for b in backends):
                    break
                await asyncio.sleep(0.01)
            assert sum(b.in_flight for b in backends) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sum(b.in_flight for b in backends) == 0
            assert h.gateway.admission.active == 0 and h.gateway.open_requests == 0
            assert h.gateway.router.decisions[-1].outcome == "abandoned"
    run(scenario())


def test_a_shutdown_cut_ends_an_open_stream_with_an_error_event(config):
    async def scenario():
        async with Harness(config) as h:
            h.r("r0").fault = h.r("r1").fault = "stall_stream"
            task = asyncio.create_task(h.http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True},
                headers={"authorization": "Bearer key-alice"}))
            for _ in range(200):
                if h.gateway.proxy.streams:
                    break
                await asyncio.sleep(0.01)
            assert h.gateway.cut_streams() == 1
            response = await task
            events = [line for line in response.text.splitlines() if line.startswith("data:")]
            assert json.loads(events[0][6:])["choices"][0]["text"] == "ok"
            assert json.loads(events[-2][6:])["error"]["code"] == "server_shutdown"
            assert events[-1] == "data: [DONE]"
            assert h.gateway.open_requests == 0 and not h.gateway.proxy.streams
            assert h.gateway.router.decisions[-1].outcome == "abandoned"
    run(scenario())


def test_an_unhealthy_replica_forgets_what_was_routed_to_it(config):
    async def scenario():
        async with Harness(config) as h:
            await h.openai().completions.create(model="tiny", prompt=list(range(1, 41)))
            backend = next(b for b in h.gateway.pool.backends if b.assignments)
            assert len(backend.view) == 10
            h.replicas[f"{backend.name}.test"].fault = "connect"
            for _ in range(2):  # unhealthy_after: 2 failed checks
                await backend.check_health(h.gateway.client, 1.0)
            assert not backend.healthy and len(backend.view) == 0
    run(scenario())


# -- priority hints ---------------------------------------------------------------------------
def _priority_config(monkeypatch, scheduling, policy="prefixroute"):
    backends = [{"name": name, "url": f"http://{name}.test", "models": ["tiny"],
                 "scheduling_policy": scheduling} for name in ("r0", "r1")]
    return make_config(monkeypatch, backends=backends, policy=policy)


def test_a_priority_replica_gets_the_policys_deadline_as_priority(monkeypatch):
    async def scenario():
        async with Harness(_priority_config(monkeypatch, "priority"),
                           clock=ManualClock(100.0), wall_clock=lambda: 1_700_000_000.0) as h:
            await h.openai().completions.create(model="tiny", prompt="hello there")
            # A caller's own priority is replaced: no tenant can go ahead of the others.
            await h.openai().completions.create(model="tiny", prompt="other text",
                                                extra_body={"priority": -7})
            by_prompt = {b["prompt"]: b for b in h.r("r0").bodies + h.r("r1").bodies}
            decisions = (await h.http.get("/debug/decisions?n=5", headers={
                "authorization": "Bearer key-alice"})).json()["decisions"]
            for decision, prompt in zip(decisions, ("other text", "hello there")):
                chosen = next(c for c in decision["candidates"]
                              if c["replica"] == decision["replica"])
                # The policy's deadline is 100 s (the gateway's clock) plus twice a few ms of
                # prefill; sent as milliseconds of wall time from the request's arrival.
                after_ms = round(chosen["scores"]["deadline_s"] * 1000) - 100_000
                assert 0 < after_ms < 100
                assert decision["priority"] == 1_700_000_000_000 + after_ms
                assert by_prompt[prompt]["priority"] == decision["priority"]
    run(scenario())


def test_a_first_come_first_served_replica_gets_no_priority(monkeypatch):
    async def scenario():
        async with Harness(_priority_config(monkeypatch, "fcfs"),
                           clock=ManualClock(100.0)) as h:
            await h.openai().completions.create(model="tiny", prompt="hello there")
            body = (h.r("r0").bodies + h.r("r1").bodies)[0]
            assert "priority" not in body
            decision = (await h.http.get("/debug/decisions?n=1", headers={
                "authorization": "Bearer key-alice"})).json()["decisions"][0]
            assert decision["priority"] is None
    run(scenario())


def test_a_bad_scheduling_policy_names_the_field(monkeypatch):
    from prefixroute.core.errors import InputError

    with pytest.raises(InputError, match=r"must be one of fcfs, priority, got 'sjf' \(field "
                                         r"'backends\[0\].scheduling_policy'\)"):
        _priority_config(monkeypatch, "sjf")


def test_a_retry_keeps_the_place_its_arrival_gave_it(monkeypatch):
    async def scenario():
        clock = ManualClock(100.0)
        async with Harness(_priority_config(monkeypatch, "priority"), clock=clock,
                           wall_clock=lambda: 1_700_000_000.0) as h:
            failed = []
            for replica in h.replicas.values():
                handle = replica.handle

                async def flaky(request, handle=handle):
                    if request.url.path.startswith("/v1/") and not failed:
                        failed.append(request.url.host)
                        clock.advance(5.0)  # the first attempt took 5 s to fail
                        raise httpx.ConnectError("refused", request=request)
                    return await handle(request)
                replica.handle = flaky
            await h.openai().completions.create(model="tiny", prompt="hello there")
            retry, first = (await h.http.get("/debug/decisions?n=2", headers={
                "authorization": "Bearer key-alice"})).json()["decisions"]
            assert (first["attempt"], retry["attempt"]) == (0, 1)
            chosen = next(c for c in retry["candidates"] if c["replica"] == retry["replica"])
            # Routed again at 105 s; its deadline is dated from the arrival at 100 s, and sent
            # in wall time (the wall clock reads 1.7e9 s at 105 s on the gateway's).
            after_ms = round(chosen["scores"]["deadline_s"] * 1000) - 100_000
            assert 0 < after_ms < 100
            assert retry["priority"] == 1_700_000_000_000 - 5_000 + after_ms
    run(scenario())


@pytest.mark.parametrize("policy", ["round_robin", "prefixroute:priority_slack=0"])
def test_a_policy_without_an_order_sends_the_arrival_time_to_a_priority_replica(monkeypatch,
                                                                                policy):
    # First come, first served in wall-clock milliseconds; a caller's priority is replaced.
    async def scenario():
        async with Harness(_priority_config(monkeypatch, "priority", policy),
                           clock=ManualClock(100.0), wall_clock=lambda: 1_700_000_000.0) as h:
            await h.openai().completions.create(model="tiny", prompt="hello",
                                                extra_body={"priority": -7})
            body = (h.r("r0").bodies + h.r("r1").bodies)[0]
            assert body["priority"] == 1_700_000_000_000
    run(scenario())
