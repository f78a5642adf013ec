"""The simulator's workloads as HTTP request bodies.

The requests come from the simulator's own generator (``core/simulator/generators.py``), so a
live run and a simulated run replay the same prompts: here the design scenario
(docs/concepts.md) with the timestamp fixed (out of the prefix), its tenants, prefixes, arrival
times and output lengths. Two ways to put the tokens on the wire:

``token_ids``
    the prompt as token ids (``/v1/completions`` accepts them): exact, and the gateway hashes
    them as the engine will without any tokenizer;
``text``
    one word per token id (letters only, so the emulator's fallback tokenizer and any
    word-level tokenizer give one token per word; ids become words base 26). For routers
    that only read text: ``sglang-router`` refuses token-id prompts, and its cache-aware
    policy matches characters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Sequence

from prefixroute.core.simulator.generators import design_scenario
from prefixroute.core.simulator.request import Request

TOKEN_IDS, TEXT = "token_ids", "text"
PROMPT_FORMATS = (TOKEN_IDS, TEXT)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, slots=True)
class WireRequest:
    """One request ready to send: ``body`` is the JSON for ``/v1/completions``."""

    index: int
    arrival_s: float  # engine time, from the generator
    tenant: str
    prompt_tokens: int
    max_tokens: int
    body: bytes


def word(token_id: int) -> str:
    """`` `` plus the id in base 26 written with letters: one word, one token."""
    letters = []
    n = token_id
    while True:
        n, digit = divmod(n, 26)
        letters.append(_LETTERS[digit])
        if n == 0:
            break
    return " " + "".join(reversed(letters))


def to_wire(requests: Iterable[Request], *, model: str, prompt_format: str = TOKEN_IDS,
            stream: bool = True) -> list[WireRequest]:
    """Bodies for ``/v1/completions``: the prompt, ``max_tokens`` = the generator's output
    length, and for streams ``stream_options.include_usage`` (the usage chunk carries
    ``cached_tokens``)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    words: dict[int, str] = {}
    out = []
    for index, request in enumerate(requests):
        tokens: Sequence[int] = request.token_ids or ()
        if prompt_format == TOKEN_IDS:
            prompt: object = list(tokens)
        else:
            pieces = []
            for t in tokens:
                w = words.get(t)
                if w is None:
                    w = words[t] = word(t)
                pieces.append(w)
            prompt = "".join(pieces)
        body: dict[str, object] = {"model": model, "prompt": prompt,
                                   "max_tokens": request.output_tokens, "temperature": 0}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        out.append(WireRequest(index, request.arrival_s, request.tenant, request.input_tokens,
                               request.output_tokens,
                               json.dumps(body, separators=(",", ":")).encode()))
    return out


def design_requests(requests: int, *, replicas: int, model: str,
                    prompt_format: str = TOKEN_IDS, rate_per_replica: float,
                    output_tokens: tuple[int, int], seed: int = 0,
                    **scenario: object) -> list[WireRequest]:
    """The first ``requests`` of the design scenario (timestamp fixed: prefixes are
    shared), arriving at ``rate_per_replica * replicas`` per second of engine time."""
    per_day = 50_000.0  # the scenario's own traffic; ``compress`` speeds it up
    compress = rate_per_replica * replicas * 86_400 / per_day
    generated = design_scenario(requests=requests, requests_per_day=per_day, compress=compress,
                                output_tokens_min=output_tokens[0],
                                output_tokens_max=output_tokens[1], timestamp_at_top=False,
                                seed=seed, **scenario)
    return to_wire(generated, model=model, prompt_format=prompt_format)
