"""The other instances' pending prefill in this instance's decisions.

A gateway measures a replica's pending prefill itself: the uncached tokens of the requests it
sent there whose first byte has not come back. The default policy reconciles its record of
the replica's queue with that figure at every decision. Instance B below routes with the
default policy over two replicas (prefill priced at 4e-5 s a token); instance A's bookings
reach it as messages, the way the Redis stream delivers them. Without A's share in the
figure, A's booking left B's queue record at B's next decision and its prefill counted for
nothing in B's wait there."""

from prometheus_client import CollectorRegistry

from prefixroute.core.clock import ManualClock
from prefixroute.core.routing.policies.prefixroute import PrefixRoute
from prefixroute.edges.gateway.backends import Backend
from prefixroute.edges.gateway.config import hash_api_key, parse_config
from prefixroute.edges.gateway.metrics import GatewayMetrics
from prefixroute.edges.gateway.prompts import TOKEN_IDS, PreparedPrompt
from prefixroute.edges.gateway.router import GatewayRouter
from prefixroute.edges.shared_state.codec import Completed, Prefilled, Routed, decode, encode
from prefixroute.edges.shared_state.shared import SharedState

BLOCK = 16
S_PER_TOKEN = 4.0e-5
NO_REDIS = "redis://127.0.0.1:9/0"  # never connected: nothing here starts the shared state


def instance_b(monkeypatch):
    monkeypatch.setenv("PR_PENDING_TEST_SECRET", "5e" * 32)
    config = parse_config({
        "server_secret": {"env": "PR_PENDING_TEST_SECRET"},
        "backends": [{"name": name, "url": f"http://{name}.test", "models": ["tiny"],
                      "prefill_s_per_token": S_PER_TOKEN} for name in ("r0", "r1")],
        "tenants": [{"name": "t", "api_key_sha256": hash_api_key("k")}],
    }, "test.yaml")
    clock = ManualClock(100.0)
    metrics = GatewayMetrics()
    backends = [Backend(i, b, config, clock, metrics) for i, b in enumerate(config.backends)]
    router = GatewayRouter(PrefixRoute(), backends, metrics, clock)
    shared = SharedState(NO_REDIS, router.runner, CollectorRegistry(), now=clock.now,
                         wall=lambda: clock.now() + 1000.0, instance="B")
    router.observer = shared
    return router, shared, backends, clock


def prompt(first_key: int, tokens: int) -> PreparedPrompt:
    return PreparedPrompt(tokens, tuple(range(first_key, first_key + tokens // BLOCK)),
                          None, TOKEN_IDS)


def route(router, backends, rid, tokens, first_key, only=None):
    candidates = backends if only is None else [backends[only]]
    return router.route(request_id=rid, tenant="t", model="tiny",
                        prompt=prompt(first_key, tokens), block_size=BLOCK,
                        candidates=candidates, attempt=0)


def serve(router, attempt, cached=0):
    router.first_byte(attempt)
    router.succeeded(attempt, {"prompt_tokens": attempt.request.num_tokens,
                               "prompt_tokens_details": {"cached_tokens": cached}})


def from_a(shared, event):
    return shared.remote.apply(decode(encode(event)))  # as it comes off the stream


def booked_by_a(rid, replica, tokens, first_key, predicted_cached, wall):
    return Routed("A", rid, replica, "t", tokens, BLOCK,
                  tuple(range(first_key, first_key + tokens // BLOCK)), wall, "cold_spread",
                  predicted_cached)


def work(uncached, cached=0.0):
    """The policy's prefill work in token-equivalents (PrefixRouteParams' defaults)."""
    attention = uncached * (cached + uncached / 2) / 44_000.0
    return uncached + attention + -(-uncached // 8192) * 150.0


def test_a_peer_s_prefill_counts_in_the_wait_until_its_first_byte(monkeypatch):
    router, shared, backends, clock = instance_b(monkeypatch)
    # B's own two prompts of 5,008 tokens went to r1 and were answered: r1 has the more
    # recent requests and about as much prefill routed as A's booking below puts on r0.
    for i in range(2):
        serve(router, route(router, backends, f"b{i}", 5_008, 10_000 * (i + 1), only=1))
    clock.advance(0.01)
    # A sends a cold 10,000-token prompt to r0, just now.
    assert from_a(shared, booked_by_a("a1", "r0", 10_000, 50_000, 0, clock.now() + 1000.0))
    assert shared.pending_prefill_tokens(0) == 10_000
    clock.advance(0.01)
    decided = route(router, backends, "b2", 1_008, 70_000)
    # r0 waits for A's prefill (11,436 token-equivalents at 4e-5 s), r1 for nothing: B goes
    # to r1. (Without A's share, r0 looked idle too, and the tie went to the replica with
    # the fewer recent requests, r0, behind A's prompt.)
    scores = decided.decision.scores
    assert abs(scores[0]["wait_s"] - work(10_000) * S_PER_TOKEN) < 1e-9
    assert scores[1]["wait_s"] == 0.0
    assert decided.backend.name == "r1"
    serve(router, decided)
    # A's first byte came back: r0's queue is empty again in B's next decision.
    assert from_a(shared, Prefilled("A", "a1"))
    assert shared.pending_prefill_tokens(0) == 0
    clock.advance(0.01)
    assert route(router, backends, "b3", 1_008, 80_000).decision.scores[0]["wait_s"] == 0.0


def test_a_peer_s_pending_prefill_leaves_with_its_end_and_is_counted_once(monkeypatch):
    _, shared, _, _ = instance_b(monkeypatch)
    from_a(shared, booked_by_a("a1", "r1", 4_000, 1, 1_600, 1100.0))
    from_a(shared, booked_by_a("a2", "r1", 2_000, 900, 0, 1100.0))
    from_a(shared, booked_by_a("a1", "r1", 4_000, 1, 1_600, 1100.0))  # repeated: once
    assert (shared.pending_prefill_tokens(0), shared.pending_prefill_tokens(1)) == (0, 4_400)
    from_a(shared, Completed("A", "a1", 1_600))  # an end without a first byte before it
    assert shared.pending_prefill_tokens(1) == 2_000
    from_a(shared, Prefilled("A", "a2"))
    from_a(shared, Prefilled("A", "a2"))  # repeated: nothing more leaves
    assert shared.pending_prefill_tokens(1) == 0
    from_a(shared, booked_by_a("a3", "r1", 3_000, 2_000, 0, 1100.0))
    assert shared.remote.forget_instance("A") == 2  # a2 (prefilled, still open) and a3
    assert shared.pending_prefill_tokens(1) == 0


def test_a_peer_s_smaller_hit_estimate_does_not_inflate_the_wait(monkeypatch):
    router, shared, backends, clock = instance_b(monkeypatch)
    # B sent a 8,000-token prefix to r0 (its policy expects r0 to hold it) ...
    serve(router, route(router, backends, "b0", 8_000, 0, only=0))
    clock.advance(0.01)
    # ... and A, which did not know, sent that prefix and 1,008 more tokens there, counting
    # all 9,008 as uncached (its own view held none of it).
    from_a(shared, booked_by_a("a1", "r0", 9_008, 0, 0, clock.now() + 1000.0))
    clock.advance(0.01)
    scores = route(router, backends, "b1", 1_008, 90_000).decision.scores
    # r0's pending prefill is A's figure, 9,008 tokens; B's queue record holds A's request at
    # that count and its wait is B's own estimate of the work: 1,008 new tokens after 8,000
    # cached. (Counted at B's 1,008, the surplus read as unknown work, 8,000 tokens more.)
    assert abs(scores[0]["wait_s"] - work(1_008, 8_000) * S_PER_TOKEN) < 1e-9


def test_a_streamed_answer_tells_its_first_byte_and_a_whole_one_only_its_end(monkeypatch):
    router, shared, backends, _ = instance_b(monkeypatch)
    streamed = route(router, backends, "s", 1_008, 0)
    router.first_byte(streamed)
    router.succeeded(streamed, {"prompt_tokens": 1_008,
                                "prompt_tokens_details": {"cached_tokens": 0}})
    whole = route(router, backends, "w", 1_008, 5_000)
    router.first_byte(whole, whole=True)
    router.succeeded(whole, {"prompt_tokens": 1_008,
                             "prompt_tokens_details": {"cached_tokens": 0}})
    told = [(type(e).__name__, e.request_id) for e in map(decode, shared.bookings.outbox)]
    assert told == [("Routed", "s"), ("Prefilled", "s"), ("Completed", "s"),
                    ("Routed", "w"), ("Completed", "w")]


def test_a_peer_s_non_streamed_prefill_ends_when_the_replica_shows_nothing_waiting(
        monkeypatch):
    """A peer's non-streamed answer sends no first byte before its end. The rule a gateway
    applies to its own such requests releases the peer's too: a scrape that finds nothing
    waiting on the replica ends the prefill of everything routed there before the previous
    scrape."""
    import asyncio

    import httpx

    _, shared, backends, clock = instance_b(monkeypatch)
    metrics = httpx.MockTransport(lambda request: httpx.Response(
        200, text="vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n"))
    clock.advance(0.01)
    from_a(shared, booked_by_a("a1", "r0", 4_000, 1, 0, clock.now() + 1000.0))

    async def scrape():
        async with httpx.AsyncClient(transport=metrics) as client:
            await backends[0].scrape_metrics(client, 1.0)

    clock.advance(0.5)
    asyncio.run(scrape())  # the previous scrape (at start) came before A's booking
    assert shared.pending_prefill_tokens(0) == 4_000
    clock.advance(0.5)
    asyncio.run(scrape())  # nothing waited at the scrape after the booking: it ran
    assert shared.pending_prefill_tokens(0) == 0
    assert list(shared.remote.open) == [("A", "a1")]  # still in flight, only prefilled


def test_a_replica_that_left_and_came_back_takes_the_peers_bookings(monkeypatch):
    router, shared, _, _ = instance_b(monkeypatch)
    runner = router.runner
    old = runner.replicas[0]
    runner.remove_replica(0)
    back = runner.add_replica(type(old)(2, name=old.name))  # the same name, a new index
    assert from_a(shared, booked_by_a("a1", "r0", 4_000, 1, 0, 1100.0))
    assert back.in_flight == 1 and old.in_flight == 0
    assert shared.pending_prefill_tokens(2) == 4_000


def test_a_peer_clock_behind_ours_releases_nothing_before_its_booking_arrived(monkeypatch):
    """A peer whose clock runs 5 s behind stamps its booking 5 s early: a scrape taken before
    the booking arrived here cannot speak for it, whatever the stamp says."""
    import asyncio

    import httpx

    _, shared, backends, clock = instance_b(monkeypatch)
    metrics = httpx.MockTransport(lambda request: httpx.Response(
        200, text="vllm:num_requests_waiting 0\n"))

    async def scrape():
        async with httpx.AsyncClient(transport=metrics) as client:
            await backends[0].scrape_metrics(client, 1.0)

    clock.advance(0.5)
    from_a(shared, booked_by_a("a1", "r0", 4_000, 1, 0, clock.now() + 1000.0 - 5.0))
    asyncio.run(scrape())  # the previous scrape, at start, came before it arrived
    assert shared.pending_prefill_tokens(0) == 4_000
    clock.advance(0.5)
    asyncio.run(scrape())
    assert shared.pending_prefill_tokens(0) == 0
