"""Lint a request log for volatile content in the static region, and price it in cached tokens.

The layout rules (docs/concepts.md, "Prompt layout"): static first, volatile last; no
timestamps, request ids, random few-shot order or user names in the static region;
deterministic tool schemas; append to conversations, never rewrite them. This module checks a
log of requests against those rules, per tenant:

1. **Static region.** Every request is cut into *units*, one per line of each message (or of each
   paragraph of a completions prompt), plus one unit for the tool list. A unit's identity is its
   *shape*: the line with candidate volatile values (:mod:`.volatile`) replaced by placeholders,
   and the tool list in canonical form (:mod:`.serialize`). The static region is the longest run
   of leading units that at least half of the tenant's requests share ("most requests"), ending
   with a unit whose text they all share, or whose line goes on with static text after a value
   that changes (a one-line system prompt that opens with the time); it is what the prompt
   author meant to be constant. Values that change after its end (the new turn) cost nothing
   and are not reported.
2. **Findings.** Inside the static region, a value that differs between requests at the same
   place is volatile (a timestamp, UUID, request id, counter, user name or e-mail address).
   Between consecutive requests of a tenant: the same tools in another order, the same schemas
   with keys in another order, or changed tools; the same few-shot messages in another order; an
   earlier turn of a conversation rewritten; and requests whose static region differs from the
   majority's (a changed template or system prompt).
3. **Token hit rate now**, from the engine's tokens (chat template and all): each request reuses
   the full blocks it shares with any *earlier* request of its cache partition (tenant, model,
   cache salt). The cache is infinite: no capacity, eviction or TTL, as if one replica held
   everything, or a fleet routed with perfect affinity. It is the upper bound layout decides; a
   real fleet gets less. As in vLLM the last prompt token is always recomputed.
4. **Token hit rate after** the fix, recomputed the same way on rewritten requests: the
   sentences with volatile values moved from the static region to the end of the prompt (the
   last message; a line with no other sentence moves whole), tools serialised canonically,
   shuffled few-shot examples put in one order. Rewritten turns and
   changed templates stay as they are: no layout change repairs them.

Consecutive requests are also compared token by token: where they first diverge and what sits
there (the diff verdict of :mod:`.diff`).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from typing import Callable, Iterable, Sequence

from prefixroute.core.diagnostics.diff import common_prefix_length
from prefixroute.core.diagnostics.prompts import (CHAT, Prompt, PromptEncoder, PromptRequest)
from prefixroute.core.diagnostics.serialize import canonical_tools, canonical_tools_json, tool_name
from prefixroute.core.diagnostics.volatile import (CHANGED_CONTENT, COUNTER, EMAIL, REQUEST_ID,
                                                   TIMESTAMP, USER_NAME, UUID, Span,
                                                   classify_change, shape_of, with_article)
from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.caches.base import cacheable_tokens
from prefixroute.core.identity.hashing import BlockHasher

DEFAULT_BLOCK_SIZE = 16  # vLLM's default KV block size on GPUs (the worked examples use 16 too)
ENCODE_CHUNK = 1000  # requests per tokenizer call: large enough for parallelism, small for progress
CONTEXT_TOKENS = 12  # tokens decoded either side of a divergence to name what changed
MAX_SHUFFLE_SEGMENTS = 64  # how far a reordered run of messages is followed
CONVERSATION_ROLES = ("user", "assistant", "tool", "function")
MIN_DERIVED_CHARS = 12  # shorter messages are too short to call one rewritten from the other
MAX_COMPARED_CHARS = 2000  # characters of a message compared when looking for a rewrite
# Static text after a line's last changing value that keeps the line in the static region: about
# one 16-token block at ~4 characters a token. "Current time: X. You are a support bot..." on one
# line loses every block after X; "Current time: X" alone at the end loses nothing.
MIN_STATIC_TAIL_CHARS = 64
_SENTENCE_END = re.compile(r"[.!?;](?:\s+|$)")

REORDERED_TOOLS = "reordered tool list"
TOOL_KEY_ORDER = "tool schema key order"
CHANGED_TOOLS = "changed tool definitions"
SHUFFLED_EXAMPLES = "shuffled few-shot examples"
REWRITTEN_TURN = "rewritten earlier turn"
CHANGED_TEMPLATE = "changed template"
AFTER_STATIC_REGION = "after the static region"  # a divergence where requests should differ

FIXES = {
    TIMESTAMP: "move the time to the end of the prompt (after the static region), or drop it",
    UUID: "send ids as request metadata or headers, or at the end of the prompt",
    REQUEST_ID: "send ids as request metadata or headers, or at the end of the prompt",
    COUNTER: "move counters to the end of the prompt",
    USER_NAME: "put per-user details after the static region",
    EMAIL: "put per-user details after the static region",
    REORDERED_TOOLS: "sort tools by name (serialize.canonical_tools)",
    TOOL_KEY_ORDER: "serialise tool schemas with sorted keys (serialize.canonical_tools)",
    CHANGED_TOOLS: "pin tool definitions per release; add new tools at the end",
    SHUFFLED_EXAMPLES: "keep few-shot examples in one fixed order",
    REWRITTEN_TURN: "append to conversations; never rewrite or trim earlier turns",
    CHANGED_TEMPLATE: "pin the prompt template with the model and change it rarely, all at once",
}

ProgressFn = Callable[[str, int, int], None]


@dataclass(slots=True)
class Finding:
    """One rule broken by one tenant's requests, with an example a reader can open."""

    kind: str
    message: str
    requests_affected: int
    example_where: str
    example: str
    token: int | None
    fix: str


@dataclass(slots=True)
class TenantReport:
    tenant: str
    requests: int
    total_tokens: int
    reused_tokens_now: int
    reused_tokens_after: int
    token_hit_rate_now: float
    token_hit_rate_after: float
    static_region_units: int
    static_region_tokens: int | None
    static_region_shared_by: int
    first_divergence: dict
    findings: list[Finding] = field(default_factory=list)


@dataclass(slots=True)
class LintReport:
    block_size: int
    requests: int
    total_tokens: int
    reused_tokens_now: int
    reused_tokens_after: int
    token_hit_rate_now: float
    token_hit_rate_after: float
    tenants: list[TenantReport]
    cache_model: str = ("infinite per-partition cache (tenant, model, cache_salt): a request "
                        "reuses the full blocks it shares with any earlier request; no capacity, "
                        "eviction or TTL; the last prompt token is always recomputed")

    @property
    def findings(self) -> list[tuple[str, Finding]]:
        return [(t.tenant, f) for t in self.tenants for f in t.findings]

    def to_dict(self) -> dict:
        return asdict(self)


# -- structure ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Parsed:
    """A request cut into segments (tool list, messages or paragraphs) and units (lines)."""

    request: PromptRequest
    segments: list[tuple[str, str]]  # (role, text)
    message_offset: int  # segments before the first message (1 with a tool list)
    unit_ids: list[int]
    unit_lines: list[str]
    unit_segment: list[int]
    segment_ids: list[int]  # shape of each segment: equal ids, equal text up to volatile values
    tools_raw: str | None = None


class _Shapes:
    """Interned shapes of lines, units and segments, each computed once per distinct text."""

    def __init__(self) -> None:
        self.lines: dict[str, tuple[str, tuple[Span, ...]]] = {}
        self.units: dict[tuple[str, str], int] = {}
        self.segments: dict[tuple[int, ...], int] = {}
        self.unit_has_values: list[bool] = []
        self.tools_canonical: dict[str, str] = {}

    def _intern(self, key: tuple[str, str], has_values: bool) -> int:
        unit_id = self.units.get(key)
        if unit_id is None:
            unit_id = self.units[key] = len(self.units)
            self.unit_has_values.append(has_values)
        return unit_id

    def unit(self, role: str, line: str) -> int:
        known = self.lines.get(line)
        if known is None:
            known = self.lines[line] = shape_of(line)
        return self._intern((role, known[0]), bool(known[1]))

    def spans(self, line: str) -> tuple[Span, ...]:
        return self.lines[line][1]

    def tools_unit(self, tools_raw: str, tools: list) -> int:
        canonical = self.tools_canonical.get(tools_raw)
        if canonical is None:
            canonical = self.tools_canonical[tools_raw] = canonical_tools_json(tools)
        return self._intern(("tools", canonical), False)

    def segment(self, unit_ids: tuple[int, ...]) -> int:
        segment_id = self.segments.get(unit_ids)
        if segment_id is None:
            segment_id = self.segments[unit_ids] = len(self.segments)
        return segment_id


_PARAGRAPH = re.compile(r"(?<=\n\n)(?=[^\n])")


def _segments(request: PromptRequest) -> tuple[list[tuple[str, str]], int, str | None]:
    if request.kind == CHAT:
        segments = []
        tools_raw = None
        if request.tools:
            tools_raw = json.dumps(request.tools, ensure_ascii=False)
            segments.append(("tools", tools_raw))
        offset = len(segments)
        segments.extend((m["role"], m["content"]) for m in request.messages or ())
        return segments, offset, tools_raw
    if request.prompt is None:
        return [], 0, None  # token ids only: nothing to read
    return [("prompt", p) for p in _PARAGRAPH.split(request.prompt)], 0, None


def _parse(request: PromptRequest, shapes: _Shapes) -> _Parsed:
    segments, offset, tools_raw = _segments(request)
    unit_ids: list[int] = []
    unit_lines: list[str] = []
    unit_segment: list[int] = []
    segment_ids: list[int] = []
    for index, (role, text) in enumerate(segments):
        start = len(unit_ids)
        if index < offset:  # the tool list: one unit, compared in canonical form
            try:
                unit_ids.append(shapes.tools_unit(tools_raw, request.tools))
            except InputError as exc:
                raise InputError(f"tools: {exc}", where=request.where, field="tools") from None
            unit_lines.append(text)
            unit_segment.append(index)
        else:
            for line in text.splitlines(keepends=True) or [""]:
                unit_ids.append(shapes.unit(role, line))
                unit_lines.append(line)
                unit_segment.append(index)
        segment_ids.append(shapes.segment(tuple(unit_ids[start:])))
    return _Parsed(request, segments, offset, unit_ids, unit_lines, unit_segment, segment_ids,
                   tools_raw)


def _majority_prefix(sequences: list[list[int]]) -> tuple[int, int]:
    """(length, index) of the longest prefix that at least half the sequences (two at least)
    share, and one sequence that has it. Sorting puts sequences with a common prefix next to
    each other, so the best window of k sorted neighbours gives it in O(n log n) comparisons."""
    n = len(sequences)
    if n < 2:
        return 0, 0
    k = max(2, (n + 1) // 2)
    order = sorted(range(n), key=sequences.__getitem__)
    best_length, best_index = -1, order[0]
    for w in range(n - k + 1):
        length = common_prefix_length(sequences[order[w]], sequences[order[w + k - 1]])
        if length > best_length:
            best_length, best_index = length, order[w]
    return best_length, best_index


def _snippet(text: str, limit: int = 80) -> str:
    text = text.strip().replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 1] + "…"


# -- per-tenant structural analysis ---------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    """A finding whose token position is filled in once the requests are tokenized."""

    finding: Finding
    request: int  # log index of the example
    previous: int | None = None  # log index of the request it is compared with
    char_probe: tuple[int, int] | None = None  # (unit index, offset in line) of the value


@dataclass(slots=True)
class _TenantAnalysis:
    tenant: str
    members: list[int]
    static_units: int = 0
    shared_by: list[int] = field(default_factory=list)
    reference: int | None = None
    head: list[int] = field(default_factory=list)  # the static region's unit ids
    fix_tools: bool = False  # tools came in another order or key order: serialise canonically
    pair_causes: dict[int, str] = field(default_factory=dict)  # request -> why it differs from
    # the one before, when a structural rule explains it (the tokens alone only say "changed")
    volatile_units: set[int] = field(default_factory=set)
    volatile_slots: dict[int, set[int]] = field(default_factory=dict)  # unit -> positions of
    # its values that change (indices into the line's spans)
    shuffles: list[tuple[int, int, Counter]] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)


def _analyse_static(analysis: _TenantAnalysis, parsed: list[_Parsed], shapes: _Shapes) -> None:
    members = analysis.members
    sequences = [parsed[i].unit_ids for i in members]
    length, index = _majority_prefix(sequences)
    if len(members) < 2 or length <= 0:
        return
    reference = parsed[members[index]]
    head = reference.unit_ids[:length]
    sharing = [i for i in members if parsed[i].unit_ids[:length] == head]
    # The region ends with the last unit whose text all those requests share: a value that
    # changes with nothing static after it costs no cached block (the new turn, a timestamp at
    # the very end), so it is not part of the static region. A line that goes on with static
    # text after its values (a system prompt on one line that opens with the time) stays in.
    while length and shapes.unit_has_values[head[length - 1]] and len(
            {parsed[i].unit_lines[length - 1] for i in sharing}) > 1 \
            and not _static_after_values([parsed[i].unit_lines[length - 1] for i in sharing],
                                         shapes):
        length -= 1
    if length == 0:
        return
    analysis.static_units = length
    analysis.reference = members[index]
    head = analysis.head = head[:length]
    analysis.shared_by = [i for i in members if parsed[i].unit_ids[:length] == head]
    shared = set(analysis.shared_by)
    outside = [i for i in members if i not in shared]

    # Values that change at one place inside the static region.
    for unit in (u for u in range(length) if shapes.unit_has_values[head[u]]):
        by_kind: dict[str, dict] = {}
        previous_values = None
        previous_request = None
        for i in analysis.shared_by:
            line = parsed[i].unit_lines[unit]
            spans = shapes.spans(line)
            values = tuple(s.text for s in spans)
            if previous_values is not None:
                for slot, span in enumerate(spans):
                    if slot < len(previous_values) and previous_values[slot] != span.text:
                        entry = by_kind.setdefault(span.kind, {
                            "changes": 0, "values": set(), "example": (i, previous_request, slot)})
                        entry["changes"] += 1
                        analysis.volatile_slots.setdefault(unit, set()).add(slot)
            for span in spans:
                if span.kind in by_kind:
                    by_kind[span.kind]["values"].add(span.text)
            previous_values, previous_request = values, i
        if not by_kind:
            continue
        analysis.volatile_units.add(unit)
        segment = reference.unit_segment[unit]
        role = reference.segments[segment][0]
        line_number = unit - reference.unit_segment.index(segment) + 1
        for kind, entry in by_kind.items():
            example, previous, slot = entry["example"]
            span = shapes.spans(parsed[example].unit_lines[unit])[slot]
            before = shapes.spans(parsed[previous].unit_lines[unit])[slot].text
            where = _where_in_request(parsed[example], segment, role, line_number)
            message = (f"{with_article(kind)} in the static region ({where}) changes between "
                       f"{entry['changes']} of {len(analysis.shared_by) - 1} consecutive "
                       f"requests: {before!r} then {span.text!r}")
            analysis.pending.append(_Pending(
                Finding(kind, message, entry["changes"] + 1, parsed[example].request.where,
                        _snippet(parsed[example].unit_lines[unit]), None, FIXES[kind]),
                example, previous, (unit, span.start)))

    # Requests whose static region differs from the majority's in the template's own parts (a
    # system prompt, the tools, a completions prompt): a changed template. Differences in user
    # and assistant turns are other conversations, not template changes.
    outside = [i for i in outside
               if _role_at(parsed[i], common_prefix_length(parsed[i].unit_ids, head))
               not in CONVERSATION_ROLES]
    if outside:
        first = parsed[outside[0]]
        at = common_prefix_length(first.unit_ids, head)
        if at < len(first.unit_lines):
            theirs = _snippet(first.unit_lines[at], 60)
        else:
            theirs = "(ends here)"
        ours = _snippet(reference.unit_lines[at], 60)
        segment = reference.unit_segment[at]
        role = reference.segments[segment][0]
        message = (f"{len(outside)} of {len(members)} requests have another static region: "
                   f"{first.request.where} differs at the {role} part: {theirs!r} where most "
                   f"requests have {ours!r}")
        analysis.pending.append(_Pending(
            Finding(CHANGED_TEMPLATE, message, len(outside), first.request.where, theirs, None,
                    FIXES[CHANGED_TEMPLATE]), outside[0], analysis.reference))


def _role_at(parsed: _Parsed, unit: int) -> str | None:
    if unit >= len(parsed.unit_segment):
        return None
    return parsed.segments[parsed.unit_segment[unit]][0]


def _where_in_request(parsed: _Parsed, segment: int, role: str, line_number: int) -> str:
    if role == "prompt":
        return f"prompt paragraph {segment + 1}, line {line_number}"
    message = segment - parsed.message_offset
    return f"message {message} ({role}), line {line_number}"


def _analyse_tools(analysis: _TenantAnalysis, parsed: list[_Parsed], shapes: _Shapes) -> None:
    counts = Counter()
    examples: dict[str, tuple[int, int, str]] = {}
    previous: _Parsed | None = None
    previous_index = None
    for i in analysis.members:
        p = parsed[i]
        if p.tools_raw is None:
            continue
        if previous is not None and p.tools_raw != previous.tools_raw:
            names = [tool_name(t) for t in p.request.tools]
            before = [tool_name(t) for t in previous.request.tools]
            if shapes.tools_canonical[p.tools_raw] != shapes.tools_canonical[previous.tools_raw]:
                found = {CHANGED_TOOLS: "the tool definitions themselves changed"}
            else:
                found = {}
                if names != before:
                    found[REORDERED_TOOLS] = f"{before} became {names}"
                mine = {tool_name(t): json.dumps(t, ensure_ascii=False) for t in p.request.tools}
                theirs = {tool_name(t): json.dumps(t, ensure_ascii=False)
                          for t in previous.request.tools}
                changed = sorted(n for n in mine if mine[n] != theirs.get(n))
                if changed:
                    found[TOOL_KEY_ORDER] = (f"the schema of {changed[0]!r} lists the same keys "
                                             "in another order")
            analysis.fix_tools = analysis.fix_tools or CHANGED_TOOLS not in found
            analysis.pair_causes[i] = next(iter(found))
            for kind, detail in found.items():
                counts[kind] += 1
                examples.setdefault(kind, (i, previous_index, detail))
        previous, previous_index = p, i
    pairs = sum(1 for i in analysis.members if parsed[i].tools_raw is not None) - 1
    for kind, count in counts.items():
        i, before, detail = examples[kind]
        message = (f"{count} of {pairs} consecutive requests with tools differ from the one "
                   f"before: {detail} ({parsed[i].request.where})")
        analysis.pending.append(_Pending(
            Finding(kind, message, count, parsed[i].request.where, _snippet(detail), None,
                    FIXES[kind]), i, before))


def _reordered_run(a: list[int], b: list[int], start: int) -> int:
    """Length of the longest run from ``start`` that holds the same segments in both, in
    another order (0 if none of at least two)."""
    balance: Counter = Counter()
    best = 0
    limit = min(len(a), len(b), start + MAX_SHUFFLE_SEGMENTS)
    for end in range(start, limit):
        balance[a[end]] += 1
        balance[b[end]] -= 1
        if not any(balance.values()):
            best = end - start + 1
    return best if best >= 2 else 0


def _analyse_order(analysis: _TenantAnalysis, parsed: list[_Parsed]) -> None:
    count = 0
    example = None
    previous = None
    for i in analysis.members:
        p = parsed[i]
        if previous is not None:
            a, b = parsed[previous].segment_ids, p.segment_ids
            start = common_prefix_length(a, b)
            run = _reordered_run(a, b, start) if start < min(len(a), len(b)) else 0
            if run:
                analysis.pair_causes.setdefault(i, SHUFFLED_EXAMPLES)
                count += 1
                if example is None:
                    example = (i, previous, start, run)
                analysis.shuffles.append((start, run, Counter(b[start:start + run])))
        previous = i
    if example is None:
        return
    i, previous, start, run = example
    p = parsed[i]
    roles = "/".join(dict.fromkeys(p.segments[s][0] for s in range(start, start + run)))
    if p.request.kind == CHAT:
        where = (f"messages {start - p.message_offset}..{start - p.message_offset + run - 1} "
                 f"({roles})")
    else:
        where = f"prompt paragraphs {start + 1}..{start + run}"
    message = (f"{count} requests hold the same {where} as the request before them, in another "
               f"order (first {parsed[previous].request.where} then {p.request.where})")
    analysis.pending.append(_Pending(
        Finding(SHUFFLED_EXAMPLES, message, count, p.request.where,
                _snippet(p.segments[start][1]), None, FIXES[SHUFFLED_EXAMPLES]), i, previous))


def _derived(a: str, b: str) -> bool:
    """Whether one message looks rewritten from the other (trimmed, summarised, edited): a
    common run of characters covers at least half of the shorter one."""
    a, b = a[:MAX_COMPARED_CHARS], b[:MAX_COMPARED_CHARS]
    shorter = min(len(a), len(b))
    if shorter < MIN_DERIVED_CHARS:
        return False
    match = SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b))
    return match.size * 2 >= shorter


def _continued(parsed: list[_Parsed], p: _Parsed, latest: dict, by_length: dict) -> tuple[int, int] | None:
    """(earlier request, its message count) that ``p`` continues, if any.

    A request continues an earlier one when it repeats that request's last user turn at the same
    position (up to volatile values). Failing that, when the latest earlier request two messages
    shorter ends with a user turn that ``p`` holds rewritten (a client that trims or summarises
    the turn it resends), with an assistant reply after it.
    """
    messages = p.request.messages or ()
    ids = p.segment_ids[p.message_offset:]
    for position in range(len(messages) - 2, 0, -1):
        if messages[position]["role"] == "user":
            earlier = latest.get((position, ids[position]))
            if earlier is not None:
                return earlier, position + 1
            break
    earlier = by_length.get(len(messages) - 2)
    if earlier is None or messages[len(messages) - 2]["role"] != "assistant":
        return None
    before = parsed[earlier].request.messages
    differing = [k for k in range(len(before)) if
                 parsed[earlier].segment_ids[parsed[earlier].message_offset + k] != ids[k]]
    if differing and all(before[k]["role"] == messages[k]["role"] and
                         _derived(before[k]["content"], messages[k]["content"])
                         for k in differing):
        return earlier, len(before)
    return None


def _analyse_turns(analysis: _TenantAnalysis, parsed: list[_Parsed]) -> None:
    """Conversations must grow by appending: every message a continued request repeats from
    the one it continues must be unchanged (up to volatile values, which the static analysis
    reports)."""
    latest: dict[tuple[int, int], int] = {}
    by_length: dict[int, int] = {}
    count = 0
    example = None
    for i in analysis.members:
        p = parsed[i]
        if p.request.kind != CHAT:
            continue
        messages = p.request.messages or ()
        ids = p.segment_ids[p.message_offset:]
        link = _continued(parsed, p, latest, by_length)
        if link is not None:
            earlier, length = link
            before = parsed[earlier].segment_ids[parsed[earlier].message_offset:]
            changed = common_prefix_length(before[:length], ids[:length])
            # The same messages in another order are a shuffle (reported above), not a rewrite.
            if changed < length and Counter(before[:length]) != Counter(ids[:length]):
                count += 1
                if example is None:
                    example = (i, earlier, changed)
        if messages and messages[-1]["role"] == "user":
            latest[(len(messages) - 1, ids[-1])] = i
            by_length[len(messages)] = i
    if example is None:
        return
    i, earlier, changed = example
    p = parsed[i]
    role = p.request.messages[changed]["role"]
    message = (f"{count} requests continue an earlier conversation with an earlier turn "
               f"changed: {p.request.where} continues {parsed[earlier].request.where} but "
               f"message {changed} ({role}) differs")
    analysis.pending.append(_Pending(
        Finding(REWRITTEN_TURN, message, count, p.request.where,
                _snippet(p.request.messages[changed]["content"]), None, FIXES[REWRITTEN_TURN]),
        i, earlier))


# -- the fix: volatile parts moved behind the static region ---------------------------------


def _rewrite(p: _Parsed, analysis: _TenantAnalysis, shapes: _Shapes) -> PromptRequest | None:
    """The request laid out by the rules, or None when nothing changes."""
    request = p.request
    if request.kind != CHAT and request.prompt is None:
        return None
    texts = [text for _, text in p.segments]
    changed = False
    moved: list[str] = []
    if analysis.volatile_units and p.unit_ids[:analysis.static_units] == analysis.head:
        by_segment: dict[int, set[int]] = defaultdict(set)
        first_unit: dict[int, int] = {}
        for unit, segment in enumerate(p.unit_segment):
            first_unit.setdefault(segment, unit)
        for unit in sorted(analysis.volatile_units):
            by_segment[p.unit_segment[unit]].add(unit - first_unit[p.unit_segment[unit]])
        for segment, lines in by_segment.items():
            kept = []
            first = first_unit[segment]
            for n, line in enumerate(texts[segment].splitlines(keepends=True)):
                if n in lines:
                    stays, goes = _split_volatile(line, shapes.spans(line),
                                                  analysis.volatile_slots.get(first + n, ()))
                    moved.append(goes if goes.endswith("\n") else goes + "\n")
                    if stays:
                        kept.append(stays)
                else:
                    kept.append(line)
            texts[segment] = "".join(kept)
            changed = True
    order = list(range(len(texts)))
    for start, run, multiset in analysis.shuffles:
        if Counter(p.segment_ids[start:start + run]) == multiset:
            order[start:start + run] = _canonical_order(p, start, run)
            changed = changed or order != list(range(len(texts)))
            break
    tools = request.tools
    if request.kind == CHAT and tools and analysis.fix_tools:
        canonical = canonical_tools(tools)
        if json.dumps(canonical, ensure_ascii=False) != p.tools_raw:
            tools, changed = canonical, True
    if not changed:
        return None
    texts = [texts[i] for i in order]
    tail = "".join(moved).rstrip("\n")
    if request.kind == CHAT:
        roles = [p.segments[i] for i in order]
        messages = []
        for (role, _), text, source in zip(roles, texts, order):
            if source < p.message_offset:
                continue
            message = dict(request.messages[source - p.message_offset])
            message["content"] = text
            messages.append(message)
        if tail:
            last = messages[-1]
            last["content"] = last["content"] + ("\n" if last["content"] else "") + tail
        return PromptRequest(CHAT, request.tenant, messages=tuple(messages), tools=tools,
                             model=request.model, cache_salt=request.cache_salt,
                             where=request.where)
    prompt = "".join(texts)
    if tail:
        prompt = prompt + ("" if prompt.endswith("\n") or not prompt else "\n") + tail
    return PromptRequest(request.kind, request.tenant, prompt=prompt, model=request.model,
                         cache_salt=request.cache_salt, where=request.where)


def _changing_slots(lines: Sequence[str], shapes: _Shapes) -> set[int]:
    """Positions of the values that differ between ``lines`` (one unit's line in several
    requests, all of one shape)."""
    values = [tuple(span.text for span in shapes.spans(line)) for line in lines]
    width = min(map(len, values), default=0)
    return {slot for slot in range(width) if len({v[slot] for v in values}) > 1}


def _static_after_values(lines: Sequence[str], shapes: _Shapes) -> bool:
    """Do these lines (one unit in several requests) hold static text, at least
    :data:`MIN_STATIC_TAIL_CHARS`, after their first value that changes? Every block after
    that value is lost, so that text is the cost; later changing values are not static text,
    a fixed value ("refunds take 3 days") is."""
    slots = _changing_slots(lines, shapes)
    if not slots:
        return False
    line = lines[0]
    spans = shapes.spans(line)
    first = min(slots)
    static = len(line) - spans[first].end - sum(len(spans[s].text) for s in slots if s != first)
    return static - (len(line) - len(line.rstrip())) >= MIN_STATIC_TAIL_CHARS


def _split_volatile(line: str, spans: Sequence[Span], slots: Iterable[int]) -> tuple[str, str]:
    """(what stays, what moves to the end) for a static-region line whose values at ``slots``
    change: each such value's sentence moves (from the end of the sentence before it to the
    end of its own), so the static sentences around and between them keep their place; a line
    without any static sentence left moves whole ("" stays)."""
    changing = [spans[slot] for slot in sorted(slots) if slot < len(spans)] or list(spans)
    if not changing:
        return "", line
    ranges: list[list[int]] = []
    for span in changing:
        begin = 0
        for match in _SENTENCE_END.finditer(line, 0, span.start):
            begin = match.end()
        after = _SENTENCE_END.search(line, span.end)
        stop = after.end() if after else len(line)
        if ranges and begin <= ranges[-1][1]:  # the same sentence, or overlapping ones
            ranges[-1][1] = max(ranges[-1][1], stop)
        else:
            ranges.append([begin, stop])
    kept, last = [], 0
    for begin, stop in ranges:
        kept.append(line[last:begin])
        last = stop
    kept.append(line[last:])
    stays = "".join(kept).rstrip()
    if not stays.strip():
        return "", line
    goes = " ".join(line[begin:stop].strip() for begin, stop in ranges)
    return stays + ("\n" if line.endswith("\n") else ""), goes


def _canonical_order(p: _Parsed, start: int, run: int) -> list[int]:
    """One fixed order for a reordered run: (user, assistant) pairs sorted by their text when
    the run is made of such pairs, else single segments sorted by their text."""
    indices = list(range(start, start + run))
    roles = [p.segments[i][0] for i in indices]
    if run % 2 == 0 and all(roles[k] == "user" and roles[k + 1] == "assistant"
                            for k in range(0, run, 2)):
        pairs = [indices[k:k + 2] for k in range(0, run, 2)]
        pairs.sort(key=lambda pair: (p.segments[pair[0]][1], p.segments[pair[1]][1]))
        return [i for pair in pairs for i in pair]
    return sorted(indices, key=lambda i: p.segments[i][1])


# -- tokens ---------------------------------------------------------------------------------


class _BlockCache:
    """The infinite cache of one partition: the chained keys of every full block seen.

    Keys come from the project's one hashing module (``native`` profile), so the lint counts
    blocks exactly as the simulator and the caches do.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.hasher = BlockHasher("native", block_size=block_size)
        self.seen: set[int] = set()

    def reuse(self, ids: Sequence[int]) -> int:
        """Tokens of ``ids`` served from cache, then remember all of its full blocks."""
        keys = self.hasher.block_hashes(ids)
        seen = self.seen
        matched = 0
        for key in keys:
            if key not in seen:
                break
            matched += 1
        seen.update(keys[matched:])
        # vLLM recomputes the last prompt token even when every block is cached.
        return min(matched * self.block_size, cacheable_tokens(len(ids), self.block_size))


def _encode(requests: Sequence[PromptRequest], encoder: PromptEncoder | None, stage: str,
            progress: ProgressFn | None) -> list[Sequence[int]]:
    out: list[Sequence[int]] = []
    total = len(requests)
    for start in range(0, total, ENCODE_CHUNK):
        chunk = requests[start:start + ENCODE_CHUNK]
        text_index = [k for k, r in enumerate(chunk) if r.prompt_token_ids is None]
        encoded: list[Sequence[int] | None] = [r.prompt_token_ids for r in chunk]
        if text_index:
            if encoder is None:
                raise InputError("a tokenizer is needed for text prompts",
                                 where=chunk[text_index[0]].where)
            prompts = []
            for k in text_index:
                try:
                    prompts.append(encoder.render(chunk[k]))
                except InputError as exc:
                    raise InputError(str(exc), where=chunk[k].where) from None
            for k, ids in zip(text_index, encoder.encode_prompts(prompts)):
                encoded[k] = ids
        out.extend(encoded)  # type: ignore[arg-type]
        if progress:
            progress(stage, min(start + ENCODE_CHUNK, total), total)
    return out


def _divergence_kind(encoder: PromptEncoder | None, a: Sequence[int], b: Sequence[int],
                     at: int) -> str:
    """What sits at the first differing token of ``a`` and ``b`` (see :func:`.volatile.classify_change`)."""
    if encoder is None:
        return CHANGED_CONTENT
    start = max(0, at - CONTEXT_TOKENS)
    text_a = encoder.decode(a[start:at + CONTEXT_TOKENS])
    text_b = encoder.decode(b[start:at + CONTEXT_TOKENS])
    return classify_change(text_a, text_b)


def _token_of_value(encoder: PromptEncoder, parsed: _Parsed, unit: int, offset: int) -> int | None:
    """About which token a value sits at: the length of the tokenized text before it."""
    prompt = encoder.render(parsed.request)
    line = parsed.unit_lines[unit]
    # Search from the line's segment on: a template may repeat the line's text elsewhere.
    at = prompt.text.find(line.rstrip("\n"))
    if at < 0:
        return None
    before = Prompt(prompt.text[:at + offset], prompt.add_special_tokens)
    return len(encoder.encode_prompts([before])[0])


# -- the lint -------------------------------------------------------------------------------


def lint_requests(requests: Sequence[PromptRequest], encoder: PromptEncoder | None,
                  block_size: int = DEFAULT_BLOCK_SIZE,
                  progress: ProgressFn | None = None) -> LintReport:
    """Lint ``requests`` (in log order) and estimate the token hit rate now and after the fix.

    ``encoder`` renders and tokenizes the requests as the engine does; it may be ``None`` only
    when every request carries token ids. ``progress(stage, done, total)`` is called as work
    advances (stages "parse", "tokenize", "tokenize fixed").
    """
    if block_size < 1:
        raise ConfigError(f"block size must be at least 1, got {block_size}")
    shapes = _Shapes()
    parsed = []
    for n, request in enumerate(requests):
        parsed.append(_parse(request, shapes))
        if progress and (n + 1) % ENCODE_CHUNK == 0:
            progress("parse", n + 1, len(requests))
    if progress:
        progress("parse", len(requests), len(requests))

    tenants: dict[str, list[int]] = defaultdict(list)
    partitions: dict[tuple, list[int]] = defaultdict(list)
    for i, request in enumerate(requests):
        tenants[request.tenant].append(i)
        partitions[request.cache_partition].append(i)

    analyses = {}
    for tenant, members in tenants.items():
        analysis = _TenantAnalysis(tenant, members)
        _analyse_static(analysis, parsed, shapes)
        _analyse_tools(analysis, parsed, shapes)
        _analyse_order(analysis, parsed)
        _analyse_turns(analysis, parsed)
        analyses[tenant] = analysis

    ids_now = _encode(requests, encoder, "tokenize", progress)

    # Requests laid out by the rules; only those that change are tokenized again.
    fixed_index, fixed_requests = [], []
    for i, p in enumerate(parsed):
        rewritten = _rewrite(p, analyses[p.request.tenant], shapes)
        if rewritten is not None:
            fixed_index.append(i)
            fixed_requests.append(rewritten)
    ids_after = list(ids_now)
    for i, ids in zip(fixed_index, _encode(fixed_requests, encoder, "tokenize fixed", progress)):
        ids_after[i] = ids

    static_tokens = {tenant: _static_tokens(analysis, ids_after)
                     for tenant, analysis in analyses.items()}
    predecessor = {}  # request -> the tenant's request before it, the pair the rules compared
    for members in tenants.values():
        predecessor.update(zip(members[1:], members))
    reused_now = [0] * len(requests)
    reused_after = [0] * len(requests)
    divergence: dict[int, tuple[int, str]] = {}  # request -> (token, kind) vs its predecessor
    for members in partitions.values():
        now, after = _BlockCache(block_size), _BlockCache(block_size)
        previous = None
        for i in members:
            reused_now[i] = now.reuse(ids_now[i])
            reused_after[i] = after.reuse(ids_after[i])
            if previous is not None:
                a, b = ids_now[previous], ids_now[i]
                at = common_prefix_length(a, b)
                if at < min(len(a), len(b)):
                    kind = _divergence_kind(encoder, a, b, at)
                    if kind == CHANGED_CONTENT and previous == predecessor.get(i):
                        kind = analyses[requests[i].tenant].pair_causes.get(i, kind)
                    static = static_tokens[requests[i].tenant]
                    if static is not None and at >= static:  # where requests should differ
                        kind = AFTER_STATIC_REGION
                    divergence[i] = (at, kind)
            previous = i

    reports = []
    for tenant, analysis in analyses.items():
        members = analysis.members
        for pending in analysis.pending:
            _place(pending, parsed, ids_now, encoder)
        total = sum(len(ids_now[i]) for i in members)
        now = sum(reused_now[i] for i in members)
        after = sum(reused_after[i] for i in members)
        points = [divergence[i] for i in members if i in divergence]
        tokens = [at for at, _ in points]
        causes = Counter(kind for _, kind in points)
        reports.append(TenantReport(
            tenant=tenant,
            requests=len(members),
            total_tokens=total,
            reused_tokens_now=now,
            reused_tokens_after=after,
            token_hit_rate_now=now / total if total else 0.0,
            token_hit_rate_after=after / total if total else 0.0,
            static_region_units=analysis.static_units,
            static_region_tokens=static_tokens[tenant],
            static_region_shared_by=len(analysis.shared_by),
            first_divergence={
                "pairs": len(points),
                "median_token": statistics.median(tokens) if tokens else None,
                "min_token": min(tokens) if tokens else None,
                "max_token": max(tokens) if tokens else None,
                "causes": dict(causes.most_common()),
            },
            findings=sorted((p.finding for p in analysis.pending),
                            key=lambda f: (f.token is None, f.token or 0, f.kind)),
        ))
    reports.sort(key=lambda r: (-r.requests, r.tenant))
    total = sum(r.total_tokens for r in reports)
    now = sum(r.reused_tokens_now for r in reports)
    after = sum(r.reused_tokens_after for r in reports)
    return LintReport(block_size=block_size, requests=len(requests), total_tokens=total,
                      reused_tokens_now=now, reused_tokens_after=after,
                      token_hit_rate_now=now / total if total else 0.0,
                      token_hit_rate_after=after / total if total else 0.0, tenants=reports)


def _place(pending: _Pending, parsed: list[_Parsed], ids_now: list[Sequence[int]],
           encoder: PromptEncoder | None) -> None:
    """Fill in the token position of a finding's example."""
    if pending.char_probe is not None and encoder is not None:
        unit, offset = pending.char_probe
        pending.finding.token = _token_of_value(encoder, parsed[pending.request], unit, offset)
    elif pending.previous is not None:
        a, b = ids_now[pending.previous], ids_now[pending.request]
        at = common_prefix_length(a, b)
        pending.finding.token = at if at < max(len(a), len(b)) else None


def _static_tokens(analysis: _TenantAnalysis, ids_after: list[Sequence[int]]) -> int | None:
    """Tokens of the static region once laid out by the rules: what the requests that share it
    have in common after the fix."""
    if analysis.reference is None or len(analysis.shared_by) < 2:
        return None
    reference = ids_after[analysis.reference]
    return min(common_prefix_length(reference, ids_after[i])
               for i in analysis.shared_by if i != analysis.reference)
