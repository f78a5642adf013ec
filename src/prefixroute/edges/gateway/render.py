"""Token ids and media identities from a replica's render endpoint (``tokenization: backend``).

vLLM 0.32 serves ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render`` when
started with ``--enable-scale-out`` (403 ``PermissionDeniedError`` otherwise;
``vllm/entrypoints/scale_out/``). They run the same renderer as generation (chat template,
tokenizer, multimodal processor) and answer with vLLM's ``GenerateRequest`` without
generating: ``request_id``, ``token_ids``, ``token_offsets``, ``features``, ``content_parts``,
``sampling_params``, ``model``, ``reasoning_ended``, ``reasoning_parser_kwargs``,
``return_token_ids``, ``output_mode``, ``stream``, ``stream_options``, ``cache_salt``,
``priority``, ``kv_transfer_params``, ``ec_transfer_params`` (completions: a list of them, one
per prompt). ``features`` is ``null`` for text and for multimodal prompts is
``MultiModalFeatures``: ``mm_hashes`` (``{modality: [hash, ...]}``), ``mm_placeholders``
(``{modality: [{"offset", "length"}, ...]}``, positions in ``token_ids``), and the processed
tensors in ``kwargs_data`` / ``mm_metadata``, which the gateway turns off with
``mm_payload: "none"`` (vLLM's option "for callers that need only the token layout and item
hashes, such as cache-aware routers").

The engine keys a block by ``("mm", identifier, offset - block_start)`` for every item
overlapping it, items sorted by offset, with ``identifier`` the item's ``mm_hash``
(``vllm/v1/engine/input_processor.py``); so ``token_ids`` plus the flattened, sorted items
give the engine's own block hashes once the gateway adds the trust group's salt (the render
call carries none: tokens do not depend on it). One exception the render answer cannot show:
an engine with ``enable_tower_connector_lora`` prefixes the identifier with the LoRA name.

Which replica renders: any available one serving the model, in turn. Every replica of a model
runs the same tokenizer, template and processor (routing across them already assumes it), so
any answer is the answer; taking turns spreads the render work (a chat template, and for media
a fetch and the processor) over the replicas' API servers. Asking the replica that will serve
the request is circular: the keys rendered here are what picks it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

from prefixroute.core.identity.identity import MediaItem
from prefixroute.edges.eager import in_task
from prefixroute.edges.gateway.metrics import LATENCY_BUCKETS
from prefixroute.edges.gateway.sanitize import encode_json
from prefixroute.edges.http1 import RequestTimeout, TransportError

log = logging.getLogger("prefixroute.gateway")

RENDER_PATHS = {"completions": "/v1/completions/render", "chat": "/v1/chat/completions/render"}
_DETAIL_CHARS = 300


@dataclass(frozen=True, slots=True)
class Rendered:
    """What the engine will run: token ids and its media items, sorted by offset."""

    token_ids: list[int]
    media: tuple[MediaItem, ...] = ()


class RenderError(Exception):
    """A render that gave no usable answer. ``reason`` is a short label (metrics):
    ``no_replica``, ``timeout``, ``connect``, ``http_<status>``, ``bad_response``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RenderClient:
    """Calls render endpoints through the gateway's upstream client (``client``, set when the
    gateway starts) with one overall timeout per call."""

    def __init__(self, timeout_s: float, registry: CollectorRegistry | None = None,
                 client: Any = None):
        self.timeout_s = timeout_s
        self.client = client
        self._turn = 0
        self._warned: set[tuple[str, str]] = set()
        p = "prefixroute_gateway_"
        self.calls = Counter(p + "render_calls_total", "Render calls (tokenization: backend) "
                             "by outcome: ok, or why the request fell back", ["outcome"],
                             registry=registry)
        self.latency = Histogram(p + "render_seconds", "Time of successful render calls",
                                 buckets=LATENCY_BUCKETS, registry=registry)

    def pick(self, backends: Sequence[Any]) -> Any | None:
        available = [b for b in backends if b.available()]
        if not available:
            return None
        self._turn += 1
        return available[self._turn % len(available)]

    async def render(self, endpoint: str, body: dict, backends: Sequence[Any]) -> Rendered:
        try:
            rendered = await self._render(endpoint, body, backends)
        except RenderError as exc:
            self.calls.labels(exc.reason).inc()
            raise
        self.calls.labels("ok").inc()
        return rendered

    async def _render(self, endpoint: str, body: dict, backends: Sequence[Any]) -> Rendered:
        backend = self.pick(backends)
        if backend is None:
            raise RenderError("no_replica", "no available replica serves the model")
        if self.client is None:
            raise RenderError("no_replica", "the gateway has not started")
        headers = {"content-type": "application/json", **backend.headers}
        payload = encode_json(body)
        await in_task()  # asyncio.timeout needs one
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.client.request("POST", backend.url + RENDER_PATHS[endpoint],
                                                     body=payload, headers=headers)
                try:
                    status = response.status
                    content = await response.aread()
                finally:
                    await response.aclose()
        except TimeoutError:
            raise self._fail(backend, "timeout", f"no answer within {self.timeout_s:g} s") \
                from None
        except RequestTimeout as exc:
            raise self._fail(backend, "timeout", str(exc) or "timed out") from None
        except TransportError as exc:
            raise self._fail(backend, "connect", f"{type(exc).__name__}: {exc}") from None
        if status != 200:
            text = content[:_DETAIL_CHARS].decode("utf-8", "replace")
            hint = (" (vLLM serves render only with --enable-scale-out)"
                    if status in (403, 404) else "")
            raise self._fail(backend, f"http_{status}", f"{text}{hint}")
        try:
            rendered = parse_render(content, endpoint)
        except ValueError as exc:
            raise self._fail(backend, "bad_response", str(exc)) from None
        self.latency.observe(time.perf_counter() - started)
        return rendered

    def _fail(self, backend: Any, reason: str, detail: str) -> RenderError:
        detail = f"{backend.name}: {detail}"
        if (backend.name, reason) not in self._warned:  # once per replica and reason
            self._warned.add((backend.name, reason))
            log.warning("render failed; routing on the fallback", extra={"fields": {
                "event": "render_failed", "replica": backend.name, "reason": reason,
                "detail": detail}})
        return RenderError(reason, detail)


def parse_render(content: bytes, endpoint: str) -> Rendered:
    """Token ids and sorted media items of a render answer; ValueError if malformed."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if endpoint == "completions":
        if not isinstance(data, list) or not data:
            raise ValueError("expected a non-empty list of rendered prompts")
        data = data[0]
    if not isinstance(data, dict):
        raise ValueError("expected an object with token_ids")
    token_ids = data.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids or set(map(type, token_ids)) != {int}:
        raise ValueError("token_ids is not a non-empty list of integers")
    return Rendered(token_ids, media_items(data.get("features")))


def media_items(features: Any) -> tuple[MediaItem, ...]:
    """vLLM's ``MultiModalFeatures`` as items sorted by offset (the engine's order)."""
    if features is None:
        return ()
    if not isinstance(features, dict):
        raise ValueError("features is not an object")
    hashes, places = features.get("mm_hashes"), features.get("mm_placeholders")
    if not isinstance(hashes, dict) or not isinstance(places, dict) or set(hashes) != set(places):
        raise ValueError("features.mm_hashes and mm_placeholders must be objects keyed by the "
                         "same modalities")
    items = []
    for modality, ids in hashes.items():
        ranges = places[modality]
        if not isinstance(ids, list) or not isinstance(ranges, list) or len(ids) != len(ranges):
            raise ValueError(f"features for {modality!r}: hashes and placeholders differ")
        for identifier, place in zip(ids, ranges):
            offset = place.get("offset") if isinstance(place, dict) else None
            length = place.get("length") if isinstance(place, dict) else None
            if not isinstance(identifier, str) or type(offset) is not int \
                    or type(length) is not int or offset < 0 or length < 1:
                raise ValueError(f"features for {modality!r}: bad item {identifier!r} {place!r}")
            items.append(MediaItem(identifier, offset, length))
    items.sort(key=lambda item: item.offset)
    return tuple(items)


__all__ = ["RENDER_PATHS", "RenderClient", "RenderError", "Rendered", "media_items",
           "parse_render"]
