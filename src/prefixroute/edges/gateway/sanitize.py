"""What a caller's request body may and may not carry, and what the gateway adds to it.

The gateway is the only party that sets cache identity: it injects the trust group's secret
``cache_salt``, refuses (or strips, by config) a salt the caller sent, refuses caller-supplied
multimodal ``uuid`` overrides (in vLLM they replace media-byte hashing, so a colliding id could
reuse KV derived from someone else's media), and gives inline media (``data:`` URLs, base64
audio, embeddings) a trust-group-scoped identity of its own. Which content parts are media is
:data:`~prefixroute.core.identity.media_parts.MEDIA_PART_TYPES`. Media fetched by URL keeps the
engine's own content hashing: the gateway does not fetch it, and naming it by URL would go stale
when the bytes behind the URL change.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

import orjson

from prefixroute.core.identity.media_parts import MediaPartType, media_part_type
from prefixroute.edges.gateway.errors import GatewayError
from prefixroute.edges.gateway.tenants import Tenant, TenantRegistry

COMPLETIONS = "completions"
CHAT = "chat"

# Top-level fields through which a caller could set media identity directly.
_IDENTITY_FIELDS = ("multi_modal_uuids", "mm_uuids", "multi_modal_hashes")


@dataclass(slots=True)
class CheckedRequest:
    """A body that passed the checks, with the gateway's fields added."""

    endpoint: str
    body: dict
    model: str
    stream: bool
    caller_wants_usage: bool  # streaming: the caller asked for the usage chunk itself


# How deep a request body may nest objects and lists. Real bodies stay far below it (a chat
# request with content parts is 5 levels; a tool's JSON schema adds 2 per nested property).
# Below orjson's encoding limit of 254 levels, so every accepted body re-encodes on the fast
# path, and far below Python's recursion limit (about 1000), where the standard library's
# parser and encoder (the fallbacks) fail.
MAX_JSON_DEPTH = 128


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 that names what is wrong with it.

    Every body this accepts re-encodes (:func:`encode_json`) when it is sent on: nesting
    deeper than :data:`MAX_JSON_DEPTH`, an integer with more digits than Python converts, and
    a string with a lone UTF-16 surrogate (which UTF-8 cannot carry) are refused here."""
    if not raw:
        raise GatewayError(400, "the request body is empty; expected a JSON object",
                           code="invalid_body")
    try:
        body = orjson.loads(raw)  # several times faster than json on request bodies
    except orjson.JSONDecodeError:
        body = _parse_leniently(raw)
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object", code="invalid_body")
    # Nesting needs an opening bracket per level: a body with few of them is shallow, and
    # counting them costs far less than walking the parsed body.
    if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH and _nests_deeper(body,
                                                                         MAX_JSON_DEPTH):
        raise _too_deep()
    return body


def _parse_leniently(raw: bytes) -> Any:
    """What orjson refuses, the standard library may take (integers beyond 64 bits, a lone
    surrogate), and where it does not, its message names the line and column. What it takes
    must also encode again, so that is checked here, before the request is accepted.

    A number that is not finite (``NaN``, ``Infinity``, or a literal such as ``1e400`` beyond
    the range of a double) is refused: it would be sent on as ``null``, which changes the
    request (``"max_tokens": 1e400`` became no limit at all)."""
    try:
        body = json.loads(raw, parse_constant=_not_finite, parse_float=_finite_float)
    except _NotFinite as exc:
        raise GatewayError(400, f"the request body holds a number that is not finite "
                           f"({exc.args[0]}); JSON numbers must be finite",
                           code="number_not_finite") from None
    except RecursionError:
        raise _too_deep() from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GatewayError(400, f"the request body is not valid JSON: {exc}",
                           code="invalid_json") from None
    except ValueError:  # Python's limit on the digits of an integer it converts
        raise _too_many_digits() from None
    if _nests_deeper(body, MAX_JSON_DEPTH):
        raise _too_deep()
    try:
        encode_json(body)
    except UnicodeEncodeError:
        raise GatewayError(400, "the request body holds a string with a lone UTF-16 "
                           "surrogate escape (such as \\ud800 without its pair), which is not "
                           "valid Unicode", code="invalid_unicode") from None
    except ValueError:
        raise _too_many_digits() from None
    return body


class _NotFinite(ValueError):
    """A NaN or infinite number in a request body (the literal in ``args[0]``)."""


def _not_finite(literal: str) -> float:
    raise _NotFinite(literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NotFinite(literal if len(literal) <= 24 else literal[:21] + "...")
    return value


def _nests_deeper(value: Any, limit: int) -> bool:
    """Does ``value`` nest objects and lists more than ``limit`` levels deep? (Iterative:
    the depth is what is in question.)"""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def _too_deep() -> GatewayError:
    return GatewayError(400, f"the request body nests objects and lists more than "
                        f"{MAX_JSON_DEPTH} levels deep", code="json_too_deep")


def _too_many_digits() -> GatewayError:
    return GatewayError(400, "the request body holds a number too large to read (an "
                        f"integer of more than {sys.get_int_max_str_digits()} digits)",
                        code="number_too_large")


def encode_json(obj: Any, default: Any = None) -> bytes:
    """JSON of a body parsed from JSON: orjson (several times faster on these documents),
    or the standard library for what orjson refuses (an integer beyond 64 bits). A NaN or
    infinity (which strict JSON has not) goes as null. ``default`` as for ``json.dumps``."""
    try:
        return orjson.dumps(obj, default=default)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(obj, ensure_ascii=False, default=default).encode()


def check_request(endpoint: str, body: dict, tenant: Tenant, registry: TenantRegistry,
                  caller_cache_salt: str = "reject") -> CheckedRequest:
    """Validate the body for ``endpoint`` (``completions`` or ``chat``) and add the trust
    group's salt and media identities. Raises :class:`GatewayError` (400) on bad input."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "'model' is required and must be a non-empty string",
                           param="model", code="invalid_value")
    if endpoint == COMPLETIONS:
        _check_prompt(body.get("prompt"))
    else:
        _check_messages(body.get("messages"))
        for part in _content_parts(body["messages"]):
            _check_media_part(part, tenant, registry)
    for name in _IDENTITY_FIELDS:
        if name in body:
            raise GatewayError(400, f"'{name}' is not accepted: media identities are assigned "
                               "by the gateway", param=name, code="caller_media_uuid")
    if "cache_salt" in body:
        if caller_cache_salt == "reject":
            raise GatewayError(400, "'cache_salt' is set by the gateway for your trust group "
                               "and may not be supplied", param="cache_salt",
                               code="caller_cache_salt")
        del body["cache_salt"]
    body["cache_salt"] = tenant.cache_salt

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise GatewayError(400, "'stream' must be true or false", param="stream",
                           code="invalid_type")
    caller_wants_usage = False
    if stream:
        options = body.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise GatewayError(400, "'stream_options' must be an object",
                               param="stream_options", code="invalid_type")
        caller_wants_usage = bool(options.get("include_usage"))
        # The gateway needs the engine's cached_tokens to correct its cache views; it asks
        # for the usage chunk and drops it again if the caller did not ask for it.
        body["stream_options"] = {**options, "include_usage": True}
    return CheckedRequest(endpoint, body, model, stream, caller_wants_usage)


def _check_prompt(prompt: Any) -> None:
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
            or all(isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt)))
    if not ok:
        raise GatewayError(400, "'prompt' is required: a string, a list of strings, a list of "
                           "token ids or a list of token-id lists", param="prompt",
                           code="invalid_value")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "'messages' is required and must be a non-empty list",
                           param="messages", code="invalid_value")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise GatewayError(400, f"messages[{i}] must be an object with a string 'role'",
                               param=f"messages[{i}]", code="invalid_value")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise GatewayError(400, f"messages[{i}].content must be a string or a list of "
                               "content parts", param=f"messages[{i}].content",
                               code="invalid_value")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise GatewayError(400, f"messages[{i}].content parts must be objects",
                               param=f"messages[{i}].content", code="invalid_value")


def _content_parts(messages: list) -> list[dict]:
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts.extend(content)
    return parts


def _check_media_part(part: dict, tenant: Tenant, registry: TenantRegistry) -> None:
    if _has_uuid(part):
        raise GatewayError(400, "caller-supplied multimodal 'uuid' is not accepted: media "
                           "identities are assigned by the gateway", param="uuid",
                           code="caller_media_uuid")
    media = media_part_type(part)
    if media is None:
        return
    digest = _inline_media_digest(part, media)
    if digest is not None:
        part["uuid"] = registry.media_uuid(tenant, digest)


def _has_uuid(value: Any, depth: int = 0) -> bool:
    if depth > 3 or not isinstance(value, dict):
        return False
    if "uuid" in value:
        return True
    return any(_has_uuid(v, depth + 1) for v in value.values())


def _inline_media_digest(part: dict, media: MediaPartType) -> str | None:
    """SHA-256 of media that travels inside the request (a ``data:`` URL, base64 audio,
    embeddings); ``None`` for media the engine fetches itself (a URL) or a part without
    payload."""
    payload = part.get(media.payload)
    if payload is None:
        return None
    if media.by_url:
        url = payload.get("url") if isinstance(payload, dict) else payload
        if isinstance(url, str) and url.startswith("data:"):
            return hashlib.sha256(url.encode()).hexdigest()
        return None
    if isinstance(payload, dict) and isinstance(payload.get("data"), str):
        # input_audio: {"data": base64, "format": "wav"}
        text = f"{payload.get('format', '')}\x00{payload['data']}"
        return hashlib.sha256(text.encode()).hexdigest()
    material = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          default=str)
    return hashlib.sha256(f"{media.modality}\x00{material}".encode()).hexdigest()
