"""Spec of a lease: the slice of a fleet-wide token bucket one instance holds and spends
locally (edges/shared_state/lease.py). Times are hand-stepped seconds."""

from __future__ import annotations

import math

import pytest

from prefixroute.edges.shared_state.lease import LEASE_TTL_S, Lease


def test_a_slice_is_a_quarter_of_the_burst_or_of_a_second_s_rate_never_less_than_the_cost():
    assert Lease(rate=100, burst=100).slice(1) == 25  # min(100 / 4, 100 x 0.25)
    assert Lease(rate=100, burst=40).slice(1) == 10  # a quarter of the burst is smaller
    assert Lease(rate=10, burst=1).slice(1) == 1  # 0.25 of a request: the request itself
    assert Lease(rate=5000, burst=5000).slice(250) == 1250  # prompt tokens
    assert Lease(rate=5000, burst=5000).slice(2000) == 2000  # one long prompt


def test_a_held_slice_is_spent_locally_until_it_lapses():
    lease = Lease(rate=100, burst=100)
    lease.granted(25, level=75, now=0.0)
    assert all(lease.spend(1, now=1.0) for _ in range(25))
    assert not lease.spend(1, now=1.0)  # empty
    lease.granted(25, level=50, now=1.0)
    assert not lease.spend(1, now=1.0 + LEASE_TTL_S)  # lapsed: ask again
    assert lease.lapse(1.0 + LEASE_TTL_S) == 25  # ... and give the 25 back
    assert lease.tokens == 0


def test_what_to_ask_for_covers_the_request_and_tops_up_to_a_slice():
    lease = Lease(rate=100, burst=100)
    assert lease.request(1, now=0.0) == (1, 25)  # nothing held
    lease.granted(25, level=75, now=0.0)
    for _ in range(20):
        lease.spend(1, now=0.1)
    assert lease.request(1, now=0.1) == (0, 20)  # 5 held: covered, top up by 20
    assert lease.request(1, now=0.1, ahead=True) == (1, 20)  # ahead: at least one more
    assert lease.request(1, now=5.0) == (1, 25)  # lapsed: as if nothing were held


def test_the_next_slice_is_fetched_ahead_only_when_a_slice_holds_several_requests():
    big = Lease(rate=100, burst=100)  # slices of 25 requests
    big.granted(25, level=75, now=0.0)
    for _ in range(12):
        big.spend(1, now=0.0)
    assert not big.wants_prefetch(1)  # 13 left of 25
    big.spend(1, now=0.0)
    assert big.wants_prefetch(1)  # 12 left: below half
    one = Lease(rate=10, burst=1)  # a slice is one request: never held ahead
    one.granted(1, level=0, now=0.0)
    one.spend(1, now=0.0)
    assert not one.wants_prefetch(1)


def test_a_refusal_is_known_until_the_bucket_could_have_refilled():
    lease = Lease(rate=10, burst=1)
    assert lease.known_wait(1, now=0.0) == 0.0  # nothing known yet: ask Redis
    lease.granted(0, level=0.4, now=0.0)  # refused, the bucket held 0.4
    assert lease.known_wait(1, now=0.0) == pytest.approx(0.06)  # (1 - 0.4) / 10
    assert lease.known_wait(1, now=0.03) == pytest.approx(0.03)
    assert lease.known_wait(1, now=0.06) == 0.0  # it may hold 1 now: ask again


def test_a_cost_above_the_burst_never_passes():
    assert math.isinf(Lease(rate=5000, burst=5000).known_wait(5001, now=0.0))


def test_a_refund_puts_back_what_was_spent():
    lease = Lease(rate=100, burst=100)
    lease.granted(25, level=75, now=0.0)
    lease.spend(3, now=0.0)
    lease.refund(3)
    assert lease.tokens == 25


def test_release_hands_back_everything_held():
    lease = Lease(rate=100, burst=100)
    lease.granted(25, level=75, now=0.0)
    lease.spend(5, now=0.0)
    assert lease.release() == 20
    assert not lease.spend(1, now=0.0)


def test_a_bucket_needs_a_positive_rate_and_burst():
    with pytest.raises(ValueError):
        Lease(rate=0, burst=1)


def test_credit_needs_the_bucket_half_full_beyond_the_request_and_nothing_owed():
    lease = Lease(rate=100, burst=100)
    assert lease.may_admit_on_credit(1, now=0.0)  # never asked: taken as full
    lease.credit(1)
    assert not lease.may_admit_on_credit(1, now=0.0)  # one at a time
    lease.owed = 0.0
    lease.granted(0, level=50, now=0.0)  # Redis: 50 left
    assert not lease.may_admit_on_credit(1, now=0.0)  # 50 - 1 < 100 / 2
    assert lease.may_admit_on_credit(1, now=0.01)  # refilled by 1: 51 - 1 >= 50


def test_credit_given_while_a_fetch_was_on_its_way_is_paid_from_its_slice():
    lease = Lease(rate=100, burst=100)
    lease.credit(10)  # admitted while a slice was being fetched
    lease.granted(25, level=75, now=0.0)
    assert (lease.tokens, lease.owed) == (15, 0)
    lease.credit(20)
    lease.granted(0, level=0, now=0.1)  # refused: still owed, for the next fetch
    assert (lease.tokens, lease.owed) == (15, 20)
    lease.granted(8, level=0, now=0.2)  # held 15 + 8: pays the 20
    assert (lease.tokens, lease.owed) == (3, 0)
    lease.credit(10)
    lease.granted(4, level=0, now=3.0)  # the old slice lapsed: 4 pay what they can
    assert (lease.tokens, lease.owed) == (0, 6)


def test_a_burst_of_one_never_gets_credit():
    assert not Lease(rate=10, burst=1).may_admit_on_credit(1, now=0.0)  # 1 - 1 < 0.5


def test_credit_waits_while_an_earlier_credit_is_being_charged():
    # At most one request per instance is uncharged: while a call carries the first
    # credit's charge to Redis, a second request gets no credit, and the bucket's estimate
    # counts the charge on its way.
    lease = Lease(rate=100, burst=100)
    assert lease.may_admit_on_credit(10, now=0.0)
    lease.credit(10)
    lease.charging, lease.owed = 10, 0  # what the limiter's call does while it is sent
    assert lease.estimated_level(0.0) == 90
    assert not lease.may_admit_on_credit(10, now=0.0)
    lease.charging = 0  # answered
    lease.granted(0, level=90, now=0.0)
    assert lease.may_admit_on_credit(10, now=0.0)
