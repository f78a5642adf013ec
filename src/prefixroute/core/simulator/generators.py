"""Workload generators: pure, seeded, token-level request streams.

Each generator yields :class:`~prefixroute.core.simulator.request.Request` objects in arrival
order with real token ids (``array('I')``), so keys come from the one hashing module. Token
ids are drawn from disjoint ranges (:class:`TokenSpace`), so two pieces of text share tokens
only when the scenario says they are the same text.

Scenarios (the worked examples and the design scenario of docs/concepts.md):

* :func:`five_turn_conversation`: example 1, one conversation growing over 5 turns;
* :func:`universal_prefix`: example 2, 50 requests behind one 200-token system prompt;
* :func:`skewed_trace`: example 3, prefix families A=1000, B=800, C=600, D=400 tokens
  arriving ``AABACABDAACBADABCABA`` (optionally with a burst of a hot prefix E);
* :func:`seed_fleet`: example 4, a 1,200-token system prompt, one of 8 tenants'
  800-token documents and 60 user tokens, with the example's exact random stream;
* :func:`design_scenario`: the design scenario, 200 tenants x 10,000-token prefixes, Zipf-skewed
  popularity, one hot tenant, 50,000 requests/day (compressible), optionally a timestamp at
  the top of every prompt;
* :func:`conversations`: many concurrent sessions whose prompts grow turn by turn;
* :func:`hot_burst`: steady traffic over a few prefix families plus bursts of one hot prefix;
* :func:`with_prefixes`: arrival/length shapes (the Azure traces) given prefix families.

:data:`WORKLOADS` names them for the CLI (``--workload NAME[:key=value,...]``).
"""

from __future__ import annotations

import bisect
import heapq
import inspect
import itertools
import math
import random
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.identity import DEFAULT_IDENTITY, CacheIdentity
from prefixroute.core.simulator.keys import MAX_BLOCK_ID
from prefixroute.core.simulator.request import Request

if TYPE_CHECKING:
    import numpy as np


class TokenSpace:
    """Hands out token ids from disjoint ranges: fixed text gets stable ids, fresh text new
    ones. Ids start at 1 and stay below 2**32 (the hashing packs them as uint32)."""

    def __init__(self) -> None:
        self._next = 1

    def fresh(self, n: int) -> array:
        start = self._next
        self._next += n
        if self._next >= 1 << 32:
            raise ConfigError("workload too large: token ids exceed 32 bits")
        return array("I", range(start, start + n))

    def reserve(self, n: int) -> int:
        """Set aside ``n`` ids (returned: the first) without materialising them."""
        start = self._next
        self._next += n
        if self._next >= 1 << 32:
            raise ConfigError("workload too large: token ids exceed 32 bits")
        return start


class Vocabulary:
    """Token strings to ids, a new id for each new string (the fleet hit-rate example's tokens
    are strings; the hashing wants ints)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def ids(self, tokens: Iterable[str]) -> array:
        table = self._ids
        setdefault = table.setdefault
        # A new string gets len + 1 as it is inserted, so ids stay dense and unique.
        return array("I", [setdefault(token, len(table) + 1) for token in tokens])

    def __len__(self) -> int:
        return len(self._ids)


def _poisson_arrivals(rng: random.Random, rate: float, n: int, start: float = 0.0) -> list[float]:
    if rate <= 0:
        raise ConfigError(f"arrival rate must be positive, got {rate!r}")
    t = start
    out = []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value is None or value <= 0:
            raise ConfigError(f"{name} must be positive, got {value!r}")


# -- example 1: five-turn conversation ------------------------------------------------------------
def five_turn_conversation(prompts: Sequence[int] = (400, 700, 1000, 1400, 1700),
                           replies: Sequence[int] = (100, 100, 150, 100, 100),
                           gap_s: float = 60.0, block_size: int = 16,
                           identity: CacheIdentity = DEFAULT_IDENTITY) -> Iterator[Request]:
    """One conversation: turn k's prompt is turn k-1's prompt, its reply, and new user text.

    The replies are known, so decode blocks get keys (the last sampled token has no KV:
    reuse by turn 0, 496, 784, 1136, 1488 with 16-token blocks on one replica).
    """
    space = TokenSpace()
    sequence = array("I")
    for turn, prompt_len in enumerate(prompts):
        if prompt_len <= len(sequence):
            raise ConfigError(f"turn {turn + 1}: prompt of {prompt_len} tokens must extend the "
                              f"previous {len(sequence)} tokens")
        sequence = sequence + space.fresh(prompt_len - len(sequence))
        reply = space.fresh(replies[turn] if turn < len(replies) else 1)
        yield Request(f"conv-t{turn + 1}", turn * gap_s, len(sequence), len(reply), block_size,
                      token_ids=sequence, identity=identity, session="conv", turn=turn,
                      output_token_ids=reply)
        sequence = sequence + reply


# -- example 2: universal prefix ------------------------------------------------------------------
def universal_prefix(requests: int = 50, prefix_tokens: int = 200, user_tokens: int = 40,
                     output_tokens: int = 32, rate: float = 5.0, block_size: int = 16,
                     seed: int = 0) -> Iterator[Request]:
    """``requests`` requests behind one shared system prompt, each with its own user text."""
    _check_positive(requests=requests, prefix_tokens=prefix_tokens, rate=rate)
    rng = random.Random(f"universal-prefix/{seed}")
    space = TokenSpace()
    system = space.fresh(prefix_tokens)
    for i, arrival in enumerate(_poisson_arrivals(rng, rate, requests)):
        tokens = system + space.fresh(user_tokens)
        yield Request(f"up-{i}", arrival, len(tokens), output_tokens, block_size,
                      token_ids=tokens, prefix_group="system", prefix_tokens=prefix_tokens)


# -- example 3: skewed routing trace --------------------------------------------------------------
SKEWED_FAMILIES = {"A": 1000, "B": 800, "C": 600, "D": 400}
SKEWED_ARRIVALS = "AABACABDAACBADABCABA"


def skewed_trace(arrivals: str = SKEWED_ARRIVALS, hot_burst: int = 0, hot_tokens: int = 1200,
                 user_tokens: int = 16, output_tokens: int = 16, gap_s: float = 1.0,
                 block_size: int = 16) -> Iterator[Request]:
    """Prefix families A..D (and a hot E of ``hot_tokens``, ``hot_burst`` requests appended)
    arriving one per ``gap_s`` in the order of ``arrivals``."""
    space = TokenSpace()
    families = dict(SKEWED_FAMILIES)
    if hot_burst:
        families["E"] = hot_tokens
    prefixes = {name: space.fresh(length) for name, length in families.items()}
    order = arrivals + "E" * hot_burst
    for i, family in enumerate(order):
        if family not in prefixes:
            raise ConfigError(f"unknown prefix family {family!r}; families: "
                              f"{', '.join(prefixes)}")
        tokens = prefixes[family] + space.fresh(user_tokens)
        yield Request(f"skew-{i}", i * gap_s, len(tokens), output_tokens, block_size,
                      token_ids=tokens, tenant=family, prefix_group=family,
                      prefix_tokens=families[family])


# -- example 4: fleet hit rates -------------------------------------------------------------------
FLEET_TENANTS = "ABCDEFGH"
FLEET_SYSTEM_TOKENS = 1200
FLEET_DOCUMENT_TOKENS = 800
FLEET_USER_TOKENS = 60
# The example leaves the static text open; ours is s0..s1199 and tenant T's document T0..T799.
# With these strings the MD5 prefix-aware routing spreads the 8 tenants 2-2-2-2 over the 4
# replicas, so every replica warms up once: 96.82% (a layout that left one replica empty
# would give 96.84%; both print as the example's 96.8%).
FLEET_SYSTEM = tuple(f"s{i}" for i in range(FLEET_SYSTEM_TOKENS))
FLEET_DOCUMENTS = {t: tuple(f"{t}{i}" for i in range(FLEET_DOCUMENT_TOKENS))
                   for t in FLEET_TENANTS}


@dataclass(slots=True)
class FleetPrompt:
    """One fleet hit-rate example prompt: ``[head] + system + document[tenant] + user``."""

    tenant: str
    user: list[str]
    head: str | None = None

    def tokens(self) -> list[str]:
        head = [self.head] if self.head is not None else []
        return head + list(FLEET_SYSTEM) + list(FLEET_DOCUMENTS[self.tenant]) + self.user

    def __len__(self) -> int:
        return (FLEET_SYSTEM_TOKENS + FLEET_DOCUMENT_TOKENS + len(self.user)
                + (self.head is not None))


def draw_fleet_prompt(rng: random.Random, volatile: bool = False) -> FleetPrompt:
    """Draw one prompt from ``rng`` exactly as the example states it: the tenant
    (``choice("ABCDEFGH")``), 60 user tokens ``u{randint(0, 10**6)}``, then, for the volatile
    run only, a head token ``time={randint(0, 10**6)}``."""
    tenant = rng.choice(FLEET_TENANTS)
    user = [f"u{rng.randint(0, 10 ** 6)}" for _ in range(FLEET_USER_TOKENS)]
    head = f"time={rng.randint(0, 10 ** 6)}" if volatile else None
    return FleetPrompt(tenant, user, head)


# Fleet token ids in closed form (the worked example's tokens are strings; any one-to-one map will do):
# system token s{i} -> 1 + i, tenant T's document token T{i} -> after the system prompt, 800
# per tenant in "ABCDEFGH" order, user token u{v} -> FLEET_USER_ID_BASE + v and head token
# time={v} -> FLEET_HEAD_ID_BASE + v (v is at most 10**6).
FLEET_VALUE_BOUND = 10 ** 6 + 1  # randint(0, 10**6) draws below this
FLEET_USER_ID_BASE = 1 + FLEET_SYSTEM_TOKENS + FLEET_DOCUMENT_TOKENS * len(FLEET_TENANTS)
FLEET_HEAD_ID_BASE = FLEET_USER_ID_BASE + FLEET_VALUE_BOUND


def fleet_static_ids(tenant: str) -> array:
    """Token ids of the system prompt and ``tenant``'s document (the closed-form map)."""
    first_doc = 1 + FLEET_SYSTEM_TOKENS + FLEET_DOCUMENT_TOKENS * FLEET_TENANTS.index(tenant)
    return array("I", list(range(1, 1 + FLEET_SYSTEM_TOKENS))
                 + list(range(first_doc, first_doc + FLEET_DOCUMENT_TOKENS)))


@dataclass(slots=True)
class FleetBatch:
    """``requests`` fleet prompts drawn at once: ``tenants[i]`` an index into ``"ABCDEFGH"``,
    ``user[i]`` the 60 values ``v`` of the user tokens ``u{v}``, ``head[i]`` the value of the
    head token ``time={v}`` (volatile runs, else None) and ``routes[i]`` the replica drawn
    with ``randrange(route_replicas)`` after the prompt (else None)."""

    tenants: list[int]
    user: "np.ndarray"
    head: list[int] | None
    routes: list[int] | None


def draw_fleet_batch(rng: random.Random, requests: int, volatile: bool = False,
                     route_replicas: int = 0, read_ahead: int | None = None) -> FleetBatch:
    """What ``requests`` calls of :func:`draw_fleet_prompt` (each followed by
    ``rng.randrange(route_replicas)`` when ``route_replicas``) draw, the same values and the
    same generator state afterwards, from one block of raw words
    (:mod:`~prefixroute.core.simulator.batched_draws`). ``read_ahead``: words of the first
    block (doubled until the draws fit)."""
    import numpy as np

    from prefixroute.core.simulator.batched_draws import WordBlock
    n_tenants, n_user = len(FLEET_TENANTS), FLEET_USER_TOKENS
    # Words per request: about 2 for the tenant (half of 4-bit draws are >= 8), 63 for 60
    # user values (4.6% rejected), 1 for the head and 2 for the route; read ahead with room.
    words = read_ahead if read_ahead else requests * 72 + 256
    while True:
        block = WordBlock(rng, words)
        # The next accepted draw for bound n at or after word p is accepted(n)[rank(n)[p]];
        # the loop only follows where each prompt starts (lookups past the end of the block
        # raise IndexError: read a larger block), the values are gathered afterwards.
        tenant_rank = block.rank(n_tenants)
        tenant_at = memoryview(block.accepted(n_tenants))
        accepted = block.accepted(FLEET_VALUE_BOUND)
        value_at, rank = memoryview(accepted), block.rank(FLEET_VALUE_BOUND)
        if route_replicas:
            route_rank = block.rank(route_replicas)
            route_at = memoryview(block.accepted(route_replicas))
        begin = [0] * requests
        pos = 0
        try:
            for i in range(requests):
                begin[i] = pos
                # The tenant, then 60 user values (and the head, the next value drawn).
                past_user = rank[tenant_at[tenant_rank[pos]] + 1] + n_user
                pos = value_at[past_user if volatile else past_user - 1] + 1
                if route_replicas:
                    pos = route_at[route_rank[pos]] + 1
            break
        except IndexError:
            block.release(0)
            words *= 2
            # Every draw is accepted with odds of at least one half: 4 times the estimate
            # is never needed, and an IndexError of another kind must not grow forever.
            if words > 4 * (requests * 72 + 256):
                raise RuntimeError(f"fleet draws: {words} words read ahead for {requests} "
                                   "requests; a lookup failed for another reason") from None
    block.release(pos)
    values = block.values(FLEET_VALUE_BOUND)
    tenant_word = block.accepted(n_tenants)[np.asarray(tenant_rank)[begin]]
    user_from = np.asarray(rank)[tenant_word + 1]
    user = values[accepted[user_from[:, None] + np.arange(n_user)]]
    next_word = accepted[user_from + n_user - 1] + 1
    heads = routes = None
    if volatile:
        heads = values[accepted[user_from + n_user]].tolist()
        next_word = accepted[user_from + n_user] + 1
    if route_replicas:
        route_word = block.accepted(route_replicas)[np.asarray(route_rank)[next_word]]
        routes = block.values(route_replicas)[route_word].tolist()
    return FleetBatch(block.values(n_tenants)[tenant_word].tolist(), user, heads, routes)


class FleetEncoder:
    """Token strings of fleet prompts to ids, and their leading text, without rebuilding the
    2,000 static tokens for every request (they are encoded once per tenant)."""

    def __init__(self, vocabulary: Vocabulary | None = None):
        self.vocabulary = vocabulary if vocabulary is not None else Vocabulary()
        self._static: dict[str, array] = {}
        self._static_text: dict[str, list[str]] = {}

    def static_ids(self, tenant: str) -> array:
        ids = self._static.get(tenant)
        if ids is None:
            ids = self._static[tenant] = self.vocabulary.ids(
                FLEET_SYSTEM + FLEET_DOCUMENTS[tenant])
        return ids

    def ids(self, prompt: FleetPrompt) -> array:
        vocabulary = self.vocabulary
        out = vocabulary.ids([prompt.head]) if prompt.head is not None else array("I")
        out += self.static_ids(prompt.tenant)
        out += vocabulary.ids(prompt.user)
        return out

    def leading_text(self, prompt: FleetPrompt, n: int) -> str:
        """``' '.join`` of the first ``n`` tokens (what prefix-aware routing hashes)."""
        key = (prompt.tenant, n - (prompt.head is not None))
        cached = self._static_text.get(key)
        if cached is None:
            static = FLEET_SYSTEM + FLEET_DOCUMENTS[prompt.tenant]
            cached = self._static_text[key] = [" ".join(static[:key[1]])]
        text = cached[0]
        static_len = FLEET_SYSTEM_TOKENS + FLEET_DOCUMENT_TOKENS
        if key[1] > static_len:
            text = " ".join([text] + prompt.user[:key[1] - static_len])
        if prompt.head is not None:
            text = prompt.head + " " + text
        return text


def seed_fleet(requests: int = 2000, seed: int = 3, volatile: bool = False, rate: float = 20.0,
               output_tokens: int = 16, block_size: int = 16,
               rng: random.Random | None = None,
               encoder: FleetEncoder | None = None) -> Iterator[Request]:
    """The fleet hit-rate example's prompts (its random stream for ``seed`` 3), arriving as a
    Poisson process of ``rate`` requests/s with ``output_tokens`` each (the example gives no
    timing; these are ours). Pass ``rng``/``encoder`` to continue a shared stream."""
    _check_positive(requests=requests, rate=rate, output_tokens=output_tokens)
    rng = rng if rng is not None else random.Random(seed)
    timing = random.Random(f"seed-fleet-arrivals/{seed}")
    encoder = encoder if encoder is not None else FleetEncoder()
    static = FLEET_SYSTEM_TOKENS + FLEET_DOCUMENT_TOKENS
    t = 0.0
    for i in range(requests):
        prompt = draw_fleet_prompt(rng, volatile)
        ids = encoder.ids(prompt)
        yield Request(f"fleet-{i}", t, len(ids), output_tokens, block_size, token_ids=ids,
                      tenant=prompt.tenant, prefix_group=None if volatile else prompt.tenant,
                      prefix_tokens=0 if volatile else static)
        t += timing.expovariate(rate)


# -- the design scenario --------------------------------------------------------------------------
SECONDS_PER_DAY = 86_400.0


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Popularity of ranks 1..n proportional to 1 / rank**exponent, normalised."""
    raw = [1.0 / (rank ** exponent) for rank in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def design_scenario(requests: int = 5000, tenants: int = 200, prefix_tokens: int = 10_000,
                    requests_per_day: float = 50_000, compress: float = 1.0,
                    zipf_exponent: float = 1.2, hot_tenant_share: float = 0.25,
                    user_tokens_min: int = 100, user_tokens_max: int = 600,
                    output_tokens_min: int = 50, output_tokens_max: int = 400,
                    timestamp_at_top: bool = False, block_size: int = 16,
                    seed: int = 0) -> Iterator[Request]:
    """The design scenario: a multi-tenant assistant (docs/concepts.md).

    ``tenants`` prefixes of ``prefix_tokens`` tokens; tenant 0 is the hot one and gets
    ``hot_tenant_share`` of the traffic, the others share the rest by Zipf
    (``zipf_exponent``; with the defaults the least popular tenants recur less than hourly).
    Requests arrive as a Poisson process of ``requests_per_day`` per day, ``compress`` times
    faster (24 plays a day in an hour); ``requests`` of them are generated (50,000 is a whole
    day). With ``timestamp_at_top`` every prompt starts with a fresh timestamp token, so no
    prefix is ever shared (the release that dropped the hit rate to zero).
    """
    _check_positive(requests=requests, tenants=tenants, prefix_tokens=prefix_tokens,
                    requests_per_day=requests_per_day, compress=compress)
    if not 0 <= hot_tenant_share < 1:
        raise ConfigError(f"hot_tenant_share must be in [0, 1), got {hot_tenant_share!r}")
    if user_tokens_min < 1 or user_tokens_max < user_tokens_min:
        raise ConfigError("user tokens: need 1 <= user_tokens_min <= user_tokens_max")
    if output_tokens_min < 1 or output_tokens_max < output_tokens_min:
        raise ConfigError("output tokens: need 1 <= output_tokens_min <= output_tokens_max")
    rng = random.Random(f"design-scenario/{seed}")
    space = TokenSpace()
    prefixes: dict[int, array] = {}
    weights = [hot_tenant_share] + [w * (1 - hot_tenant_share)
                                    for w in zipf_weights(tenants - 1, zipf_exponent)] \
        if tenants > 1 else [1.0]
    cumulative = []
    acc = 0.0
    for w in weights:
        acc += w
        cumulative.append(acc)
    rate = requests_per_day / SECONDS_PER_DAY * compress
    t = 0.0
    clock_token_base = space.reserve(10_000_001)  # timestamps get ids of their own
    for i in range(requests):
        tenant = min(_bisect(cumulative, rng.random() * acc), tenants - 1)
        prefix = prefixes.get(tenant)
        if prefix is None:
            prefix = prefixes[tenant] = space.fresh(prefix_tokens)
        user = space.fresh(rng.randint(user_tokens_min, user_tokens_max))
        output = rng.randint(output_tokens_min, output_tokens_max)
        if timestamp_at_top:
            stamp = array("I", [clock_token_base + 1 + int(t) % 10_000_000])
            tokens = stamp + prefix + user
        else:
            tokens = prefix + user
        yield Request(f"design-{i}", t, len(tokens), output, block_size, token_ids=tokens,
                      tenant=f"tenant-{tenant:03d}",
                      prefix_group=None if timestamp_at_top else f"tenant-{tenant:03d}",
                      prefix_tokens=0 if timestamp_at_top else prefix_tokens)
        t += rng.expovariate(rate)


def _bisect(cumulative: list[float], x: float) -> int:
    lo, hi = 0, len(cumulative)
    while lo < hi:
        mid = (lo + hi) // 2
        if cumulative[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


# -- multi-turn conversations ---------------------------------------------------------------------
def conversations(sessions: int = 40, turns: int = 6, system_tokens: int = 400,
                  user_tokens_min: int = 30, user_tokens_max: int = 300,
                  reply_tokens_min: int = 30, reply_tokens_max: int = 300,
                  think_time_s: float = 20.0, session_rate: float = 0.5, block_size: int = 16,
                  seed: int = 0) -> Iterator[Request]:
    """Concurrent chat sessions behind one system prompt; each turn's prompt is the previous
    prompt, the previous reply and a new user message (append-only, as the layout rules ask).

    Sessions start as a Poisson process (``session_rate``/s); a user thinks
    exponentially-distributed ``think_time_s`` (mean) between turns. Replies are known, so the
    engine caches decode blocks; a turn that arrives before the previous reply finished (open
    loop) cannot hit those blocks.
    """
    _check_positive(sessions=sessions, turns=turns, system_tokens=system_tokens,
                    think_time_s=think_time_s, session_rate=session_rate)
    rng = random.Random(f"conversations/{seed}")
    space = TokenSpace()
    system = space.fresh(system_tokens)
    out: list[Request] = []
    starts = _poisson_arrivals(rng, session_rate, sessions)
    for s, start in enumerate(starts):
        sequence = system
        t = start
        for turn in range(turns):
            sequence = sequence + space.fresh(rng.randint(user_tokens_min, user_tokens_max))
            reply = space.fresh(rng.randint(reply_tokens_min, reply_tokens_max))
            out.append(Request(f"chat-{s}-{turn}", t, len(sequence), len(reply), block_size,
                               token_ids=sequence, tenant=f"user-{s}", session=f"chat-{s}",
                               turn=turn, prefix_group="system", prefix_tokens=system_tokens,
                               output_token_ids=reply))
            sequence = sequence + reply
            t += rng.expovariate(1.0 / think_time_s)
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return iter(out)


# -- hot-prefix bursts ----------------------------------------------------------------------------
def hot_burst(duration_s: float = 120.0, families: int = 8, family_tokens: int = 1000,
              base_rate: float = 4.0, hot_tokens: int = 4000, bursts: int = 3,
              burst_size: int = 200, burst_window_s: float = 2.0, user_tokens: int = 50,
              output_tokens: int = 256, block_size: int = 16,
              seed: int = 0) -> Iterator[Request]:
    """Steady Poisson traffic (``base_rate``/s) spread uniformly over ``families`` prefixes,
    plus ``bursts`` bursts, evenly spaced, of ``burst_size`` requests for one hot prefix within
    ``burst_window_s`` each: the case where pure affinity piles a queue on one replica (with
    the defaults on 4 replicas, affinity_only's TTFT p99 is about 20x round robin's)."""
    _check_positive(duration_s=duration_s, families=families, base_rate=base_rate)
    rng = random.Random(f"hot-burst/{seed}")
    space = TokenSpace()
    prefixes = [space.fresh(family_tokens) for _ in range(families)]
    hot = space.fresh(hot_tokens)
    events: list[tuple[float, str, int]] = []
    t = rng.expovariate(base_rate)
    while t < duration_s:
        events.append((t, "base", rng.randrange(families)))
        t += rng.expovariate(base_rate)
    for b in range(bursts):
        begin = duration_s * (b + 1) / (bursts + 1)
        for _ in range(burst_size):
            events.append((begin + rng.random() * burst_window_s, "hot", -1))
    events.sort()
    for i, (t, kind, family) in enumerate(events):
        if kind == "hot":
            prefix, group, length = hot, "hot", hot_tokens
        else:
            prefix, group, length = prefixes[family], f"family-{family}", family_tokens
        tokens = prefix + space.fresh(user_tokens)
        yield Request(f"burst-{i}", t, len(tokens), output_tokens, block_size, token_ids=tokens,
                      tenant=group, prefix_group=group, prefix_tokens=length)


# -- shapes + prefixes (Azure) --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Shape:
    """A request without content: when, how long a prompt, how many output tokens."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    where: str = ""


def with_prefixes(shapes: Iterable[Shape], prefixes: int = 20, prefix_tokens: int = 1000,
                  max_prefix_fraction: float = 0.8, zipf_exponent: float = 1.0,
                  block_size: int = 16, seed: int = 0) -> Iterator[Request]:
    """Give arrival/length shapes (traces without content, e.g. Azure) a prefix structure:
    each request starts with one of ``prefixes`` shared prefixes, chosen by Zipf popularity,
    of ``min(prefix_tokens, max_prefix_fraction x input)`` tokens; the rest is fresh text."""
    _check_positive(prefixes=prefixes, prefix_tokens=prefix_tokens)
    if not 0 < max_prefix_fraction <= 1:
        raise ConfigError(f"max_prefix_fraction must be in (0, 1], got {max_prefix_fraction!r}")
    rng = random.Random(f"with-prefixes/{seed}")
    space = TokenSpace()
    families = [space.fresh(prefix_tokens) for _ in range(prefixes)]
    cumulative = []
    acc = 0.0
    for w in zipf_weights(prefixes, zipf_exponent):
        acc += w
        cumulative.append(acc)
    for i, shape in enumerate(shapes):
        family = min(_bisect(cumulative, rng.random() * acc), prefixes - 1)
        shared = min(prefix_tokens, int(shape.input_tokens * max_prefix_fraction))
        tokens = families[family][:shared] + space.fresh(shape.input_tokens - shared)
        yield Request(shape.where or f"shape-{i}", shape.arrival_s, shape.input_tokens,
                      shape.output_tokens, block_size, token_ids=tokens,
                      prefix_group=f"prefix-{family}/{shared}", prefix_tokens=shared)


# -- the catalogue the CLI uses -------------------------------------------------------------------
# -- generated Mooncake-format traffic at scale --------------------------------------------------
MOONCAKE_BLOCK_TOKENS = 512  # the Mooncake traces' block size


def diurnal_rate(t_s: float, mean_rate: float, amplitude: float, peak_hour: float = 14.0) -> float:
    """A day-shaped arrival rate: ``mean_rate * (1 + amplitude * cos(2 pi (t - peak) / day))``
    (lowest 12 hours from the peak). ``amplitude`` 0 is steady traffic."""
    return mean_rate * (1.0 + amplitude * math.cos(
        2.0 * math.pi * (t_s / SECONDS_PER_DAY - peak_hour / 24.0)))


def mooncake_sessions(requests: int = 100_000, seed: int = 0, rate: float = 10.0,
                      diurnal_amplitude: float = 0.6, system_prompts: int = 32,
                      system_zipf: float = 1.1, system_tokens: int = 2048,
                      mean_turns: float = 4.0, max_turns: int = 16,
                      user_tokens: int = 400, output_tokens: int = 250,
                      think_s: float = 45.0, max_context_tokens: int = 32_768,
                      block_size: int = MOONCAKE_BLOCK_TOKENS) -> Iterator[Request]:
    """Chat traffic in the Mooncake trace's shape: ``hash_ids`` of ``block_size``-token blocks
    (512 as in Mooncake), requests in time order, generated lazily (memory grows with the
    sessions live at once, not with ``requests``).

    * **Sessions**: each starts with one of ``system_prompts`` shared system prompts
      (popularity Zipf(``system_zipf``), lengths uniform in ``system_tokens`` x [0.5, 1.5]),
      then turns; turn k's prompt is turn k-1's prompt, its reply and new user text
      (exponential, mean ``user_tokens``), so the full blocks of the previous prompt keep
      their ids and the rest get fresh ones. Turns per session are geometric with mean
      ``mean_turns`` (at most ``max_turns``, and no prompt beyond ``max_context_tokens``);
      replies are exponential with mean ``output_tokens``.
    * **Arrivals**: sessions start as a Poisson process whose rate follows a day
      (:func:`diurnal_rate`, peak at 14:00, mean ``rate / mean_turns`` sessions/s, so about
      ``rate`` requests/s); a session's next turn comes ``think_s`` (exponential mean) after
      the previous one, plus a rough reply time (20 ms per output token).

    Defaults are ours, in the range of the Mooncake conversation trace (prompts of a few
    thousand tokens, replies of a few hundred); the same ``seed`` gives the same trace.
    """
    _check_positive(requests=requests, rate=rate, system_prompts=system_prompts,
                    system_tokens=system_tokens, mean_turns=mean_turns, max_turns=max_turns,
                    user_tokens=user_tokens, output_tokens=output_tokens, think_s=think_s,
                    max_context_tokens=max_context_tokens, block_size=block_size)
    if not 0.0 <= diurnal_amplitude < 1.0:
        raise ConfigError(f"diurnal amplitude must be in [0, 1), got {diurnal_amplitude!r}")
    rng = random.Random(f"mooncake-sessions/{seed}")
    weights = zipf_weights(system_prompts, system_zipf)
    cumulative = list(itertools.accumulate(weights))
    next_id = [0]

    def fresh(n: int) -> list[int]:
        start = next_id[0]
        next_id[0] += n
        if next_id[0] > MAX_BLOCK_ID + 1:
            raise ConfigError("trace too large: block ids exceed 32 bits")
        return list(range(start, start + n))

    systems = []
    for _ in range(system_prompts):
        length = max(1, round(system_tokens * rng.uniform(0.5, 1.5)))
        systems.append((length, fresh(length // block_size)))
    session_rate = rate / mean_turns
    peak = session_rate * (1.0 + diurnal_amplitude)
    stop_p = 1.0 / mean_turns
    # Live sessions: heap of (time of next turn, session number, state). State: tenant
    # (system prompt index), prompt length so far, ids of its full blocks, turns left.
    live: list[tuple[float, int, list]] = []
    next_start = 0.0
    started = 0

    def draw_start(t: float) -> float:
        while True:  # thinning of a Poisson process at the peak rate
            t += rng.expovariate(peak)
            if rng.random() * peak <= diurnal_rate(t, session_rate, diurnal_amplitude):
                return t

    next_start = draw_start(0.0)
    emitted = 0
    while emitted < requests:
        if not live or next_start <= live[0][0]:
            t = next_start
            system = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
            system = min(system, system_prompts - 1)
            turns = 1
            while turns < max_turns and rng.random() >= stop_p:
                turns += 1
            length, ids = systems[system]
            state = [system, length, list(ids), turns, 0]
            heapq.heappush(live, (t, started, state))
            started += 1
            next_start = draw_start(t)
            continue
        t, number, state = heapq.heappop(live)
        system, length, full_ids, turns_left, turn = state
        new = max(1, round(rng.expovariate(1.0 / user_tokens)))
        prompt = length + new
        if prompt > max_context_tokens:
            continue  # the conversation is over: it outgrew the context
        keep = len(full_ids)
        n_blocks = -(-prompt // block_size)
        hash_ids = full_ids + fresh(n_blocks - keep)
        reply = max(1, round(rng.expovariate(1.0 / output_tokens)))
        yield Request(f"s{number}-t{turn}", t, prompt, reply, block_size, hash_ids=hash_ids,
                      tenant=f"system-{system}", session=f"s{number}", turn=turn,
                      prefix_group=f"system-{system}")
        emitted += 1
        if turns_left > 1:
            grown = prompt + reply
            # Full blocks of this prompt stay; the partial one and the reply are new text.
            state[:] = [system, grown, hash_ids[:prompt // block_size], turns_left - 1,
                        turn + 1]
            gap = rng.expovariate(1.0 / think_s) + 0.02 * reply
            heapq.heappush(live, (t + gap, number, state))


@dataclass(frozen=True)
class Workload:
    """A named generator with the fleet it is meant for (overridable from the CLI)."""

    name: str
    factory: Callable[..., Iterable[Request]]
    replicas: int
    cache_blocks: int | None  # usable KV blocks per replica; None: from the engine profile
    description: str


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("seed-fleet", seed_fleet, 4, 400,
             "the fleet hit-rate example: 8 tenants' 2,000-token prefixes, 4 x 400-block LRUs"),
    Workload("design-scenario", design_scenario, 8, None,
             "multi-tenant assistant: 200 tenants x 10,000-token prefixes, Zipf, one hot tenant"),
    Workload("universal-prefix", universal_prefix, 5, None,
             "50 requests behind one 200-token system prompt, 5 replicas"),
    Workload("hot-burst", hot_burst, 4, 2000,
             "steady traffic over 8 prefixes plus bursts of one hot prefix"),
    Workload("conversations", conversations, 4, 2000,
             "concurrent multi-turn chats growing turn by turn"),
    Workload("skewed-trace", skewed_trace, 3, None,
             "prefix families A-D arriving AABACABDAACBADABCABA, 3 replicas"),
    Workload("five-turn", five_turn_conversation, 1, None,
             "one five-turn conversation growing by its replies"),
    Workload("mooncake-sessions", mooncake_sessions, 32, None,
             "chat sessions on shared system prompts, day-shaped arrivals, 512-token blocks"),
)}


def _convert(text: str, default):
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {text!r}")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, str):
        return text
    raise ValueError("this parameter cannot be set from the command line")


def workload_parameters(name: str) -> dict[str, object]:
    workload = _get(name)
    return {k: p.default for k, p in inspect.signature(workload.factory).parameters.items()
            if p.default is not inspect.Parameter.empty
            and isinstance(p.default, (bool, int, float, str))}


def _get(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ConfigError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


def make_workload(name: str, params: dict[str, str] | None = None,
                  **overrides) -> Iterable[Request]:
    """Build a named workload; ``params`` are ``key=value`` strings from the command line,
    ``overrides`` typed values (``seed``, ``block_size``) applied when the generator has them."""
    workload = _get(name)
    allowed = workload_parameters(name)
    kwargs: dict[str, object] = {}
    for key, text in (params or {}).items():
        if key not in allowed:
            raise ConfigError(f"workload {name!r} has no parameter {key!r}; its parameters: "
                              f"{', '.join(allowed)}")
        try:
            kwargs[key] = _convert(text, allowed[key])
        except ValueError as exc:
            raise ConfigError(f"workload {name!r} parameter {key!r}: {exc}") from None
    for key, value in overrides.items():
        if key in allowed and key not in kwargs and value is not None:
            kwargs[key] = value
    try:
        return workload.factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"workload {name!r}: {exc}") from None


__all__ = ["TokenSpace", "Vocabulary", "five_turn_conversation", "universal_prefix",
           "skewed_trace", "seed_fleet", "draw_fleet_prompt", "draw_fleet_batch", "FleetBatch",
           "FleetPrompt", "FleetEncoder", "fleet_static_ids",
           "design_scenario", "conversations", "hot_burst", "with_prefixes", "Shape", "WORKLOADS", "Workload",
           "make_workload", "workload_parameters", "zipf_weights", "mooncake_sessions",
           "diurnal_rate"]
