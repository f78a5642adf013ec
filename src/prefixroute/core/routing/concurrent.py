"""Decisions made at the same time by several router instances that share their bookings.

Router instances that share state (each instance's bookings reach the others through a
stream) still decide on a view that lacks the others' latest bookings: a booking reaches the
peers some milliseconds after it was made (the *booking lag*). Every instance runs the same
deterministic policy on nearly the same view, so decisions made within one lag of each other
pick the same replica: a burst of cold prompts that one router would spread over the fleet,
one per replica, lands on one replica from four routers (*herding*).

The remedy here keeps the policy as it is and acts on its answer. Suppose ``unseen`` other
decisions are being made concurrently with this one (on average: the other instances' booking
rate times the lag, Little's law; the body measures both). Had one router made all
``1 + unseen`` of them in turn, it would have booked each before the next, and each would
have raised the cost of its replica by its own prefill: the *greedy sequence* of
:func:`greedy_picks`, starting with the policy's own choice. Nobody knows which place in that
sequence this decision holds, so it takes a place at random, uniformly over the
``1 + unseen`` (a fractional ``unseen`` gives the last place its fraction): concurrent
decisions then spread over the replicas as one router would have spread them, and two of them
meet on a replica with probability ``1 / (1 + unseen)`` instead of 1.

What it leaves alone: a lone router, or one whose peers are quiet (``unseen`` 0: the policy's
decision unchanged); a request whose replica stays the cheapest even after its own prefill is
added again (a cache hit, whose prefill is small: every place of the sequence is that
replica); a policy that gives no ``cost_s`` and ``prefill_s`` per replica in its scores.

Pure: the draw (uniform in [0, 1)) comes in the call; the body seeds its generator per
instance, which is what makes the instances' choices differ.
"""

from __future__ import annotations

import math

from prefixroute.core.routing.base import Decision

SPREAD_BRANCH = "concurrent_spread"
# Places considered at most (a burst seen by many instances over a long lag): beyond a few
# rounds over the replicas, more places spread no further.
MAX_PLACES = 64


def greedy_picks(decision: Decision, places: int) -> list[int]:
    """The replicas ``places`` concurrent decisions like this one would take from one router:
    first the policy's choice, then each time the replica cheapest with the prefill of the
    picks already on it added (``cost_s + picks * prefill_s``; ties: fewer picks, then the
    lower index). Empty when the scores lack ``cost_s`` or ``prefill_s``."""
    scores = decision.scores
    try:
        cost = {i: float(s["cost_s"]) for i, s in scores.items()}
        prefill = {i: float(s["prefill_s"]) for i, s in scores.items()}
    except (KeyError, TypeError, ValueError):
        return []
    if decision.replica not in cost:
        return []
    picks = [decision.replica]
    taken = dict.fromkeys(cost, 0)
    taken[decision.replica] = 1
    while len(picks) < places:
        best = min(cost, key=lambda i: (cost[i] + taken[i] * prefill[i], taken[i], i))
        picks.append(best)
        taken[best] += 1
    return picks


def spread(decision: Decision, unseen: float, draw: float) -> Decision:
    """``decision`` or, with ``unseen`` concurrent decisions expected from other routers,
    the greedy sequence's place ``floor(draw * (1 + unseen))`` (``draw`` uniform in [0, 1)).
    A moved decision keeps the policy's figures for its new replica and says why."""
    if not unseen > 0 or not decision.scores:
        return decision
    place = min(int(draw * (1.0 + unseen)), MAX_PLACES - 1)
    if place == 0:
        return decision
    picks = greedy_picks(decision, place + 1)
    if not picks or picks[place] == decision.replica:
        return decision
    chosen = picks[place]
    score = decision.scores[chosen]
    deadline = score.get("deadline_s")
    priority = None if deadline is None else round(deadline * 1000.0)
    block_cached = score.get("expected_cached_tokens", 0.0)
    return Decision(
        chosen, SPREAD_BRANCH,
        f"{unseen:.2f} decisions expected from other routers within the booking lag: place "
        f"{place} of the {math.ceil(1 + unseen)} one router would have filled in turn "
        f"(replica {chosen}, cost {score['cost_s']:.3f} s) instead of replica "
        f"{decision.replica} ({decision.branch}: {decision.reason})",
        decision.scores, int(block_cached + 0.5), priority=priority)
