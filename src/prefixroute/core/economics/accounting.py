"""Exact trace-driven accounting of a provider prompt cache.

Replays requests in arrival order against one provider cache and bills every prompt token as
exactly one of three things, the way Anthropic-style usage fields do:

``written``  (``cache_creation_input_tokens``)
    tokens stored by this request, billed at the write multiplier ``w``;
``read``     (``cache_read_input_tokens``)
    tokens served from a live cache entry, billed at the read multiplier ``r``;
``uncached`` (``input_tokens``)
    the rest, billed at the base price.

``written + read + uncached == input_tokens`` for every request. Totals are kept per prefix
group (:attr:`Request.prefix_group`, or the request's first block key when it has none) and
reported beside the Poisson approximation for the same per-group rate, so a trace shows where
``1 - exp(-lambda*T)`` is right and where bursts, day/night cycles or growing
conversations make it wrong.

The cache
=========
A :class:`~prefixroute.core.caches.key_lru.KeyLRUCache` over the request's chained block keys
(one key per full block, from :mod:`prefixroute.core.simulator.keys`), with the policy's TTL and
``refresh_on_hit``: an entry at block position ``p`` stands for the whole prefix up to the end of
block ``p`` (chained keys make equal keys mean equal prefixes). Capacity is unlimited: provider
caches evict by TTL, and their capacity eviction is not observable from outside. Every entry on
the chain up to the position a request reads is refreshed by that read, since it is part of the
prefix the request used (each hit refreshes the TTL).

Where entries are written: two models
=====================================
``auto`` (OpenAI-style automatic prefix caching)
    every block boundary is a cache point: the longest live prefix is read, every block after it
    is written; no lookback limit.
breakpoints (Anthropic-style ``cache_control``)
    up to :data:`MAX_BREAKPOINTS` (4) breakpoints per request, each at a token position
    (:class:`Breakpoint`: ``end``, ``end-N``, ``static``, or an absolute ``N``). Entries are
    written only at breakpoints. To read, the system checks the breakpoint position and the
    :data:`DEFAULT_LOOKBACK_BLOCKS` (20) block boundaries before it for a live entry, from the
    last breakpoint backwards; the deepest live entry found is read. Every breakpoint beyond it
    is written, and the tokens from the read prefix to the last written breakpoint are billed as
    writes; tokens after the last breakpoint are uncached. A breakpoint inside the prefix that was
    read is recorded as an entry without a charge (its tokens were read; the provider holds
    them): our choice where the documentation is silent, and the one that keeps "a longer TTL
    never lowers the hits" true.

Both models share a minimum cacheable length (:data:`MIN_CACHEABLE_TOKENS` by model, default
:data:`DEFAULT_MIN_CACHEABLE_TOKENS`): a cache point shorter than that is never written or read
("shorter prompts cannot be cached, even if marked with cache_control").

Sources: Anthropic prompt caching documentation
(https://platform.claude.com/docs/en/build-with-claude/prompt-caching, formerly
docs.anthropic.com/en/docs/build-with-claude/prompt-caching): up to 4 breakpoints; the
"20-block lookback window" that checks at most 20 blocks before each explicit breakpoint and then
moves to the previous breakpoint; minimum cacheable lengths per model; usage fields
``cache_creation_input_tokens`` and ``cache_read_input_tokens``. Per-model minimums as tabulated
in LiteLLM's prompt-caching page (docs.litellm.ai/docs/completion/prompt_caching, Oct 2026).

What the model simplifies
=========================
* Anthropic's lookback counts *content blocks* (messages, tool definitions, text parts); we count
  the trace's blocks (16 tokens for token-id traces, 512 for Mooncake). Choose a trace block size
  close to your content-block size when the lookback matters.
* Breakpoint positions round down to a block boundary, so the last partial block before a
  breakpoint is billed as uncached (at most ``block_size - 1`` tokens per request).
* Storage (explicit cache objects) is billed per entry from its write to its expiry (last use
  plus TTL), for the tokens it added beyond the prefix it extends.

The failure this module exists to show (:func:`growing_conversation_demo`): a conversation whose
only breakpoint is at the end of its growing history. Once a turn adds more than 20 blocks, the
lookback from the new end no longer reaches the previous turn's write, so every turn writes the
whole conversation again at the write premium. A breakpoint at the end of the static region lets
every turn read it; one more at the end of the previous turn reads the history too.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from prefixroute.core.caches.key_lru import KeyLRUCache
from prefixroute.core.economics.formulas import (
    SECONDS_PER_HOUR,
    TOKENS_PER_MTOK,
    cost_multiplier,
    poisson_hit_probability,
    require_non_negative,
    storage_cost,
)
from prefixroute.core.economics.presets import FIVE_MINUTE, CachePolicy
from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.simulator.keys import BlockKeyer, prompt_block_count
from prefixroute.core.simulator.request import Request

MAX_BREAKPOINTS = 4  # Anthropic: "up to 4 cache breakpoints" per request
DEFAULT_LOOKBACK_BLOCKS = 20  # Anthropic: the 20-block lookback window
DEFAULT_MIN_CACHEABLE_TOKENS = 1024  # Anthropic Sonnet 4.x / Opus 4 / 4.1; OpenAI's threshold

# Minimum cacheable prompt length by model family (Anthropic-style; LiteLLM's table, Oct 2026).
# Names are families, not exact model ids; overridable everywhere by a number.
MIN_CACHEABLE_TOKENS: dict[str, int] = {
    "claude-opus-5": 512,
    "claude-sonnet-5": 1024,
    "claude-opus-4.8": 1024,
    "claude-sonnet-4": 1024,
    "claude-opus-4.1": 1024,
    "claude-opus-4": 1024,
    "claude-3": 1024,
    "claude-haiku-3.5": 2048,  # earlier Haiku models: 2,048
    "claude-haiku-4.5": 4096,
    "claude-opus-4.5": 4096,
    "claude-opus-4.6": 4096,
    "openai": 1024,
    "gemini": 1024,
}

_BREAKPOINT = re.compile(r"^(?:(end)(?:-(\d+))?|(static)|(\d+))$")


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """Where one ``cache_control`` marker sits in a request, as a rule over the request.

    ``end`` is the end of the prompt; ``end-N`` N tokens before it (``end-400`` is the end of
    the previous turn when each turn adds 400 tokens); ``static`` the end of the request's
    static region (:attr:`Request.prefix_tokens`; absent when the request does not know it);
    an absolute ``N`` the N-th token (clamped to the prompt).
    """

    kind: str  # "end", "static" or "absolute"
    tokens: int = 0  # end: tokens before the end; absolute: the position

    def position(self, request: Request) -> int | None:
        """The breakpoint's token position in ``request``, or ``None`` when it has none."""
        n = request.input_tokens
        if self.kind == "end":
            position = n - self.tokens
        elif self.kind == "static":
            position = request.prefix_tokens or 0
        else:
            position = self.tokens
        position = min(position, n)
        return position if position > 0 else None

    @property
    def spec(self) -> str:
        if self.kind == "end":
            return f"end-{self.tokens}" if self.tokens else "end"
        return "static" if self.kind == "static" else str(self.tokens)


def parse_breakpoints(text: str) -> tuple[Breakpoint, ...] | None:
    """``"auto"`` -> ``None`` (automatic prefix caching); else a comma-separated list of up to 4
    of ``end``, ``end-N``, ``static``, ``N``: e.g. ``"static,end"``."""
    text = text.strip()
    if text == "auto":
        return None
    items = [item.strip() for item in text.split(",")]
    if not text or not all(items):
        raise ConfigError(f"breakpoints {text!r}: expected 'auto' or a comma-separated list of "
                          f"end, end-N, static or a token position N")
    out = []
    for item in items:
        match = _BREAKPOINT.match(item)
        if not match:
            raise ConfigError(f"breakpoint {item!r}: expected end, end-N, static or a token "
                              f"position N (e.g. static,end or 10000,end)")
        end, before, static, absolute = match.groups()
        if end:
            out.append(Breakpoint("end", int(before or 0)))
        elif static:
            out.append(Breakpoint("static"))
        else:
            out.append(Breakpoint("absolute", int(absolute)))
    if len(out) > MAX_BREAKPOINTS:
        raise ConfigError(f"breakpoints {text!r}: at most {MAX_BREAKPOINTS} per request "
                          f"(Anthropic's limit), got {len(out)}")
    if len(set(out)) != len(out):
        raise ConfigError(f"breakpoints {text!r}: the same breakpoint is given twice")
    return tuple(out)


def min_cacheable_tokens(text: str | int) -> int:
    """A minimum cacheable length given as a number of tokens or a model family name."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        text = str(text).strip()
        if text in MIN_CACHEABLE_TOKENS:
            return MIN_CACHEABLE_TOKENS[text]
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"minimum cacheable tokens {text!r}: expected a number of tokens or "
                              f"a model family: {', '.join(MIN_CACHEABLE_TOKENS)}") from None
    if value < 0:
        raise ConfigError(f"minimum cacheable tokens must be non-negative, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class CacheModel:
    """How a provider decides what to cache: breakpoints (``None``: automatic prefix caching),
    how far each looks back, and the minimum cacheable length."""

    breakpoints: tuple[Breakpoint, ...] | None = None
    lookback_blocks: int = DEFAULT_LOOKBACK_BLOCKS
    min_cacheable_tokens: int = DEFAULT_MIN_CACHEABLE_TOKENS

    def __post_init__(self) -> None:
        if self.breakpoints is not None:
            if not self.breakpoints:
                raise ConfigError("a breakpoint model needs at least one breakpoint")
            if len(self.breakpoints) > MAX_BREAKPOINTS:
                raise ConfigError(f"at most {MAX_BREAKPOINTS} breakpoints per request, got "
                                  f"{len(self.breakpoints)}")
        if not isinstance(self.lookback_blocks, int) or self.lookback_blocks < 0:
            raise ConfigError(f"lookback must be a non-negative number of blocks, got "
                              f"{self.lookback_blocks!r}")
        if not isinstance(self.min_cacheable_tokens, int) or self.min_cacheable_tokens < 0:
            raise ConfigError(f"minimum cacheable tokens must be a non-negative integer, got "
                              f"{self.min_cacheable_tokens!r}")

    @classmethod
    def parse(cls, breakpoints: str = "auto", lookback_blocks: int = DEFAULT_LOOKBACK_BLOCKS,
              min_tokens: str | int = DEFAULT_MIN_CACHEABLE_TOKENS) -> "CacheModel":
        return cls(parse_breakpoints(breakpoints), lookback_blocks, min_cacheable_tokens(min_tokens))

    @property
    def spec(self) -> str:
        if self.breakpoints is None:
            return "auto"
        return ",".join(b.spec for b in self.breakpoints)

    def as_dict(self) -> dict:
        return {"breakpoints": self.spec,
                "lookback_blocks": None if self.breakpoints is None else self.lookback_blocks,
                "min_cacheable_tokens": self.min_cacheable_tokens}


@dataclass(frozen=True, slots=True)
class RequestCharge:
    """How one request's prompt tokens were billed; the three parts sum to ``input_tokens``."""

    request_id: str
    group: str
    input_tokens: int
    written_tokens: int
    read_tokens: int
    uncached_tokens: int

    def as_dict(self) -> dict:
        return {"request_id": self.request_id, "group": self.group,
                "input_tokens": self.input_tokens, "written_tokens": self.written_tokens,
                "read_tokens": self.read_tokens, "uncached_tokens": self.uncached_tokens}


@dataclass(slots=True)
class PrefixLedger:
    """Running totals for one prefix group (or the whole trace)."""

    requests: int = 0
    read_requests: int = 0  # requests that read anything from the cache
    input_tokens: int = 0
    written_tokens: int = 0
    read_tokens: int = 0
    uncached_tokens: int = 0
    storage_token_seconds: float = 0.0
    # Tokens every request of the group shares (their longest common block-aligned prefix):
    # the "prefix" of the cost formulas, and what the Poisson approximation prices.
    shared_tokens: int = 0

    def add(self, charge: RequestCharge) -> None:
        self.requests += 1
        self.read_requests += charge.read_tokens > 0
        self.input_tokens += charge.input_tokens
        self.written_tokens += charge.written_tokens
        self.read_tokens += charge.read_tokens
        self.uncached_tokens += charge.uncached_tokens

    @property
    def cacheable_tokens(self) -> int:
        """Tokens billed as a write or a read: the part the cache policy prices."""
        return self.written_tokens + self.read_tokens

    @property
    def token_hit_rate(self) -> float | None:
        """Read tokens over cacheable tokens: the ``h`` of the cost formulas for this
        prefix."""
        return self.read_tokens / self.cacheable_tokens if self.cacheable_tokens else None

    @property
    def request_hit_rate(self) -> float | None:
        """Requests that read from the cache: what the Poisson P(hit) predicts."""
        return self.read_requests / self.requests if self.requests else None


@dataclass(slots=True)
class _EntryLife:
    """One cache entry between its write and its expiry, for storage billing."""

    group: str
    tokens: int  # tokens it adds beyond the prefix it extends
    born: float
    last_use: float


class ProviderCacheReplay:
    """One provider cache replaying requests in arrival order (see the module docstring).

    :meth:`charge` bills one request; :meth:`result` returns the totals so far.
    """

    def __init__(self, policy: CachePolicy = FIVE_MINUTE, model: CacheModel = CacheModel(),
                 keyer: BlockKeyer | None = None):
        self.policy = policy
        self.model = model
        self.keyer = keyer or BlockKeyer()
        self.cache = KeyLRUCache(capacity=sys.maxsize, ttl=policy.ttl_seconds,
                                 refresh_on_hit=True)
        self.groups: dict[str, PrefixLedger] = {}
        self.total = PrefixLedger()
        self.block_size: int | None = None
        self.first_arrival: float | None = None
        self.last_arrival: float | None = None
        self._lives: dict[Hashable, _EntryLife] = {}
        self._last_sweep = -math.inf
        self._shared_keys: dict[str, list] = {}  # per group: the keys all its requests share

    # -- one request ----------------------------------------------------------------------------
    def charge(self, request: Request) -> RequestCharge:
        now = request.arrival_s
        if self.last_arrival is not None and now < self.last_arrival:
            raise InputError(f"request {request.request_id!r} arrives at {now:g} s, before the "
                             f"previous request ({self.last_arrival:g} s)",
                             where=request.request_id, field="arrival_s")
        if self.block_size is None:
            self.block_size = request.block_size
        elif request.block_size != self.block_size:
            raise InputError(f"request {request.request_id!r} has block size "
                             f"{request.block_size}, the trace {self.block_size}: one replay "
                             f"needs one block size", where=request.request_id,
                             field="block_size")
        if self.first_arrival is None:
            self.first_arrival = now
        self.last_arrival = now
        self._sweep(now)
        if not request.block_keys and (request.token_ids is not None
                                       or request.hash_ids is not None):
            self.keyer.fill(request)  # (empty keys with no tokens left: hashed, no full block)
        block = request.block_size
        keys = request.block_keys[:prompt_block_count(request)]
        group = request.prefix_group or _group_of(keys)
        # Cache points shorter than the minimum are never written or read.
        lowest = max(1, -(-self.model.min_cacheable_tokens // block))
        if self.model.breakpoints is None:
            read_upto = self._deepest_live(keys, len(keys), lowest, now, limit=None)
            writes = list(range(max(read_upto + 1, lowest), len(keys) + 1))
        else:
            positions = sorted({min(p // block, len(keys)) for p in
                                (b.position(request) for b in self.model.breakpoints)
                                if p is not None})
            positions = [p for p in positions if p >= lowest]
            read_upto = 0
            for position in reversed(positions):  # from the last breakpoint backwards
                read_upto = self._deepest_live(keys, position, lowest, now,
                                               limit=self.model.lookback_blocks)
                if read_upto:
                    break
            writes = [p for p in positions if p > read_upto]
        for position in range(lowest, read_upto + 1):  # the read refreshes its whole chain
            if self.cache.lookup(keys[position - 1], now):
                life = self._lives.get(keys[position - 1])
                if life is not None:
                    life.last_use = now
        if self.model.breakpoints is not None:
            # A breakpoint inside the prefix just read becomes an entry at no charge: its tokens
            # were read and the provider holds them. So every breakpoint of a request leaves a
            # live entry, whatever was read, and a longer TTL never loses a later hit.
            for position in positions:
                if position <= read_upto and not self.cache.peek(keys[position - 1], now):
                    self._write(keys[position - 1], group, 0, now)
        previous = read_upto
        for position in writes:
            self._write(keys[position - 1], group, (position - previous) * block, now)
            previous = position
        read = read_upto * block
        written = (writes[-1] - read_upto) * block if writes else 0
        result = RequestCharge(request.request_id, group, request.input_tokens, written, read,
                               request.input_tokens - read - written)
        ledger = self.groups.get(group)
        if ledger is None:
            ledger = self.groups[group] = PrefixLedger()
        ledger.add(result)
        self.total.add(result)
        ledger.shared_tokens = self._shared_blocks(group, keys) * block
        return result

    def _shared_blocks(self, group: str, keys: Sequence[Hashable]) -> int:
        shared = self._shared_keys.get(group)
        if shared is None:
            self._shared_keys[group] = list(keys)
            return len(keys)
        n = min(len(shared), len(keys))
        common = 0
        while common < n and shared[common] == keys[common]:
            common += 1
        del shared[common:]
        return common

    def _deepest_live(self, keys: Sequence[Hashable], top: int, lowest: int, now: float,
                      limit: int | None) -> int:
        """The deepest position in ``[top - limit, top]`` (all the way down when ``limit`` is
        None) whose entry is live, or 0."""
        bottom = lowest if limit is None else max(lowest, top - limit)
        peek = self.cache.peek
        for position in range(top, bottom - 1, -1):
            if peek(keys[position - 1], now):
                return position
        return 0

    def _write(self, key: Hashable, group: str, tokens: int, now: float) -> None:
        old = self._lives.pop(key, None)
        if old is not None:
            self._close(old)
        self.cache.put(key, now)
        self._lives[key] = _EntryLife(group, tokens, now, now)

    def _close(self, life: _EntryLife) -> None:
        seconds = life.last_use + self.policy.ttl_seconds - life.born
        self.groups[life.group].storage_token_seconds += life.tokens * seconds
        self.total.storage_token_seconds += life.tokens * seconds

    def _sweep(self, now: float) -> None:
        """Drop entries that expired (at most once per TTL: memory stays bounded by the
        entries written in about two TTLs)."""
        ttl = self.policy.ttl_seconds
        if now - self._last_sweep < ttl:
            return
        self._last_sweep = now
        self.cache.expire(now)
        dead = [key for key, life in self._lives.items() if life.last_use + ttl <= now]
        for key in dead:
            self._close(self._lives.pop(key))

    # -- totals ---------------------------------------------------------------------------------
    def result(self) -> "TraceAccounting":
        """Totals so far; entries still alive are billed storage up to their expiry."""
        groups = {name: _copy(ledger) for name, ledger in self.groups.items()}
        total = _copy(self.total)
        ttl = self.policy.ttl_seconds
        for life in self._lives.values():
            seconds = life.last_use + ttl - life.born
            groups[life.group].storage_token_seconds += life.tokens * seconds
            total.storage_token_seconds += life.tokens * seconds
        return TraceAccounting(self.policy, self.model, self.block_size or 0,
                               self.first_arrival or 0.0, self.last_arrival or 0.0, groups, total)


def _copy(ledger: PrefixLedger) -> PrefixLedger:
    return PrefixLedger(ledger.requests, ledger.read_requests, ledger.input_tokens,
                        ledger.written_tokens, ledger.read_tokens, ledger.uncached_tokens,
                        ledger.storage_token_seconds, ledger.shared_tokens)


def _group_of(keys: Sequence[Hashable]) -> str:
    """A request without a named prefix group is grouped by its first block key."""
    if not keys:
        return "(shorter than one block)"
    key = keys[0]
    if isinstance(key, int):
        return f"block:{key % (1 << 48):012x}"
    return f"block:{str(key)[:12]}"


# -- the report ---------------------------------------------------------------------------------
def ledger_costs(ledger: PrefixLedger, policy: CachePolicy, price_per_mtok: float) -> dict:
    """Exact cost of ``ledger`` under ``policy`` (the replay's own figures, no model)."""
    price = require_non_negative("price per million input tokens", price_per_mtok)
    w, r = policy.write_multiplier, policy.read_multiplier
    per_token = price / TOKENS_PER_MTOK
    storage_usd = storage_cost(ledger.storage_token_seconds / SECONDS_PER_HOUR,
                               policy.storage_usd_per_mtok_hour, 1.0)
    cacheable = ledger.cacheable_tokens
    usd = per_token * (ledger.written_tokens * w + ledger.read_tokens * r
                       + ledger.uncached_tokens) + storage_usd
    return {
        "requests": ledger.requests,
        "read_requests": ledger.read_requests,
        "input_tokens": ledger.input_tokens,
        "written_tokens": ledger.written_tokens,
        "read_tokens": ledger.read_tokens,
        "uncached_tokens": ledger.uncached_tokens,
        "shared_prefix_tokens": ledger.shared_tokens,
        "token_hit_rate": ledger.token_hit_rate,
        "request_hit_rate": ledger.request_hit_rate,
        "storage_token_hours": ledger.storage_token_seconds / SECONDS_PER_HOUR,
        "storage_usd": storage_usd,
        "cache_multiplier": ((ledger.written_tokens * w + ledger.read_tokens * r) / cacheable)
        if cacheable else None,
        "input_multiplier": usd / (per_token * ledger.input_tokens)
        if ledger.input_tokens and price else None,
        "usd": usd,
        "no_cache_usd": per_token * ledger.input_tokens,
    }


def poisson_costs(ledger: PrefixLedger, policy: CachePolicy, price_per_mtok: float,
                  duration_s: float, min_tokens: int) -> dict:
    """The Poisson approximation for one prefix group, priced like the exact replay.

    The group's rate is ``requests / duration`` (the whole trace's span); each request reads the
    group's shared prefix with P(hit) = 1 - exp(-rate x TTL) and writes the rest of the tokens
    the replay found cacheable; uncached tokens are the replay's. So the two columns differ only
    where the Poisson assumptions do (bursts, day/night, breakpoints that miss, prefixes that
    are not shared). ``multiplier`` is the result on the cacheable tokens; ``prefix_multiplier``
    is ``h*r + (1-h)*w`` itself. ``None`` throughout when the trace spans no time.
    """
    none = {"requests_per_hour": None, "p_hit": None, "prefix_multiplier": None,
            "read_tokens": None, "multiplier": None, "usd": None}
    if duration_s <= 0 or not ledger.requests:
        return none
    w, r = policy.write_multiplier, policy.read_multiplier
    per_token = require_non_negative("price per million input tokens", price_per_mtok) \
        / TOKENS_PER_MTOK
    rate = ledger.requests / (duration_s / SECONDS_PER_HOUR)
    p_hit = poisson_hit_probability(rate, policy.ttl_seconds)
    cacheable = ledger.cacheable_tokens
    shared = ledger.shared_tokens if ledger.shared_tokens >= max(1, min_tokens) else 0
    read = min(float(cacheable), p_hit * ledger.requests * shared)
    written = cacheable - read
    # Explicit objects: one per group, alive a fraction P(hit) of the time (Poisson arrivals see
    # time averages), holding the shared prefix.
    storage = storage_cost(shared, policy.storage_usd_per_mtok_hour,
                           duration_s / SECONDS_PER_HOUR * p_hit)
    return {
        "requests_per_hour": rate,
        "p_hit": p_hit,
        "prefix_multiplier": cost_multiplier(p_hit, w, r),
        "read_tokens": read,
        "multiplier": (read * r + written * w) / cacheable if cacheable else None,
        "usd": per_token * (read * r + written * w + ledger.uncached_tokens) + storage,
    }


@dataclass(slots=True)
class TraceAccounting:
    """A whole replay: per-group ledgers, the total, and the span of arrivals."""

    policy: CachePolicy
    model: CacheModel
    block_size: int
    first_arrival_s: float
    last_arrival_s: float
    groups: dict[str, PrefixLedger] = field(default_factory=dict)
    total: PrefixLedger = field(default_factory=PrefixLedger)

    @property
    def duration_s(self) -> float:
        return self.last_arrival_s - self.first_arrival_s

    def as_dict(self, price_per_mtok: float) -> dict:
        """JSON-ready: ``policy``, ``model``, ``duration_s``, ``totals`` and ``groups`` (each
        with the exact figures and a ``poisson`` block), groups by input tokens, largest first.
        The totals' Poisson figures are sums over the groups, each at its own rate."""
        duration = self.duration_s
        minimum = self.model.min_cacheable_tokens
        ordered = sorted(self.groups.items(), key=lambda item: (-item[1].input_tokens, item[0]))
        groups = {}
        for name, ledger in ordered:
            groups[name] = ledger_costs(ledger, self.policy, price_per_mtok)
            groups[name]["poisson"] = poisson_costs(ledger, self.policy, price_per_mtok,
                                                    duration, minimum)
        totals = ledger_costs(self.total, self.policy, price_per_mtok)
        totals["poisson"] = _sum_poisson(list(groups.values()), self.total, self.policy)
        return {
            "policy": self.policy.as_dict(),
            "model": self.model.as_dict(),
            "block_size": self.block_size,
            "duration_s": duration,
            "price_per_mtok": price_per_mtok,
            "totals": totals,
            "groups": groups,
        }


def _sum_poisson(groups: list[dict], total: PrefixLedger, policy: CachePolicy) -> dict:
    if not groups or any(g["poisson"]["usd"] is None for g in groups):
        return {"p_hit": None, "read_tokens": None, "multiplier": None, "usd": None}
    read = sum(g["poisson"]["read_tokens"] for g in groups)
    cacheable = total.cacheable_tokens
    w, r = policy.write_multiplier, policy.read_multiplier
    return {
        "p_hit": sum(g["poisson"]["p_hit"] * g["requests"] for g in groups) / total.requests,
        "read_tokens": read,
        "multiplier": (read * r + (cacheable - read) * w) / cacheable if cacheable else None,
        "usd": sum(g["poisson"]["usd"] for g in groups),
    }


def account_trace(requests: Iterable[Request], policy: CachePolicy = FIVE_MINUTE,
                  model: CacheModel = CacheModel(), keyer: BlockKeyer | None = None,
                  limit: int | None = None) -> TraceAccounting:
    """Replay ``requests`` (any simulator workload or trace reader) through one provider cache."""
    return account_policies(requests, (policy,), model, keyer, limit)[policy.name]


def account_policies(requests: Iterable[Request], policies: Sequence[CachePolicy],
                     model: CacheModel = CacheModel(), keyer: BlockKeyer | None = None,
                     limit: int | None = None,
                     progress: Callable[[int], None] | None = None) -> dict[str, TraceAccounting]:
    """One pass over ``requests``, one provider cache per policy (keys are hashed once and
    token ids dropped after, so a long trace streams in bounded memory)."""
    if not policies:
        raise ConfigError("no cache policy to account for")
    names = [policy.name for policy in policies]
    if len(set(names)) != len(names):
        raise ConfigError(f"cache policy names must be unique, got {', '.join(names)}")
    keyer = keyer or BlockKeyer()
    replays = [ProviderCacheReplay(policy, model, keyer) for policy in policies]
    count = 0
    for request in requests:
        if limit is not None and count >= limit:
            break
        if not request.block_keys:
            keyer.fill(request)
        request.token_ids = None
        request.output_token_ids = None
        for replay in replays:
            replay.charge(request)
        count += 1
        if progress is not None and count % 1000 == 0:
            progress(count)
    if count == 0:
        raise InputError("the trace has no requests")
    return {replay.policy.name: replay.result() for replay in replays}


# -- the growing-conversation failure and its fix -----------------------------------------------
GROWING_LAYOUTS: dict[str, str] = {
    "end": "only breakpoint at the end of the growing history (the failure)",
    "static,end": "a breakpoint at the end of the static region too (the fix)",
}


def growing_conversation_demo(turns: int = 6, system_tokens: int = 2048, user_tokens: int = 100,
                              reply_tokens: int = 300, block_size: int = 16,
                              policy: CachePolicy = FIVE_MINUTE,
                              lookback_blocks: int = DEFAULT_LOOKBACK_BLOCKS,
                              min_tokens: int = DEFAULT_MIN_CACHEABLE_TOKENS,
                              price_per_mtok: float = 3.0) -> dict:
    """One conversation behind a ``system_tokens`` static region, each turn adding a reply and a
    user message, replayed under three breakpoint layouts:

    * ``end``: the only breakpoint at the end of the history. Each turn grows by
      ``user + reply`` tokens; once that is more than ``lookback_blocks`` blocks, the lookback
      misses the previous write and every turn writes everything again;
    * ``static,end``: the fix: the static region is read by every turn after the first;
    * ``static,end-G,end`` (G = the growth per turn): also a breakpoint at the end of the
      previous turn, so the history is read too and each turn writes only what it added.

    Requests come from :func:`~prefixroute.core.simulator.generators.conversations` with fixed
    sizes (one session, think time well inside the TTL).
    """
    from prefixroute.core.simulator.generators import conversations

    growth = user_tokens + reply_tokens
    layouts = dict(GROWING_LAYOUTS)
    layouts[f"static,end-{growth},end"] = ("a breakpoint at the end of the previous turn as well "
                                          "(the history is read too)")
    out: dict = {"inputs": {"turns": turns, "system_tokens": system_tokens,
                            "user_tokens": user_tokens, "reply_tokens": reply_tokens,
                            "growth_tokens_per_turn": growth,
                            "growth_blocks_per_turn": growth / block_size,
                            "block_size": block_size, "lookback_blocks": lookback_blocks,
                            "min_cacheable_tokens": min_tokens, "policy": policy.name,
                            "price_per_mtok": price_per_mtok},
                 "layouts": {}}
    think = min(10.0, policy.ttl_seconds / 30)
    for spec, meaning in layouts.items():
        requests = conversations(sessions=1, turns=turns, system_tokens=system_tokens,
                                 user_tokens_min=user_tokens, user_tokens_max=user_tokens,
                                 reply_tokens_min=reply_tokens, reply_tokens_max=reply_tokens,
                                 think_time_s=think, block_size=block_size)
        replay = ProviderCacheReplay(policy, CacheModel(parse_breakpoints(spec), lookback_blocks,
                                                        min_tokens))
        charges = [replay.charge(request) for request in requests]
        costs = ledger_costs(replay.result().total, policy, price_per_mtok)
        out["layouts"][spec] = {
            "meaning": meaning,
            "written_by_turn": [c.written_tokens for c in charges],
            "read_by_turn": [c.read_tokens for c in charges],
            "uncached_by_turn": [c.uncached_tokens for c in charges],
            "input_tokens": costs["input_tokens"],
            "written_tokens": costs["written_tokens"],
            "read_tokens": costs["read_tokens"],
            "uncached_tokens": costs["uncached_tokens"],
            "input_multiplier": costs["input_multiplier"],
            "usd": costs["usd"],
            "no_cache_usd": costs["no_cache_usd"],
        }
    return out
