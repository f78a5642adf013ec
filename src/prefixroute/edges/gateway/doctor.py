"""Does the gateway's idea of a prompt's blocks match the engine's? Probes that tell.

A cache-aware gateway is only as good as its block keys: if its tokenizer, chat template,
block size or hash function differ from the engine's, every prediction is wrong and the hit
rate quietly drops to what chance gives. The doctor sends a few small probes, each under a
fresh random ``cache_salt`` (so they can neither hit nor pollute anyone's cache), and checks:

``reachable``        ``GET /health`` and ``/v1/models`` answer; which model is probed.
``engine_config``    block size, hash algorithm and prefix caching from ``vllm:cache_config_info``.
``cached_tokens``    the engine reports ``usage.prompt_tokens_details.cached_tokens`` (vLLM
                     needs ``--enable-prompt-tokens-details``).
``prefix_hit``       a repeated token-id prompt of 505 tokens hits ``floor(504 / B) * B``
                     tokens (the engine recomputes the last token); 504 = 3*128 + 64 + 32 + 16 + 8
                     gives a different answer for B = 16, 32, 64 and 128, so the engine's real
                     block size can be read off the hit.
``salt_isolation``   the same prompt under another salt does not hit (the engine honours
                     ``cache_salt``; without it, tenants could probe each other).
``kv_events``        (with ``--kv-events``) the ``BlockStored`` ids the engine publishes for the
                     probe are the 64-bit keys the gateway computes (``vllm`` profile, salt,
                     algorithm): proof that an event-driven view will match. Canary requests
                     first confirm the event stream is up; when the probe's events still do
                     not arrive the check warns that it cannot tell.
``tokenize_*``       (with ``--tokenizer``) local tokens of a completion text and of a chat
                     conversation equal the engine's: compared token by token through
                     ``/v1/completions/render`` and ``/v1/chat/completions/render`` when the
                     engine has them, and always through the cache: the local token ids are
                     sent first, then the text or messages, which must hit all their full
                     blocks. A mismatch is reported at its first differing token.
``render_*``         (without ``--tokenizer``: what ``tokenization: backend`` relies on) the
                     render endpoints answer, and the token ids they give for a completion
                     text and a chat conversation are the ones the engine runs: sent first as
                     token ids, the text or messages must then hit all their full blocks. An
                     endpoint that is off (vLLM 0.32 answers 403 without
                     ``--enable-scale-out``) is a warning: the gateway would route on
                     character blocks.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.core.caches.base import cacheable_tokens
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import CacheIdentity

PROBE_TOKENS = 505  # 504 = 3*128 + 64 + 32 + 16 + 8: the hit differs for each block size
CANDIDATE_BLOCK_SIZES = (16, 32, 64, 128)
EVENT_WAIT_S = 3.0  # per wait for KV events; a CPU engine publishes within a step
CANARY_TOKENS = 2 * max(CANDIDATE_BLOCK_SIZES) + 1  # two full blocks at any common size
CANARY_ATTEMPTS = 5  # requests that may pass before a fresh subscription sees events
_NGRAM = 8  # leading token ids that tell a block of random probe tokens apart

COMPLETION_TEXT = (
    "The quick brown fox jumps over the lazy dog. Prefix caches reuse the keys and values of "
    "a prompt's leading tokens, so a repeated system prompt is computed once per replica. "
    "Numbers 0123456789, punctuation !?;:, quotes \"'`, tabs\tand  double  spaces, accents "
    "àéîõü and symbols € ÷ → keep tokenizers honest. " * 3)
CHAT_MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer briefly. " * 8},
    {"role": "user", "content": "What does a prefix cache store, and when is it reused?"},
    {"role": "assistant", "content": "It stores the KV state of leading prompt tokens."},
    {"role": "user", "content": "And what breaks a hit? List three causes, one per line."},
]

OK, FAIL, WARN, SKIP = "ok", "fail", "warn", "skip"


@dataclass(slots=True)
class Check:
    name: str
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                **({"data": self.data} if self.data else {})}


class ProbeError(Exception):
    """The backend cannot be probed at all (unreachable, no model)."""


def parse_cache_config(metrics_text: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (block_size, enable_prefix_caching,
    prefix_caching_hash_algo, num_gpu_blocks...), or {} when the engine does not export it
    (or serves a page ``prometheus_client``'s exposition parser refuses)."""
    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name == "vllm:cache_config_info":
                    return dict(sample.labels)
    except ValueError:
        pass
    return {}


class Doctor:
    """Runs the probes against one backend (``client`` has the backend as ``base_url``)."""

    def __init__(self, client: httpx.Client, *, model: str | None = None,
                 tokenizer: Any = None, block_size: int | None = None,
                 hash_algo: str | None = None, none_hash_seed: str | None = None,
                 events: Any = None):
        self.client = client
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.none_hash_seed = none_hash_seed
        self.events = events  # a started KVEventSubscriber, or None
        # Where the block size came from: "given" (--block-size), "engine" (its metrics) or
        # "assumed" (neither: the prefix-hit probe then measures it instead of judging it).
        self.block_size_source = "given" if block_size else "assumed"
        self.checks: list[Check] = []
        self._cached_reported = True

    # -- driver ---------------------------------------------------------------------------

    def run(self) -> list[Check]:
        self._reachable()
        self._engine_config()
        probe = self._probe_tokens()
        first = self._prefix_hit(probe)
        if first is not None:
            self._salt_isolation(probe)
            self._kv_events()
        if self.tokenizer is not None:
            self._tokenize_completion()
            self._tokenize_chat()
        else:
            self._render_tokens("render_completion", "/v1/completions",
                                {"model": self.model, "prompt": COMPLETION_TEXT})
            self._render_tokens("render_chat", "/v1/chat/completions",
                                {"model": self.model, "messages": CHAT_MESSAGES})
        return self.checks

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    # -- checks ---------------------------------------------------------------------------

    def _reachable(self) -> None:
        try:
            health = self.client.get("/health")
            models = self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ProbeError(f"cannot reach the backend: {type(exc).__name__}: {exc}") from None
        if health.status_code != 200:
            raise ProbeError(f"GET /health answered {health.status_code}")
        try:
            ids = [m["id"] for m in models.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise ProbeError(f"GET /v1/models did not list models "
                             f"({models.status_code})") from None
        if self.model is None:
            if not ids:
                raise ProbeError("the backend serves no model")
            self.model = ids[0]
        elif self.model not in ids:
            raise ProbeError(f"model {self.model!r} not served; the backend has "
                             f"{', '.join(ids)}")
        self.checks.append(Check("reachable", OK, f"healthy; probing model {self.model!r}",
                                 {"models": ids}))

    def _engine_config(self) -> None:
        try:
            text = self.client.get("/metrics").text
        except httpx.HTTPError:
            text = ""
        info = parse_cache_config(text)
        if not info:
            self.block_size = self.block_size or 16
            self.checks.append(Check("engine_config", WARN, "no vllm:cache_config_info in "
                                     "/metrics: block size and hash algorithm unknown (the "
                                     "prefix-hit probe measures the block size)"))
            return
        engine_block = int(info["block_size"]) if info.get("block_size", "").isdigit() else None
        engine_algo = info.get("prefix_caching_hash_algo") or None
        problems = []
        if info.get("enable_prefix_caching") not in (None, "True", "true"):
            problems.append("prefix caching is off (start vLLM with --enable-prefix-caching)")
        if self.block_size and engine_block and self.block_size != engine_block:
            problems.append(f"--block-size {self.block_size} but the engine uses "
                            f"{engine_block}")
        if self.hash_algo and engine_algo and self.hash_algo != engine_algo:
            problems.append(f"--hash-algo {self.hash_algo} but the engine uses {engine_algo}")
        if not self.block_size and engine_block:
            self.block_size_source = "engine"
        self.block_size = self.block_size or engine_block or 16
        self.hash_algo = self.hash_algo or engine_algo or "sha256"
        self.checks.append(Check(
            "engine_config", FAIL if problems else OK,
            "; ".join(problems) or f"block size {engine_block}, hash {engine_algo}, prefix "
            "caching on", {k: info[k] for k in ("block_size", "enable_prefix_caching",
                                                 "prefix_caching_hash_algo", "num_gpu_blocks")
                           if k in info}))

    def _probe_tokens(self) -> list[int]:
        if self.tokenizer is not None:
            ids = self.tokenizer.encode(COMPLETION_TEXT * 4, add_special_tokens=False)
            if len(ids) >= PROBE_TOKENS:
                return ids[:PROBE_TOKENS]
        return [100 + (i * 7) % 800 for i in range(PROBE_TOKENS)]

    def _prefix_hit(self, probe: list[int]) -> dict | None:
        salt = _fresh_salt()
        first = self._complete(probe, salt)
        if first is None:
            return None
        if _cached(first) is None:
            self._cached_reported = False
            self.checks.append(Check("cached_tokens", FAIL, "responses carry no usage."
                                     "prompt_tokens_details.cached_tokens: start vLLM with "
                                     "--enable-prompt-tokens-details (the gateway needs it to "
                                     "correct its views)"))
            return None
        self.checks.append(Check("cached_tokens", OK, "usage.prompt_tokens_details."
                                 "cached_tokens is reported"))
        if _cached(first):
            self.checks.append(Check("prefix_hit", WARN, f"a fresh salt hit {_cached(first)} "
                                     "tokens: the engine may not honour cache_salt"))
        second = self._complete(probe, salt)
        cached = _cached(second) if second is not None else None
        expected = cacheable_tokens(PROBE_TOKENS, self.block_size)
        data = {"prompt_tokens": PROBE_TOKENS, "cached_tokens": cached,
                "expected": expected, "block_size": self.block_size}
        if cached == expected:
            self.checks.append(Check("prefix_hit", OK, f"the repeat hit {cached} of "
                                     f"{PROBE_TOKENS} tokens, as block size {self.block_size} "
                                     "predicts", data))
        elif not cached:
            self.checks.append(Check("prefix_hit", FAIL, "the repeat hit nothing: prefix "
                                     "caching is off, or the cache is too small", data))
        else:
            sizes = [b for b in CANDIDATE_BLOCK_SIZES if cacheable_tokens(PROBE_TOKENS, b)
                     == cached]
            if sizes and self.block_size_source == "assumed":
                self.block_size = sizes[0]
                data.update(expected=cached, block_size=sizes[0])
                self.checks.append(Check("prefix_hit", OK, f"the repeat hit {cached} of "
                                         f"{PROBE_TOKENS} tokens: the engine's block size is "
                                         f"{sizes[0]} (measured)", data))
                return {"salt": salt, "response": first}
            hint = f"; the engine's block size looks like {sizes[0]}" if sizes else ""
            self.checks.append(Check("prefix_hit", FAIL, f"the repeat hit {cached} tokens, "
                                     f"block size {self.block_size} predicts {expected}{hint}",
                                     data))
            if sizes:  # probe the rest with the engine's real block size
                self.block_size = sizes[0]
        return {"salt": salt, "response": first}

    def _salt_isolation(self, probe: list[int]) -> None:
        other = self._complete(probe, _fresh_salt())
        cached = _cached(other) if other is not None else None
        if cached == 0:
            self.checks.append(Check("salt_isolation", OK, "the same prompt under another "
                                     "cache_salt did not hit"))
        elif cached is not None:
            self.checks.append(Check("salt_isolation", FAIL, f"another cache_salt hit {cached} "
                                     "tokens: the engine ignores cache_salt, so tenants can "
                                     "observe each other's prefixes"))

    def _kv_events(self) -> None:
        """Compare the ``BlockStored`` ids of a fresh probe with the gateway's keys.

        A subscriber that has just bound or connected misses what the engine publishes before
        the ZeroMQ connection and subscription are up (the engine reconnects on its own
        schedule), so the check first confirms the stream: canary requests, each under a
        fresh salt with random token ids, until the events of one arrive. Only then is the
        probe sent. Events are told apart by their token ids (random per run, so no other
        traffic carries them): the probe's blocks that arrive are compared with the keys the
        gateway computes, and when none of them arrive the check says it cannot tell rather
        than reporting a mismatch it never saw.
        """
        if self.events is None:
            self.checks.append(Check("kv_events", SKIP, "no --kv-events endpoint given"))
            return
        other_batches = 0
        for _ in range(CANARY_ATTEMPTS):
            canary = _random_tokens(CANARY_TOKENS)
            if self._complete(canary, _fresh_salt()) is None:
                return
            stored, others = self._collect_stored(canary, need=1)
            other_batches += others
            if stored:
                break
        else:
            data = {"canary_requests": CANARY_ATTEMPTS, "other_batches": other_batches}
            if other_batches:
                self.checks.append(Check("kv_events", WARN, f"cannot tell: {other_batches} "
                                         "event batches arrived but none for the doctor's "
                                         f"{CANARY_ATTEMPTS} canary requests", data))
            else:
                self.checks.append(Check("kv_events", FAIL, f"no KV event within "
                                         f"{CANARY_ATTEMPTS} canary requests of "
                                         f"{EVENT_WAIT_S:g} s each: check --kv-events-config "
                                         "and whether the engine binds or connects", data))
            return
        probe = _random_tokens(PROBE_TOKENS)
        salt = _fresh_salt()
        if self._complete(probe, salt) is None:
            return
        hasher = BlockHasher("vllm", self.hash_algo or "sha256", self.block_size,
                             none_hash_seed=self.none_hash_seed)
        ours = [hasher.event_block_hash(d) for d in
                hasher.block_hashes(probe, CacheIdentity(cache_salt=salt))]
        stored, _ = self._collect_stored(probe, need=len(ours))
        sizes = sorted({size for size, _, _ in stored})
        seen = {start // self.block_size: block_id for size, start, block_id in stored
                if size == self.block_size}
        matched = sum(1 for j, key in enumerate(ours) if seen.get(j) == key)
        data = {"expected_blocks": len(ours), "arrived_blocks": len(stored),
                "matched_blocks": matched, "event_block_sizes": sizes}
        if sizes and sizes != [self.block_size]:
            self.checks.append(Check("kv_events", FAIL, f"the engine publishes blocks of "
                                     f"{sizes} tokens, the gateway hashes {self.block_size}",
                                     data))
        elif not stored:
            self.checks.append(Check("kv_events", WARN, "cannot tell: the stream is up but "
                                     f"no event of the probe arrived within {EVENT_WAIT_S:g} s "
                                     "(the engine may not have stored it)", data))
        elif matched < len(seen):
            self.checks.append(Check("kv_events", FAIL, f"only {matched} of {len(seen)} probe "
                                     "blocks match the published ids: hash algorithm, "
                                     "PYTHONHASHSEED or block size differ", data))
        elif matched < len(ours):
            self.checks.append(Check("kv_events", WARN, f"the {matched} probe blocks that "
                                     f"arrived equal the gateway's keys; {len(ours) - matched} "
                                     f"did not arrive within {EVENT_WAIT_S:g} s", data))
        else:
            self.checks.append(Check("kv_events", OK, f"all {matched} BlockStored ids of the "
                                     "probe equal the gateway's keys", data))

    def _collect_stored(self, tokens: Sequence[int], need: int
                        ) -> tuple[list[tuple[int, int, int]], int]:
        """``BlockStored`` blocks of ``tokens`` as (block size, start offset, 64-bit id), read
        until ``need`` arrived or ``EVENT_WAIT_S`` passed; and how many batches carried none."""
        where = {tuple(tokens[i:i + _NGRAM]): i for i in range(len(tokens) - _NGRAM + 1)}
        stored: list[tuple[int, int, int]] = []
        others = 0
        deadline = time.monotonic() + EVENT_WAIT_S
        while time.monotonic() < deadline and len(stored) < need:
            item = self.events.get(timeout=0.2)
            if item is None:
                continue
            found = False
            for event in item.batch.events:
                hashes = getattr(event, "block_hashes", None)
                if hashes is None or not hasattr(event, "token_ids"):
                    continue
                size = event.block_size
                for n, block_hash in enumerate(hashes):
                    start = where.get(tuple(event.token_ids[n * size:n * size + _NGRAM]))
                    if start is not None:
                        found = True
                        stored.append((size, start, _low64(block_hash)))
            others += not found
        return stored, others

    def _tokenize_completion(self) -> None:
        local = self.tokenizer.encode(COMPLETION_TEXT, add_special_tokens=True)
        rendered = self._render("/v1/completions/render",
                                {"model": self.model, "prompt": COMPLETION_TEXT})
        self._compare("tokenize_completion", local, rendered,
                      {"model": self.model, "prompt": COMPLETION_TEXT}, "/v1/completions")

    def _tokenize_chat(self) -> None:
        try:
            text = self.tokenizer.apply_chat_template(CHAT_MESSAGES)
        except Exception as exc:  # our template cannot render it: that is the finding
            self.checks.append(Check("tokenize_chat", FAIL, f"the local chat template "
                                     f"failed: {exc}"))
            return
        local = self.tokenizer.encode(text, add_special_tokens=False)
        rendered = self._render("/v1/chat/completions/render",
                                {"model": self.model, "messages": CHAT_MESSAGES})
        self._compare("tokenize_chat", local, rendered,
                      {"model": self.model, "messages": CHAT_MESSAGES},
                      "/v1/chat/completions")

    def _render_tokens(self, name: str, path: str, body: dict) -> None:
        """Without a local tokenizer: the render endpoint's ids must be the engine's."""
        ids = self._render(path + "/render", body)
        if ids is None:
            self.checks.append(Check(name, WARN, f"POST {path}/render gave no token ids: "
                                     "tokenization: backend needs it (vLLM 0.32: start with "
                                     "--enable-scale-out); without it and without a "
                                     "tokenizer the gateway routes on character blocks, "
                                     "which cannot match engine events"))
            return
        if not self._cached_reported:
            self.checks.append(Check(name, OK, f"render endpoint answers ({len(ids)} tokens); "
                                     "not verified through the cache (no cached_tokens)",
                                     {"engine_tokens": len(ids)}))
            return
        self._compare(name, ids, None, body, path)

    def _compare(self, name: str, local: list[int], rendered: list[int] | None,
                 body: dict, path: str) -> None:
        data: dict[str, Any] = {"local_tokens": len(local)}
        if rendered is not None:
            data["engine_tokens"] = len(rendered)
            if rendered != local:
                at = _first_difference(local, rendered)
                self.checks.append(Check(name, FAIL, f"the engine's tokens differ from the "
                                         f"gateway's at token {at}: local "
                                         f"{self._context(local, at)!r} vs engine "
                                         f"{self._context(rendered, at)!r} (tokenizer or chat "
                                         "template mismatch)", data))
                return
        if not self._cached_reported:
            if rendered is not None:
                self.checks.append(Check(name, OK, f"render endpoint: {len(local)} tokens, "
                                         "identical", data))
            return
        # Through the cache: seed with our token ids, then send the text itself.
        salt = _fresh_salt()
        self._complete(local, salt)
        response = self._post(path, {**body, "max_tokens": 1, "temperature": 0.0,
                                     "cache_salt": salt})
        if response is None:
            return
        cached = _cached(response)
        engine_tokens = (response.get("usage") or {}).get("prompt_tokens")
        expected = cacheable_tokens(len(local), self.block_size)
        data.update({"engine_prompt_tokens": engine_tokens, "cached_tokens": cached,
                     "expected": expected})
        via = "render endpoint and cache" if rendered is not None else "cache"
        if cached == expected and engine_tokens == len(local):
            self.checks.append(Check(name, OK, f"{via}: {len(local)} tokens, identical", data))
        else:
            at = cached if cached is not None else 0
            self.checks.append(Check(name, FAIL, f"{via}: the engine read {engine_tokens} "
                                     f"tokens and reused {cached} of the gateway's {len(local)}"
                                     f" (expected {expected}); tokens differ from about token "
                                     f"{at}: local {self._context(local, at)!r} (tokenizer or "
                                     "chat template mismatch)", data))

    # -- HTTP -----------------------------------------------------------------------------

    def _complete(self, prompt: Sequence[int], salt: str) -> dict | None:
        return self._post("/v1/completions", {"model": self.model, "prompt": list(prompt),
                                              "max_tokens": 1, "temperature": 0.0,
                                              "cache_salt": salt})

    def _post(self, path: str, body: dict) -> dict | None:
        try:
            response = self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            self.checks.append(Check(f"POST {path}", FAIL, f"{type(exc).__name__}: {exc}"))
            return None
        if response.status_code != 200:
            self.checks.append(Check(f"POST {path}", FAIL, f"answered "
                                     f"{response.status_code}: {response.text[:300]}"))
            return None
        try:
            return response.json()
        except ValueError:
            self.checks.append(Check(f"POST {path}", FAIL, "answer is not JSON"))
            return None

    def _render(self, path: str, body: dict) -> list[int] | None:
        try:
            response = self.client.post(path, json=body)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            data = response.json()
        except ValueError:
            return None
        if isinstance(data, list) and data:
            data = data[0]
        ids = data.get("token_ids") if isinstance(data, dict) else None
        return list(ids) if isinstance(ids, list) else None

    def _context(self, ids: Sequence[int], at: int) -> str:
        window = list(ids[max(0, at - 3):at + 4])
        try:
            return self.tokenizer.decode(window)
        except Exception:
            return str(window)


def _fresh_salt() -> str:
    return "prefixroute-doctor-" + secrets.token_hex(16)


def _random_tokens(count: int) -> list[int]:
    """Token ids no other request carries: 8 random ids in 100..899 repeat by chance with
    probability 800**-8. The range is the fixed probe's (valid for any real vocabulary)."""
    return [100 + secrets.randbelow(800) for _ in range(count)]


def _low64(block_hash: Any) -> int:
    """A KV event's block id as the 64-bit key (ints as sent, bytes big-endian)."""
    if isinstance(block_hash, int):
        return block_hash & ((1 << 64) - 1)
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def _cached(response: dict | None) -> int | None:
    if not isinstance(response, dict):
        return None
    details = (response.get("usage") or {}).get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# -- a running gateway's view of its replicas ---------------------------------------------

@dataclass(frozen=True, slots=True)
class ReplicaViewState:
    """What a running gateway knows of one replica's cache, read from its ``/metrics``.

    ``state``: ``exact`` (every KV event batch arrived, live or replayed from the engine's
    replay socket), ``degraded`` (a batch was lost beyond the replay buffer: the view may be
    stale until the engine restarts or clears its cache), or ``approximate`` (no KV events:
    the view is the gateway's own record of what it sent). ``missing``: batches lost and not
    replayed; ``restarts``: times the replica's event sequence started over (the view was
    reset and rebuilt from the new stream).
    """

    replica: str
    state: str
    healthy: bool
    blocks: int
    missing: int
    restarts: int


def gateway_view_states(metrics_text: str) -> list[ReplicaViewState]:
    """Each replica's view state from a gateway's Prometheus text, by replica name."""
    values: dict[str, dict[str, float]] = {}

    def put(replica: str, key: str, value: float) -> None:
        values.setdefault(replica, {})[key] = values.get(replica, {}).get(key, 0.0) + value

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            replica = sample.labels.get("replica")
            if replica is None:
                continue
            name = sample.name
            if name == "prefixroute_gateway_replica_healthy":
                put(replica, "healthy", sample.value)
            elif name == "prefixroute_gateway_replica_view_exact":
                put(replica, "exact", sample.value)
            elif name == "prefixroute_gateway_replica_view_blocks":
                put(replica, "blocks", sample.value)
            elif name == "prefixroute_gateway_kv_event_missing_total":
                put(replica, "missing", sample.value)
            elif (name == "prefixroute_gateway_kv_events_total"
                  and sample.labels.get("kind") == "restart"):
                put(replica, "restarts", sample.value)
    states = []
    for replica, v in sorted(values.items()):
        if "healthy" not in v:  # a series of a replica no longer configured
            continue
        state = "approximate" if "exact" not in v else "exact" if v["exact"] else "degraded"
        states.append(ReplicaViewState(replica, state, bool(v["healthy"]),
                                       int(v.get("blocks", 0)), int(v.get("missing", 0)),
                                       int(v.get("restarts", 0))))
    return states


def gateway_view_checks(states: Sequence[ReplicaViewState]) -> list[Check]:
    """One check per replica: ok when exact or approximate, warn when degraded."""
    checks = []
    for s in states:
        detail = (f"view {s.state}, {s.blocks} blocks, {s.missing} event batches lost, "
                  f"{s.restarts} restarts seen" + ("" if s.healthy else "; replica unhealthy"))
        if s.state == "degraded":
            detail += ("; routing may follow blocks the engine no longer holds until it "
                       "restarts or clears its cache")
        status = WARN if s.state == "degraded" or not s.healthy else OK
        checks.append(Check(f"view {s.replica}", status, detail,
                            {"replica": s.replica, "state": s.state, "healthy": s.healthy,
                             "blocks": s.blocks, "missing": s.missing,
                             "restarts": s.restarts}))
    return checks
