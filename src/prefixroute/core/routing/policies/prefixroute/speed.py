"""The prefill speed the policy prices work at: seconds per token-equivalent, per kind of
replica, learned within a band around an anchor.

The anchor is the speed the runner states for a replica (an engine profile, ``prefixroute
calibrate``'s ``prefill_s_per_token``), else the policy's ``prefill_s_per_token``. A replica
whose speed is stated keeps it. Where none is stated (the gateway before calibration) the
policy learns it from what it sees: busy seconds over the predicted work done in them
(:meth:`PrefillQueue.observe`).

What that ratio measures is not only prefill. Behind a gateway a prefill is pending from
dispatch to the first streamed byte: the engine's fixed work per request (API server,
tokenizer, scheduling), the steps that decode other requests, and on a loaded machine the
wait for a CPU all end up in it, so the ratio heads for the run's duration over the work
routed, tens of times the engine's speed. A replica that serves mostly cache hits, a small
predicted work with the same fixed latency, climbs fastest, so left to itself each replica's
ratio drifts apart from the others' and every cost on the slower-looking one grows with it
(measured on real vLLM in ``docs/real-engines.md``).

Two invariants keep the estimate a property of the engine rather than of the traffic:

* **One estimate per kind of replica.** Replicas with the same anchor that learn share one
  estimate (busy seconds and work summed over all of them), so their speeds cannot drift
  apart; a fleet of different engines states each one's speed (``prefixroute calibrate``
  per backend).
* **Bounded.** The value stays within :data:`SPEED_BAND` times the anchor either way (2:
  one engine's calibrated speed moved 3.3x between an idle and a loaded machine, 10 and 33
  us per token, so 2x around a middle covers it), so queueing and machine noise can scale
  the costs by at most that much, alike on every replica of the kind.

The prior counts as ``prior_work`` token-equivalents done at the anchor, and both sums forget
``forget`` per observation (:class:`PrefixRouteParams`).
"""

from __future__ import annotations

SPEED_BAND = 2.0  # a learned speed stays within this factor of its anchor, either way


class SpeedEstimate:
    """Seconds per token-equivalent for one kind of replica."""

    __slots__ = ("anchor", "band", "learns", "elapsed_s", "done_work")

    def __init__(self, anchor: float, prior_work: float, learns: bool,
                 band: float = SPEED_BAND) -> None:
        self.anchor = anchor
        self.band = band
        self.learns = learns
        self.elapsed_s = anchor * prior_work
        self.done_work = prior_work

    @property
    def value(self) -> float:
        if not self.learns:
            return self.anchor
        raw = self.elapsed_s / self.done_work
        return min(max(raw, self.anchor / self.band), self.anchor * self.band)

    @property
    def unbounded(self) -> float:
        """The ratio learned before the band (the decision logs show it)."""
        return self.elapsed_s / self.done_work

    def learn(self, elapsed_s: float, done_work: float, forget: float) -> None:
        """A replica of this kind stayed busy ``elapsed_s`` and did ``done_work``."""
        if self.learns:
            self.elapsed_s = self.elapsed_s * forget + elapsed_s
            self.done_work = self.done_work * forget + done_work
