"""``consistent_hash``: a hash ring with virtual nodes, with bounded loads.

Each replica owns ``virtual_nodes`` points on a 64-bit ring; a request's key hashes to a point
and goes to the owner of the next point clockwise (Karger et al. 1997). Sessions stick to one
replica, so a conversation's growing prefix stays in one cache; when a replica leaves the
candidate set only the keys it owned move, and they spread over the others (the property
``prefix_hash``'s modulo lacks).

Bounded loads (Mirrokni, Thorup and Zadimoghaddam, *Consistent Hashing with Bounded Loads*,
SODA 2018): with ``m`` requests in flight over ``n`` candidates, no replica may hold more than
``ceil(c * (m + 1) / n)`` including the new one; the walk goes clockwise past full replicas to
the first one with room. Since ``c >= 1`` some replica always has room, and a key moves away
from its home only while that home is full.

The key, in order: ``request.routing_key`` (a session id or ``prompt_cache_key``, as the vLLM
router reads ``X-Session-ID`` / ``user`` first), else the first block key (requests sharing a
first block, e.g. a system prompt, stay together), else the first block's worth of token ids,
else the request id (no affinity possible).

Parameters:

``virtual_nodes`` (default 160)
    ring points per replica: the vLLM router's ``consistent_hash`` uses 160, the Ketama
    convention; more points spread keys more evenly (std dev of a replica's share falls as
    ``1/sqrt(points)``).
``capacity_factor`` (default 1.25)
    ``c = 1 + epsilon`` of bounded loads; 1.25 (epsilon = 0.25) is the ``load_factor`` default
    of the SGLang model gateway's ring-based ``prefix_hash`` (a replica may take 125% of the
    mean). Smaller keeps loads tighter and moves more keys off their home; must be >= 1.
``bounded`` (default true)
    false gives the plain ring (a hot key makes a hot replica).

Ring points hash ``"<name or index>#<v>"`` with MD5 (first 8 bytes, big-endian), so a
replica's points depend on it alone and stay the same in every process. Load is
:attr:`ReplicaView.load`.
"""

from __future__ import annotations

import bisect
import hashlib
from fractions import Fraction
from typing import Hashable, Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import stable_key_bytes
from prefixroute.core.routing.registry import register


def ring_point(raw: bytes) -> int:
    """A 64-bit ring position: the first 8 bytes of MD5, big-endian."""
    return int.from_bytes(hashlib.md5(raw, usedforsecurity=False).digest()[:8], "big")


class HashRing:
    """Sorted virtual-node points of one candidate set; each point names its replica index."""

    def __init__(self, members: Sequence[tuple[int, str]], virtual_nodes: int) -> None:
        points = []
        for index, ident in members:
            for v in range(virtual_nodes):
                points.append((ring_point(f"{ident}#{v}".encode("utf-8")), index))
        points.sort()
        self._positions = [p for p, _ in points]
        self._owners = [i for _, i in points]

    def walk(self, point: int):
        """Replica indices clockwise from ``point``, each once."""
        start = bisect.bisect_left(self._positions, point)
        seen: set[int] = set()
        n = len(self._owners)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner


@register("consistent_hash")
class ConsistentHash(BasePolicy):
    def __init__(self, virtual_nodes: int = 160, capacity_factor: float = 1.25,
                 bounded: bool = True) -> None:
        if not isinstance(virtual_nodes, int) or virtual_nodes < 1:
            raise ConfigError(f"virtual_nodes must be a positive integer, got {virtual_nodes!r}")
        if capacity_factor < 1:
            raise ConfigError(f"capacity_factor must be at least 1 (bounded loads need c >= 1 "
                              f"so some replica has room), got {capacity_factor!r}")
        self.virtual_nodes = virtual_nodes
        self.capacity_factor = capacity_factor
        self.bounded = bounded
        # Exact arithmetic for ceil(c * (m + 1) / n): 1.25 * 8 / 4 must be 2.5, not 2.5000001.
        self._c = Fraction(capacity_factor).limit_denominator(10**6)
        self._rings: dict[tuple[tuple[int, str], ...], HashRing] = {}

    def _ring(self, replicas: Sequence[ReplicaView]) -> HashRing:
        members = tuple(sorted((r.index, r.name or str(r.index)) for r in replicas))
        ring = self._rings.get(members)
        if ring is None:
            if len(self._rings) >= 64:  # candidate sets churn only with health changes
                self._rings.clear()
            ring = self._rings[members] = HashRing(members, self.virtual_nodes)
        return ring

    @staticmethod
    def routing_key(request: RequestView) -> tuple[Hashable, str]:
        """The key a request hashes on, and where it came from."""
        if request.routing_key:
            return request.routing_key, "routing_key"
        if request.block_keys:
            return request.block_keys[0], "first_block_key"
        if request.token_ids:
            return tuple(request.token_ids[:request.block_size]), "first_block_tokens"
        return request.request_id, "request_id"

    def capacity(self, replicas: Sequence[ReplicaView]) -> int:
        """Most requests a replica may hold once this one is added: ``ceil(c * (m + 1) / n)``."""
        total = sum(r.load for r in replicas)
        bound = self._c * (total + 1) / len(replicas)
        return -(-bound.numerator // bound.denominator)

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        key, source = self.routing_key(request)
        point = ring_point(stable_key_bytes(key))
        by_index = {r.index: r for r in replicas}
        walk = self._ring(replicas).walk(point)
        home = next(walk)
        if not self.bounded:
            return Decision(home, "ring", f"{source} hashes to replica {home}",
                            {home: {"load": float(by_index[home].load)}})
        limit = self.capacity(replicas)
        scores = {}
        skipped = []
        owner = home
        while True:
            load = by_index[owner].load
            scores[owner] = {"load": float(load), "capacity": float(limit)}
            if load + 1 <= limit:
                break
            skipped.append(owner)
            owner = next(walk)  # c >= 1 guarantees someone has room before the walk ends
        if not skipped:
            return Decision(owner, "ring", f"{source} hashes to replica {owner} "
                            f"(load {by_index[owner].load} < capacity {limit})", scores)
        return Decision(owner, "bounded_walk",
                        f"{source} hashes to replica {home}; replicas "
                        f"{', '.join(map(str, skipped))} full at capacity {limit}: "
                        f"replica {owner}", scores)
