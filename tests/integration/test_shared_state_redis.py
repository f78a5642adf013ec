"""The shared-state parts against a real redis-server, without gateways: the fleet-wide token
bucket has the local bucket's numbers, two instances exchange bookings and a new one
bootstraps from them, and a Redis that is not there costs no request anything but local
state."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry
from redis.asyncio.connection import Connection

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.lifecycle import LifecycleRunner
from prefixroute.core.routing.views import ApproximateView
from prefixroute.edges.listen import free_port
from prefixroute.edges.shared_state.shared import SharedState
from tests.helpers.redis_server import RedisServer, needs_redis

pytestmark = needs_redis


class First(BasePolicy):
    def route(self, request, replicas):
        return Decision(replicas[0].index, "first")


def instance(url: str, namespace: str) -> tuple[SharedState, LifecycleRunner]:
    runner = LifecycleRunner(First())
    for i in range(2):
        runner.add_replica(ReplicaView(index=i, name=f"r{i}", cache=ApproximateView(None)))
    shared = SharedState(url, runner, CollectorRegistry(), now=time.monotonic,
                         namespace=namespace)
    return shared, runner


def up(shared: SharedState) -> float | None:
    return shared.registry.get_sample_value("prefixroute_shared_state_up")


async def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_the_fleet_bucket_takes_burst_then_one_per_interval(tmp_path):
    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t1")
            other, _ = instance(redis.url, "t1")  # a second instance, same bucket
            bucket = [("requests", 2.0, 3.0, 1.0)]  # 2 a second, burst 3
            waits = [await s.take("a", bucket) for s in (shared, other, shared, other)]
            await shared.stop()
            await other.stop()
            return waits

    waits = asyncio.run(scenario())
    assert waits[:3] == [0.0, 0.0, 0.0]  # the burst, across both instances
    assert 0.35 < waits[3] <= 0.5  # then one token per 0.5 s, less what refilled meanwhile


def test_bookings_reach_the_other_instance_and_a_late_one_bootstraps(tmp_path):
    async def scenario():
        with RedisServer(tmp_path) as redis:
            a, runner_a = instance(redis.url, "t2")
            b, runner_b = instance(redis.url, "t2")
            await a.start()
            await b.start()
            bookings = []
            for i in range(3):
                booking = runner_a.route(RequestView(f"q{i}", 33, 16, block_keys=(i, 7),
                                                     now=time.monotonic()))
                a.routed(booking, 0)
                bookings.append(booking)
            runner_a.completed(bookings[0], 16)
            a.completed(bookings[0], 16)
            await until(lambda: b.remote.applied["completed"] == 1)
            in_flight_b = runner_b.replicas[0].in_flight
            late, runner_late = instance(redis.url, "t2")
            await late.start()
            await until(lambda: late.bookings.bootstrapped)
            in_flight_late = runner_late.replicas[0].in_flight
            for s in (a, b, late):
                await s.stop()
            return in_flight_b, in_flight_late

    # 3 booked on r0, 1 completed: 2 in flight, seen by B live and by the late one at start.
    assert asyncio.run(scenario()) == (2, 2)


def test_no_redis_means_local_state_and_no_failure():
    async def scenario():
        shared, runner = instance(f"redis://127.0.0.1:{free_port()}/0", "t3")
        await shared.start()
        booking = runner.route(RequestView("q", 33, 16, block_keys=(1, 2), now=0.0))
        shared.routed(booking, 0)  # queued, never raises
        started = time.monotonic()
        wait = await shared.take("a", [("requests", 1.0, 1.0, 1.0)])
        took = time.monotonic() - started
        await until(lambda: not shared.link.up)
        again = await shared.take("a", [("requests", 1.0, 1.0, 1.0)])  # skipped while down
        await shared.stop()
        return wait, took, again, up(shared)

    wait, took, again, shown = asyncio.run(scenario())
    assert wait is None and again is None  # the caller uses its local bucket
    assert took < 2.0  # connection refused, not a hang
    assert shown == 0


def test_an_instance_that_stops_has_its_open_bookings_ended_by_the_others(tmp_path):
    async def scenario():
        with RedisServer(tmp_path) as redis:
            a, runner_a = instance(redis.url, "t4")
            b, runner_b = instance(redis.url, "t4")
            await a.start()
            await b.start()
            for i in range(2):
                booking = runner_a.route(RequestView(f"q{i}", 33, 16, block_keys=(i,),
                                                     now=time.monotonic()))
                a.routed(booking, 0)
            await until(lambda: runner_b.replicas[0].in_flight == 2)
            await a.stop()  # with two requests still open: its process is going away
            await until(lambda: runner_b.replicas[0].in_flight == 0, timeout=20.0)
            await b.stop()

    asyncio.run(scenario())


def test_four_instances_spend_at_most_the_fleet_bucket_of_prompt_tokens(tmp_path):
    """Leased slices, spent locally by four instances offered three times the limit: the
    tokens they let through stay within burst + rate x elapsed, as one bucket's would."""
    rate, burst, seconds = 4000.0, 4000.0, 2.0
    costs = [100 + (37 * i) % 300 for i in range(10_000)]  # 100..399 prompt tokens

    async def scenario():
        with RedisServer(tmp_path) as redis:
            fleet = [instance(redis.url, "t5")[0] for _ in range(4)]
            accepted = offered = 0
            started = time.monotonic()
            i = 0
            while time.monotonic() - started < seconds:
                cost = costs[i]
                wait = await fleet[i % 4].take("a", [("prompt_tokens", rate, burst, cost)])
                assert wait is not None  # Redis answered
                offered += cost
                accepted += cost if wait == 0 else 0
                i += 1
                # three times the rate, spread evenly
                await asyncio.sleep(max(0.0, started + offered / (3 * rate) - time.monotonic()))
            elapsed = time.monotonic() - started
            ops = sum(s.registry.get_sample_value(
                "prefixroute_shared_state_redis_operations_total", {"op": "ratelimit"}) or 0
                for s in fleet)
            for s in fleet:
                await s.stop()
            return accepted, offered, elapsed, i, ops

    accepted, offered, elapsed, requests, ops = asyncio.run(scenario())
    allowed = burst + rate * elapsed
    assert offered > 2 * allowed, "the load was too light to test the limit"
    assert accepted <= 1.05 * allowed, f"{accepted} tokens accepted, {allowed:.0f} allowed"
    assert accepted >= 0.6 * rate * seconds
    assert ops < requests  # not one round trip per request


def test_a_tenant_within_its_limit_asks_redis_about_once_per_slice(tmp_path):
    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t6")
            waits = []
            for _ in range(100):  # 100 requests at 200 a second, limit 100 a second burst 100
                waits.append(await shared.take("a", [("requests", 100.0, 100.0, 1.0)]))
                await asyncio.sleep(0.005)
            counts = dict(shared.limiter.counts)
            await shared.stop()
            return waits, counts

    waits, counts = asyncio.run(scenario())
    assert waits == [0.0] * 100
    # Slices of 25 (a quarter of the burst): the first on the path, then topped up to 25,
    # ahead of need, whenever fewer than 12.5 are left: 13 a time, (100 - 25) / 13 -> 6 or 7
    # round trips off the path.
    assert counts["path"] == 1
    assert counts["local"] == 99
    assert 5 <= counts["prefetch"] <= 7


def test_an_unspent_slice_goes_back_to_the_fleet_bucket(tmp_path):
    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t7")
            shared.limiter.ttl_s = 0.05
            bucket = [("requests", 100.0, 100.0, 1.0)]  # slices of 25
            await shared.take("a", bucket)  # a slice of 25 taken, 1 spent, 24 unspent
            key = shared.limiter.key("a", "requests")
            client = shared.link.client
            held = float(await client.hget(key, "tokens"))
            await asyncio.sleep(0.06)  # the slice lapses
            returned = await shared.limiter.sweep()
            after = float(await client.hget(key, "tokens"))
            left = shared.limiter.leases[key].tokens
            await shared.stop()
            return held, returned, after, left

    held, returned, after, left = asyncio.run(scenario())
    assert 75 <= held < 77  # 100 - 25 (and whatever refilled meanwhile)
    assert (returned, left) == (1, 0)
    # 24 came back, on top of the refill (100 a second): without them the bucket would hold
    # about 81 after 0.06 s.
    assert after == 100 or after >= held + 24


def test_a_slice_fetched_before_the_cost_is_known_spares_the_check_its_round_trip(tmp_path):
    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t8")
            shared.warm("a", "prompt_tokens", 5000.0, 5000.0)  # the prompt is not tokenized
            await asyncio.sleep(0)  # ... while the body is read and tokenized
            wait = await shared.take("a", [("prompt_tokens", 5000.0, 5000.0, 250.0)])
            counts = dict(shared.limiter.counts)
            await shared.stop()
            return wait, counts

    wait, counts = asyncio.run(scenario())
    assert wait == 0.0
    assert (counts["prefetch"], counts["path"]) == (1, 0)  # a slice of 1250 covered it


def test_a_slice_a_credit_or_a_known_refusal_decides_without_asking_redis(tmp_path):
    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t9")
            roomy = [("requests", 100.0, 100.0, 1.0)]  # slices of 25
            tight = [("requests", 2.0, 1.0, 1.0)]  # burst 1: slices of one request
            credit = shared.take_local("a", roomy)  # nothing held; the bucket is full
            await until(lambda: not shared.limiter._fetching)  # charged, a slice fetched
            held = shared.take_local("a", roomy)
            cold = shared.take_local("b", tight)  # burst 1: never on credit, ask Redis
            first = await shared.take("b", tight)  # b's only token
            refused = shared.take_local("b", tight)  # Redis said the bucket is empty
            ops = shared.registry.get_sample_value(
                "prefixroute_shared_state_redis_operations_total", {"op": "ratelimit"})
            level = float(await shared.link.client.hget(shared.limiter.key("a"), "tokens"))
            counts = dict(shared.limiter.counts)
            await shared.stop()
            return credit, held, cold, first, refused, ops, level, counts

    credit, held, cold, first, refused, ops, level, counts = asyncio.run(scenario())
    assert (credit, held, cold, first) == (0.0, 0.0, None, 0.0)
    assert 0.4 < refused <= 0.5  # one token at 2 a second, less what refilled meanwhile
    assert ops == 2  # a's charge with its slice, b's token
    assert 74 <= level < 76  # 100 - 1 (the credit) - 24 (the slice), plus a little refill
    assert counts["credit"] == 1


def test_a_first_prompt_does_not_wait_for_the_slice_fetched_before_it_was_tokenized(tmp_path):
    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t11")
            limit = ("prompt_tokens", 5000.0, 5000.0)
            shared.warm("a", *limit)  # at arrival: a slice of 1250 asked for
            await asyncio.sleep(0)  # sent while the body is read
            # Tokenized before Redis answered: the bucket, never asked, is taken as full.
            wait = shared.take_local("a", [(*limit, 1000.0)])
            await until(lambda: not shared.limiter._fetching)
            lease = shared.limiter.leases[shared.limiter.key("a", "prompt_tokens")]
            held, owed = lease.tokens, lease.owed
            level = float(await shared.link.client.hget(
                shared.limiter.key("a", "prompt_tokens"), "tokens"))
            ops = shared.registry.get_sample_value(
                "prefixroute_shared_state_redis_operations_total", {"op": "ratelimit"})
            await shared.stop()
            return wait, held, owed, level, ops

    wait, held, owed, level, ops = asyncio.run(scenario())
    assert wait == 0.0  # decided at once, on credit
    assert (held, owed) == (250, 0)  # paid from the slice: 1250 - 1000
    assert ops == 1  # the warm fetch only
    assert 3750 <= level < 3760  # 5000 - 1250, plus a little refill


def test_lapsed_slices_of_many_tenants_go_back_in_one_round_trip(tmp_path, monkeypatch):
    sends = []
    real_send = Connection.send_packed_command

    async def counted(self, command, check_health=True):  # the real send, counted
        sends.append(1)
        return await real_send(self, command, check_health)

    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t10")
            shared.limiter.ttl_s = 0.05
            bucket = [("requests", 100.0, 100.0, 1.0)]  # slices of 25
            tenants = [f"tenant-{i}" for i in range(20)]
            for tenant in tenants:
                await shared.take(tenant, bucket)  # 24 unspent in each slice
            await asyncio.sleep(0.06)  # the slices lapse
            monkeypatch.setattr(Connection, "send_packed_command", counted)
            returned = await shared.limiter.sweep()
            monkeypatch.undo()
            levels = [float(await shared.link.client.hget(shared.limiter.key(t), "tokens"))
                      for t in tenants]
            await shared.stop()
            return returned, levels

    returned, levels = asyncio.run(scenario())
    assert returned == 20
    # One pipeline (and the check that Redis holds the script), not 20 round trips.
    assert len(sends) <= 2
    assert all(level >= 99 for level in levels)  # 75 + 24 back, plus the refill


def test_concurrent_requests_are_refused_only_when_the_fleet_bucket_lacks_their_cost(tmp_path):
    # 10 requests at once on one instance for a bucket of 0.1 a second, burst 100: the slice
    # is one request (a quarter second of the rate is less), so each shared fetch serves one
    # request and the others find it spent. The bucket holds 100: all 10 pass. Then 95 more
    # at once: 90 pass and 5 are refused, each told to wait up to the 10 s one token takes to
    # refill (less what refilled during the test).
    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t-many")
            bucket = [("requests", 0.1, 100.0, 1.0)]
            first = await asyncio.gather(*(shared.take("a", bucket) for _ in range(10)))
            second = await asyncio.gather(*(shared.take("a", bucket) for _ in range(95)))
            await shared.stop()
            return first, second

    first, second = asyncio.run(scenario())
    assert first == [0.0] * 10
    assert second.count(0.0) == 90
    refused = [w for w in second if w != 0.0]
    assert len(refused) == 5 and all(5.0 < w <= 10.0 for w in refused)


def test_a_request_asking_alone_gets_its_cost_or_an_exact_refusal(tmp_path, monkeypatch):
    # No shared answer at all (every request goes straight to its own script call): of 5
    # requests at once on a bucket of 0.1 a second, burst 3, exactly 3 pass and 2 are told
    # to wait up to the 10 s a token takes (the script takes or refuses atomically).
    from prefixroute.edges.shared_state import ratelimit

    monkeypatch.setattr(ratelimit, "SHARED_TRIES", 0)

    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t-alone")
            bucket = [("requests", 0.1, 3.0, 1.0)]
            waits = await asyncio.gather(*(shared.take("a", bucket) for _ in range(5)))
            alone = shared.limiter.counts["alone"]
            await shared.stop()
            return waits, alone

    waits, alone = asyncio.run(scenario())
    assert alone == 5
    assert waits.count(0.0) == 3
    assert all(5.0 < w <= 10.0 for w in waits if w != 0.0)



def test_a_request_asking_alone_from_a_transports_callback_gets_its_answer(tmp_path,
                                                                             monkeypatch):
    """A request's check started in a transport's read callback (the Endpoint Picker's,
    outside any task until it first waits) may reach its own script call without waiting
    first; the Redis client needs a task, so the call goes on in one."""
    from prefixroute.edges.eager import start
    from prefixroute.edges.shared_state import ratelimit
    from tests.helpers.loop import from_callback

    monkeypatch.setattr(ratelimit, "SHARED_TRIES", 0)

    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t-alone-callback")
            bucket = [("requests", 0.1, 3.0, 1.0)]
            started = await from_callback(start, shared.take("a", bucket))
            wait = started.result if started.task is None else await started.task
            alone = shared.limiter.counts["alone"]
            await shared.stop()
            return started.error, wait, alone

    error, wait, alone = asyncio.run(scenario())
    assert error is None and wait == 0.0 and alone == 1


def test_a_zero_cost_waiting_beside_a_costed_request_passes(tmp_path):
    # A request costing nothing (no prompt tokens to count) at the same moment as one costing
    # a token, on a key with no slice yet: both pass; nothing stays counted as waiting.
    async def scenario():
        with RedisServer(tmp_path) as redis:
            shared, _ = instance(redis.url, "t-zero")
            waits = await asyncio.gather(
                shared.take("a", [("prompt_tokens", 0.1, 100.0, 1.0)]),
                shared.take("a", [("prompt_tokens", 0.1, 100.0, 0.0)]))
            demand = dict(shared.limiter._demand)
            await shared.stop()
            return waits, demand

    waits, demand = asyncio.run(scenario())
    assert waits == [0.0, 0.0]
    assert demand == {}
