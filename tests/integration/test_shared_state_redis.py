"""The shared-state parts against a real redis-server, without gateways: the fleet-wide token
bucket has the local bucket's numbers, two instances exchange bookings and a new one
bootstraps from them, and a Redis that is not there costs no request anything but local
state."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

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
