"""The blocks the router sent to one replica, and the chance each is still cached there.

The mirror is an LRU of the replica's KV size (as approximate routers keep), each block
stamped with the *touch* (one per request routed here) that last used it. ``inserts`` counts
the blocks newly inserted on the replica so far; ``inserts_at[stamp]`` is that count just
after the touch, so a block's LRU age is ``inserts - inserts_at[stamp]``: only new blocks push
old ones out, re-used blocks do not.

Memory. A gateway routes for weeks, so nothing here grows with the requests routed: the LRU
keeps at most the replica's KV (:data:`UNKNOWN_CAPACITY_BLOCKS` while that is unknown), and
``inserts_at`` drops the readings of stamps no held block carries any more (only held blocks
are aged) whenever it has grown by as many as the mirror holds blocks: amortised, a constant
cost per touch.

Out of the cycle collector's way. The blocks are a plain dict of keys and stamps, which
CPython does not track, so a full collection does not walk a mirror's tens of thousands of
blocks (as an ``OrderedDict`` they made each full collection a pause that every request in
flight waited out). The LRU order needs no structure of its own: a touch gives all its blocks
one new stamp, so the least recently used block is the first block of the oldest touch that
still carries that touch's stamp. ``touched`` keeps each touch's keys in that order, a tuple
per touch (the collector visits the tuples, one per touch, but not the keys in them);
eviction walks them from the oldest (``head``, ``oldest_at``), passing over keys touched
again since. The touches that still have a tuple are linked oldest to newest (``after``,
``before``: plain dicts of stamps), so the walk goes from one to the next however many
touches between them left nothing (a prompt under one block, say).

A key touched again leaves a dead entry in its older touch's tuple. ``dead`` counts them per
touch, and a touch whose keys are all dead goes at once (the one the walk is in waits for
the walk or a sweep: the keys the walk evicted are not counted). Once they pass twice the
blocks held, each touch also sweeps dirty touches (a pass over a snapshot of them) until it
has read twice its own keys, rewriting each tuple with only its live keys. A touch makes at
most as many dead entries as it has keys, so the sweep keeps ``touched`` within a small
multiple of the blocks held: a long prompt prefix that every request shares would otherwise
leave its whole length in every touch's tuple. A sweep reads at most one touch past its
budget, and a new pass copies the dirty stamps into an array once (C speed, like the clock's
compaction below). The walk reads the dead keys of the touches it passes, so one eviction
may read up to all of them (at C speed; bounded by the sweep's threshold).

Survival. A block after which ``k`` new blocks were inserted survives the replica's LRU of
``C`` blocks with probability 1 up to ``k = C (1 - w)``, 0 from ``k = C`` (``C`` inserts surely
flush a ``C``-block LRU), linear between (``w = survival_width``: blocks pinned by running
requests and vLLM's tail-first freeing make a block go up to about a quarter of the pool
sooner than a pure LRU). Expected cached blocks are the running minimum of those
probabilities summed along the prefix chain: block ``i`` only hits if ``0 .. i-1`` do.

Heads outlive tails. vLLM frees a finished request's blocks in reverse order, so a prompt's
tail is evicted before its head; the mirror records a request's blocks tail first too.

Views. A view of the engine (``observes_engine``: KV events, the simulated cache) vetoes
blocks it says are gone, except those of requests still in flight here (they are being
computed: a burst of same-prefix requests follows the first to its replica), and blocks it
confirms past the mirror's end count too (another gateway instance sent them). A view that
knows only what this router sent holds nothing the mirror lacks and drops a prompt's head
first, so it vetoes nothing.

Feedback. The engine's reported ``cached_tokens`` move the eviction ``horizon``: blocks
stamped at or below it count as gone (:meth:`BlockMirror.learn`).
"""

from __future__ import annotations

from array import array
from collections import deque
from itertools import compress, count, groupby, islice, repeat
from typing import Hashable, Iterable, Iterator, NamedTuple, Sequence

from prefixroute.core.caches.base import UNKNOWN_CAPACITY_BLOCKS, fits_kv
from prefixroute.core.routing.base import CacheView, RequestView

# ``inserts_at`` is compacted once it passes twice the stamps it kept plus the larger of this
# and the blocks held (the compaction reads every block's stamp); dead entries in ``touched``
# are swept once they pass twice the blocks held plus this.
_COMPACT_SLACK = 1024
_NONE = -1  # no stamp (in ``head``, ``tail`` and the links)

# A stamp run ``(stamp, end)``: the blocks before ``end`` (and after the previous run) had
# that stamp. Stamps only fall along a prefix, as every request touching block ``i`` touched
# ``0 .. i-1``.
StampRun = tuple[int, int]


def _held_stamps(blocks: dict[Hashable, int], keys: Sequence[Hashable], end: int) -> list[int]:
    """Stamps of ``keys[:end]`` up to the first key the mirror lacks."""
    stamps: list[int] = []
    for i in range(min(end, len(keys))):
        stamp = blocks.get(keys[i])
        if stamp is None:  # the mirror ends there
            break
        stamps.append(stamp)
    return stamps


def _carry(blocks: dict[Hashable, int], keys: Iterable[Hashable], stamp: int) -> Iterator[bool]:
    """For each of ``keys``, whether it is held under ``stamp`` still (C-level passes)."""
    return map(stamp.__eq__, map(blocks.get, keys, repeat(-2)))


class HitEstimate(NamedTuple):
    """What a replica is expected to reuse of a prompt."""

    expected_blocks: float   # expected cached leading blocks (survival-weighted)
    view_blocks: int         # leading blocks the runner's view confirms
    stamps: list[int]        # stamps of the blocks counted (-1: seen only by the view)


class BlockMirror:
    """The router's record of one replica's cache: blocks, insert clock, eviction horizon."""

    __slots__ = ("blocks", "touched", "head", "tail", "after", "before", "oldest_at", "dead",
                 "dead_total", "sweep", "sweep_at", "inserts", "inserts_at", "stamps",
                 "compact_at", "horizon", "capacity", "in_flight")

    def __init__(self) -> None:
        self.blocks: dict[Hashable, int] = {}  # key -> the stamp of its last touch
        # stamp -> that touch's keys, least recently used first (some touched again since)
        self.touched: dict[int, tuple[Hashable, ...]] = {}
        # The touches in ``touched``, oldest to newest: the first and last, and each one's
        # next and previous (every held block is in one of them).
        self.head = self.tail = _NONE
        self.after: dict[int, int] = {}
        self.before: dict[int, int] = {}
        self.oldest_at = 0  # no key of touched[head] before this position is held
        # stamp -> the keys in touched[stamp] that no longer carry it (touched again, taken
        # back), and their sum: what a sweep would drop
        self.dead: dict[int, int] = {}
        self.dead_total = 0
        # the dirty stamps of the sweep in progress (machine numbers: nothing to walk)
        self.sweep = array("q")
        self.sweep_at = 0         # and how far it got
        self.inserts = 0          # blocks newly inserted so far (the LRU clock)
        # stamp -> inserts after that touch: at least every stamp a held block carries
        self.inserts_at: dict[int, int] = {}
        self.stamps = 0           # touches so far: the next touch's stamp
        self.compact_at = _COMPACT_SLACK  # inserts_at's size that triggers its compaction
        self.horizon = -1         # blocks stamped at or below this were evicted (feedback)
        self.capacity = 0         # the replica's KV in blocks (0: unknown)
        self.in_flight: dict[str, int] = {}  # request id -> its stamp, in routing order

    def survival(self, stamp: int, width: float) -> float:
        """Probability that a block last touched at ``stamp`` is still cached (unknown
        capacity: no decay)."""
        if stamp <= self.horizon:
            return 0.0
        capacity = self.capacity
        if capacity <= 0:
            return 1.0
        age = self.inserts - self.inserts_at[stamp]
        low = capacity * (1.0 - width)
        if age <= low:
            return 1.0
        if age >= capacity:
            return 0.0
        return (capacity - age) / (capacity - low)

    def fits(self, request: RequestView) -> bool:
        """Whether the request can run on this replica's KV at all (:func:`fits_kv`)."""
        return fits_kv(request.num_tokens, request.output_tokens_hint or 1,
                       self.capacity, request.block_size)

    def may_hit(self, keys: Sequence[Hashable], limit: int, view: CacheView) -> bool:
        """False when :meth:`expected` surely answers no hit: the mirror lacks the prompt's
        first block and the view knows only what this router sent (on a fleet, most
        replicas for most prompts, so the policy asks this first)."""
        return self.may_hit_first(keys[0] if limit > 0 and keys else None,
                                  bool(getattr(view, "observes_engine", False)))

    def may_hit_first(self, first: Hashable | None, observes_engine: bool) -> bool:
        """:meth:`may_hit` given the prompt's first block (None: no block may hit) and the
        view's ``observes_engine``, for a caller that asks many mirrors about one prompt."""
        return observes_engine or (first is not None and first in self.blocks)

    def expected(self, keys: Sequence[Hashable], limit: int, view: CacheView, width: float,
                 floor: int | None) -> HitEstimate:
        """Expected hits among the first ``limit`` of ``keys``. ``floor`` is the stamp of the
        oldest request in flight here (None: none counts), whose blocks the view may not
        veto yet."""
        if not self.may_hit(keys, limit, view):
            return HitEstimate(0.0, 0, [])
        blocks = self.blocks
        first = blocks.get(keys[0]) if limit > 0 and keys else None
        beyond_mirror = getattr(view, "observes_engine", False)
        view_blocks = view.match(keys) if beyond_mirror else min(limit, len(keys))
        if first is None and not view_blocks:
            return HitEstimate(0.0, 0, [])
        # Past the view's last block nothing counts unless a request in flight computes it.
        end = min(limit, len(keys)) if floor is not None else min(limit, len(keys), view_blocks)
        stamps = _held_stamps(blocks, keys, end)
        expected = 0.0
        running = 1.0
        i = 0
        held = len(stamps)
        # Blocks touched together share a stamp, hence a survival chance: a run at a time.
        while i < held:
            stamp = stamps[i]
            n = 1
            while i + n < held and stamps[i + n] == stamp:
                n += 1
            p = self.survival(stamp, width)
            # From the view's last block on, only blocks of a request in flight since before
            # this stamp count.
            cut = view_blocks if i + n > view_blocks and floor is not None and stamp < floor \
                else None
            counted = n if cut is None else max(0, cut - i)
            if p < running:
                running = p
            if running <= 0.0 or counted == 0:
                del stamps[i:]
                return HitEstimate(expected, view_blocks, stamps)
            expected += counted * running
            if cut is not None:
                del stamps[cut:]
                return HitEstimate(expected, view_blocks, stamps)
            i += n
        # The mirror ended (or was empty) where a view of the engine goes on.
        beyond = min(view_blocks, limit) - len(stamps) if beyond_mirror else 0
        if beyond > 0:
            expected += beyond * running
            stamps.extend([-1] * beyond)
        return HitEstimate(expected, view_blocks, stamps)

    def touch(self, keys: Sequence[Hashable], predicted_hits: int) -> tuple[int, list[StampRun]]:
        """The request's blocks were sent here: the new ones are inserted and all become most
        recent under a new stamp; the mirror keeps at most the replica's KV of blocks.

        Returns the stamp and the blocks' stamps before this touch, from the first block to
        the first one the mirror lacked, as runs: a hit deeper than predicted says how old a
        surviving block was (:meth:`learn`)."""
        blocks = self.blocks
        limit = self.capacity or UNKNOWN_CAPACITY_BLOCKS
        if len(keys) > limit:  # it would push every other block out: left as it was
            keys = ()
        self.inserts += max(0, len(keys) - predicted_hits)
        stamp = self.stamps
        self.stamps = stamp + 1
        self.inserts_at[stamp] = self.inserts
        if len(self.inserts_at) > self.compact_at:
            self._compact()
        # Each key's stamp before this touch (None: new), in C-level passes.
        befores = list(map(blocks.pop, keys, repeat(None)))
        runs: list[StampRun] = []
        end = 0
        prefix = True
        for before, group in groupby(befores):
            n = len(list(group))
            end += n
            if before is None:
                prefix = False  # (a repeated key pops None too: the chain ends there)
                continue
            if prefix:
                runs.append((before, end))
            self._kill(before, n)
        # Tail first, as vLLM frees them: the head is the most recent, the last to go.
        blocks.update(zip(reversed(keys), repeat(stamp)))
        if keys:
            # (A key twice in ``keys`` takes the place of its first time in this order.)
            self.touched[stamp] = tuple(dict.fromkeys(reversed(keys)))
            tail = self.tail
            if tail == _NONE:
                self.head = stamp
            else:
                self.after[tail] = stamp
                self.before[stamp] = tail
            self.tail = stamp
        if len(blocks) > limit:
            self._evict(len(blocks) - limit)
        if self.dead_total > 2 * len(blocks) + _COMPACT_SLACK:
            self._sweep(2 * len(keys) + 16)
        return stamp, runs

    def _evict(self, n: int) -> None:
        """Drop the ``n`` least recently used blocks (fewer than the mirror holds)."""
        blocks, touched = self.blocks, self.touched
        while n > 0 and self.head != _NONE:  # (every held block is in a touch)
            stamp = self.head
            keys = touched[stamp]
            start = self.oldest_at
            # The positions of the first ``n`` keys from ``start`` that still carry the stamp.
            carried = _carry(blocks, islice(keys, start, None), stamp)
            live = list(islice(compress(count(start), carried), n))
            deque(map(blocks.__delitem__, map(keys.__getitem__, live)), 0)
            n -= len(live)
            if n > 0 or live[-1] + 1 == len(keys):  # the touch has no block left
                self._drop_touch(stamp)
            else:
                self.oldest_at = live[-1] + 1

    def _kill(self, stamp: int, n: int) -> None:
        """``n`` more keys of touch ``stamp`` no longer carry it; with none left, it goes."""
        dead = self.dead[stamp] = self.dead.get(stamp, 0) + n
        self.dead_total += n
        if dead == len(self.touched[stamp]):
            self._drop_touch(stamp)

    def _drop_touch(self, stamp: int) -> None:
        """Forget a touch none of whose keys is held any more, and unlink it."""
        del self.touched[stamp]
        self.dead_total -= self.dead.pop(stamp, 0)
        before = self.before.pop(stamp, _NONE)
        after = self.after.pop(stamp, _NONE)
        if before == _NONE:
            self.head, self.oldest_at = after, 0
        elif after == _NONE:
            del self.after[before]
        else:
            self.after[before] = after
        if after == _NONE:
            self.tail = before
        elif before == _NONE:
            del self.before[after]
        else:
            self.before[after] = before

    def _sweep(self, budget: int) -> None:
        """Rewrite dirty touches with only their live keys until ``budget`` entries are read,
        going on from where the last sweep stopped (a new pass snapshots the dirty stamps)."""
        blocks, touched, dead = self.blocks, self.touched, self.dead
        sweep, at = self.sweep, self.sweep_at
        while budget > 0 and dead:
            if at >= len(sweep):
                sweep, at = array("q", dead), 0
            stamp = sweep[at]
            at += 1
            n = dead.pop(stamp, 0)
            self.dead_total -= n
            keys = touched.get(stamp)
            budget -= 1
            if not n or keys is None:  # swept or dropped since the snapshot
                continue
            budget -= len(keys)
            live = tuple(compress(keys, _carry(blocks, keys, stamp)))
            if not live:
                self._drop_touch(stamp)
                continue
            touched[stamp] = live
            if stamp == self.head:  # (the keys the walk passed are gone too)
                self.oldest_at = 0
        self.sweep, self.sweep_at = sweep, at

    def _compact(self) -> None:
        """Drop the clock readings of stamps no held block carries any more (evicted,
        re-touched since, or taken back): only held blocks are aged. The newest stamp stays,
        whose blocks the touch in progress is about to insert."""
        blocks = self.blocks
        held = set(blocks.values())
        held.add(self.stamps - 1)
        self.inserts_at = {stamp: at for stamp, at in self.inserts_at.items() if stamp in held}
        self.compact_at = 2 * len(self.inserts_at) + max(_COMPACT_SLACK, len(self.blocks))

    def untouch(self, keys: Sequence[Hashable], stamp: int, held: int, inserted: int) -> None:
        """A touch the engine never ran: its blocks past the ``held`` it already had leave
        (unless a later request touched them since) and the clock takes back ``inserted``."""
        blocks = self.blocks
        gone = 0
        for key in keys[held:]:
            if blocks.get(key) == stamp:
                del blocks[key]  # (its place in touched[stamp] is passed over)
                gone += 1
        if gone:
            self._kill(stamp, gone)
        self.inserts -= inserted

    def learn(self, reported: int, stamps: Sequence[int], chain: Sequence[StampRun],
              predicted_blocks: int) -> None:
        """The replica reused ``reported`` leading blocks of a request routed with these
        ``stamps`` (blocks predicted cached) and ``chain`` (:meth:`touch`).

        Fewer than predicted: the first missing block was evicted, and with it every block
        touched before it (LRU), so the horizon moves to its stamp; the request's own blocks
        were recomputed and cached again, so they stay. More: the deepest reused block
        survived, so a horizon past it goes back to just before it. The insert clock then
        counts the blocks the replica really inserted, not those predicted uncached."""
        if reported < len(stamps):
            lost = stamps[reported]
            if lost >= 0:
                self.horizon = max(self.horizon, lost)
        elif reported > 0 and chain:
            # Stamps only fall along a prefix: the deepest reused block the mirror held is
            # the oldest that survived.
            depth = min(reported, chain[-1][1])
            survived = next(before for before, end in chain if end >= depth)
            if survived <= self.horizon:
                self.horizon = survived - 1
        self.inserts += predicted_blocks - reported

    def reset(self) -> None:
        """The replica's cache is empty (it restarted)."""
        self.blocks.clear()
        self.touched.clear()
        self.dead.clear()
        self.dead_total = 0
        self.sweep, self.sweep_at = array("q"), 0
        self.after.clear()
        self.before.clear()
        self.head = self.tail = _NONE
        self.oldest_at = 0
        self.in_flight.clear()
