"""Volatile values: the text that changes from request to request and breaks a cached prefix.

The layout rules (docs/concepts.md, "Prompt layout") name them: timestamps and dates, request ids
and UUIDs, counters, user names and e-mail addresses. :func:`find_volatile_spans` finds candidates
by shape; a candidate is only *volatile* when its value differs between requests at the same place,
which the lint decides (a fixed "knowledge cutoff: 2024-06" date is static).
:func:`classify_change` names what changed at a divergence, for the diff verdict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TIMESTAMP = "timestamp"
UUID = "UUID"
REQUEST_ID = "request id"
EMAIL = "e-mail address"
USER_NAME = "user name"
COUNTER = "counter"
CHANGED_CONTENT = "changed content"

# Kinds in the order a verdict names them, with their article.
ARTICLES = {TIMESTAMP: "a", UUID: "a", REQUEST_ID: "a", EMAIL: "an", USER_NAME: "a",
            COUNTER: "a", CHANGED_CONTENT: ""}

_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
          r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_WEEKDAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*"
_TIME = r"\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?[AaPp]\.?[Mm]\.?)?(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}))?"
_ISO_DATE = r"\d{4}-\d{2}(?:-\d{2}(?:[T ]" + _TIME + r")?)?"

# Alternatives in priority order: at one position the first that matches wins, so a UUID is not
# read as a date and an e-mail address not as a user name. Bare hex ids of 8 to 15 digits (the
# 12 of a short trace id, a git-style short hash) need a digit and a letter a-f, so that neither
# a word ("deadbeef", "facade") nor a plain number (a counter) reads as one. Named groups give the kind; for user
# names only the ``name`` group (after a cue word) is the value.
_PATTERN = re.compile(
    r"(?P<uuid>\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b)"
    r"|(?P<email>\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b)"
    r"|(?P<timestamp>\b(?:" + _ISO_DATE
    + r"|(?:" + _WEEKDAY + r",?\s+)?(?:\d{1,2}\s+" + _MONTH + r"|" + _MONTH + r"\s+\d{1,2}(?:st|nd|rd|th)?)"
    + r"(?:,?\s+\d{4})?(?:,?\s+(?:at\s+)?" + _TIME + r")?"
    + r"|\d{1,2}[/.]\d{1,2}[/.]\d{2,4}(?:,?\s+" + _TIME + r")?"
    + r"|" + _TIME + r"(?=\W|$)"
    + r"|1[5-9]\d{8}(?:\d{3})?)\b)"
    r"|(?P<request_id>\b(?:req|request|trace|span|session|sess|conv|msg|chatcmpl|cmpl|run|call|txn|job)"
    r"[-_:]?(?=[A-Za-z0-9]*\d)[A-Za-z0-9]{6,}\b"
    r"|\b[0-9a-fA-F]{16,}\b"
    r"|\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,15}\b"
    r"|\b(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[A-Za-z])[A-Za-z0-9_-]{20,}\b)"
    r"|(?P<user_cue>\b(?:[Uu]ser(?:name)?|[Nn]ame|[Cc]ustomer|[Cc]lient|[Aa]ccount|[Hh]ello|[Hh]i|[Dd]ear"
    r"|talking to|speaking with|logged in as|signed in as)\b[:=,]?[ \t]+)(?P<name>@?[A-Z][\w'-]+(?: [A-Z][\w'-]+)?)"
    r"|(?P<handle>(?<![\w.])@[A-Za-z_][A-Za-z0-9_]{2,})"
    r"|(?P<counter>(?<![\w.])#?\d+\b)"
)

_GROUP_KIND = {"uuid": UUID, "email": EMAIL, "timestamp": TIMESTAMP, "request_id": REQUEST_ID,
               "name": USER_NAME, "handle": USER_NAME, "counter": COUNTER}


@dataclass(frozen=True, slots=True)
class Span:
    """A candidate volatile value: its kind and where it sits in the text."""

    kind: str
    start: int
    end: int
    text: str


# Every candidate holds a digit, an "@" or a cue word (a random UUID without any digit has odds
# near 1e-14): texts without any skip the full pattern, which is ten times slower.
_MAYBE = re.compile(r"[\d@]|\b(?:[Uu]ser|[Nn]ame|[Cc]ustomer|[Cc]lient|[Aa]ccount|[Hh]ello|[Hh]i"
                    r"|[Dd]ear|talking|speaking|logged|signed)")


def find_volatile_spans(text: str) -> list[Span]:
    """Every candidate volatile value in ``text``, left to right, non-overlapping."""
    if not _MAYBE.search(text):
        return []
    spans = []
    for match in _PATTERN.finditer(text):
        group = match.lastgroup
        if group == "name":  # the cue word stays; the name after it is the value
            start, end = match.span("name")
        else:
            start, end = match.span()
        spans.append(Span(_GROUP_KIND[group], start, end, text[start:end]))
    return spans


def shape_of(text: str) -> tuple[str, tuple[Span, ...]]:
    """The text with every candidate value replaced by a placeholder of its kind, and the values.

    Two lines with the same shape say the same thing apart from their values: equal shapes with
    different values at one place are how the lint tells a volatile value from static text.
    """
    spans = find_volatile_spans(text)
    if not spans:
        return text, ()
    pieces = []
    last = 0
    for span in spans:
        pieces.append(text[last:span.start])
        pieces.append(f"\x00{span.kind}\x00")
        last = span.end
    pieces.append(text[last:])
    return "".join(pieces), tuple(spans)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def classify_change(text_a: str, text_b: str) -> str:
    """What changed between two texts that share a beginning: the kind of the candidate value
    that covers the first differing character in either text, else ``"changed content"``.

    The texts are usually the decoded tokens around a divergence; they must start at the same
    place (the common prefix is context, not a change).
    """
    at = _common_prefix(text_a, text_b)
    if at == len(text_a) and at == len(text_b):
        return CHANGED_CONTENT
    for text in (text_a, text_b):
        for span in find_volatile_spans(text):
            # A value covers the divergence if the first differing character is inside it, or
            # right at its end when the other text's value is longer ("9" vs "10").
            if span.start <= at <= span.end and span.start < len(text) and (
                    at < span.end or at == len(text_a) or at == len(text_b)):
                return span.kind
            if span.start > at:
                break
    return CHANGED_CONTENT


def with_article(kind: str) -> str:
    article = ARTICLES.get(kind, "")
    return f"{article} {kind}" if article else kind
