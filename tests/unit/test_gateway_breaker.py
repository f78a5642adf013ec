"""Circuit breaker and admission queue."""

import asyncio

import pytest

from prefixroute.core.clock import ManualClock
from prefixroute.edges.gateway.admission import AdmissionQueue
from prefixroute.edges.gateway.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from prefixroute.edges.gateway.errors import GatewayError


def test_breaker_opens_after_threshold_consecutive_failures():
    breaker = CircuitBreaker(ManualClock(), failure_threshold=3, open_s=10)
    for _ in range(2):
        breaker.record_failure()
    assert breaker.state == CLOSED and breaker.available()
    breaker.record_failure()
    assert breaker.state == OPEN and not breaker.available()


def test_a_success_resets_the_failure_count():
    breaker = CircuitBreaker(ManualClock(), failure_threshold=2)
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state == CLOSED


def test_after_open_s_one_trial_goes_and_its_success_closes():
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failure_threshold=1, open_s=10)
    breaker.record_failure()
    clock.advance(9.9)
    assert not breaker.available()
    clock.advance(0.1)
    assert breaker.state == HALF_OPEN and breaker.available()
    breaker.on_dispatch()
    assert not breaker.available()  # only one trial at a time
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.available()


def test_a_failed_trial_opens_again_for_open_s():
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failure_threshold=1, open_s=5)
    breaker.record_failure()
    clock.advance(5)
    breaker.on_dispatch()
    breaker.record_failure()
    assert breaker.state == OPEN and breaker.opened == 2
    clock.advance(5)
    assert breaker.available()


def test_an_abandoned_trial_frees_the_half_open_slot():
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failure_threshold=1, open_s=1)
    breaker.record_failure()
    clock.advance(1)
    breaker.on_dispatch()
    breaker.release()
    assert breaker.available()


def test_admission_refuses_with_429_when_the_queue_is_full():
    async def scenario():
        queue = AdmissionQueue(max_concurrent=1, max_queued=1, queue_timeout_s=5)
        await queue.acquire()
        waiter = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0)
        assert queue.waiting == 1
        with pytest.raises(GatewayError) as info:
            await queue.acquire()
        assert info.value.status == 429 and info.value.code == "queue_full"
        queue.release()
        await waiter
        assert queue.active == 1 and queue.waiting == 0
        queue.release()
    asyncio.run(scenario())


def test_admission_times_out_with_503():
    async def scenario():
        queue = AdmissionQueue(max_concurrent=1, max_queued=4, queue_timeout_s=0.05)
        await queue.acquire()
        with pytest.raises(GatewayError) as info:
            await queue.acquire()
        assert info.value.status == 503 and queue.waiting == 0
    asyncio.run(scenario())


def test_a_passing_health_check_is_the_half_open_trial():
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failure_threshold=1, open_s=10)
    breaker.record_failure()
    clock.advance(10)
    breaker.on_dispatch()  # a trial request is out: no other may go
    assert breaker.state == HALF_OPEN and not breaker.available()
    breaker.record_health_ok()
    assert breaker.state == CLOSED and breaker.available()


def test_a_health_check_passing_while_open_closes_the_breaker_when_the_period_ends():
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failure_threshold=1, open_s=10)
    breaker.record_failure()
    clock.advance(3)
    breaker.record_health_ok()  # back early: the breaker still keeps the full open period
    assert breaker.state == OPEN and not breaker.available()
    clock.advance(7)
    assert breaker.state == CLOSED and breaker.available()
    breaker.on_dispatch()
    breaker.on_dispatch()  # no single-trial limit once closed
    assert breaker.available()


def test_a_health_check_before_the_breaker_reopens_does_not_count_for_the_next_opening():
    clock = ManualClock()
    breaker = CircuitBreaker(clock, failure_threshold=1, open_s=10)
    breaker.record_failure()
    clock.advance(5)
    breaker.record_health_ok()
    clock.advance(5)
    breaker.record_failure()  # closed, then failed again: open anew
    clock.advance(10)
    assert breaker.state == HALF_OPEN
