"""The OpenAI API as vLLM 0.32 serves it: request checks, and response and stream shapes.

Shapes were recorded from a real ``vllm serve`` (0.32.0, CPU) on this machine and follow
``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``: every field vLLM writes
is written (``null`` included) in vLLM's order, so a client that parses vLLM's answers parses
ours. Error messages are vLLM's where the emulator rejects what vLLM rejects, with its status
codes and the ``{"error": {"message", "type", "param", "code"}}`` envelope (``code`` is the
HTTP status, as vLLM writes it).

What the emulator does not model is refused with a clear 400 (``n`` > 1, ``use_beam_search``,
``prompt_embeds``) or accepted and ignored where vLLM would only change the sampled text
(``temperature``, ``top_p``, ``stop``, ``seed``, penalties; ``logprobs`` come back ``null``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import orjson

from prefixroute.core.identity.identity import Adapter
from prefixroute.core.identity.media_parts import MEDIA_PART_TYPES, TEXT_PART_TYPES
from prefixroute.edges.emulator.tokens import EncodedPrompt, PromptEncoder

# orjson (a pinned dependency): for these small documents 4 to 10 times faster than the
# standard json module, about 15% of the emulator's CPU per request (benchmarks/emulator_rps.py).
# Compact output, UTF-8 unescaped, as vLLM's FastAPI answers.
dumps = orjson.dumps
loads = orjson.loads
JSONDecodeError = orjson.JSONDecodeError

SYSTEM_FINGERPRINT = "prefixroute-emulator"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM CompletionRequest.max_tokens default
# A chat request without max_tokens: vLLM generates until EOS or the context ends; the dummy
# model "stops" (finish_reason "stop") after this many tokens so load tests stay bounded.
DUMMY_CHAT_REPLY_TOKENS = 16
# vLLM validate_cache_salt: non-empty, at most 128 characters, none of these.
MAX_CACHE_SALT_LENGTH = 128
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


class APIError(Exception):
    """An OpenAI-style error: HTTP status, vLLM's error type, message and parameter."""

    def __init__(self, message: str, *, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


def bad_request(message: str, param: str | None = None, value: Any = None,
                with_value: bool = False) -> APIError:
    """vLLM's VLLMValidationError wording: ``message (parameter=p, value=v)``."""
    if param is not None:
        suffix = f"parameter={param}"
        if with_value:
            suffix += f", value={value}"
        message = f"{message} ({suffix})"
    return APIError(message, param=param)


@dataclass(slots=True)
class ServedModels:
    """The base model name and the LoRA adapters (``--lora-modules name=path``), with the
    integer ids vLLM assigns them (1, 2, ... in the order given)."""

    name: str
    root: str
    max_model_len: int
    adapters: dict[str, tuple[Adapter, int]] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))

    def resolve(self, model: Any) -> tuple[str, Adapter | None, int | None]:
        """The name to answer with, the adapter and its id (None for the base model)."""
        if model is None or model == "" or model == self.name:
            return self.name, None, None
        if not isinstance(model, str):
            raise bad_request("model must be a string", "model")
        found = self.adapters.get(model)
        if found is None:
            names = ", ".join([self.name, *self.adapters])
            raise APIError(f"The model `{model}` does not exist. Valid aliases: {names}.",
                           status=404, err_type="NotFoundError", param="model")
        return model, found[0], found[1]

    def listing(self) -> dict:
        def card(model_id: str, root: str, parent: str | None) -> dict:
            return {"id": model_id, "object": "model", "created": self.created,
                    "owned_by": "vllm", "root": root, "parent": parent,
                    "max_model_len": self.max_model_len,
                    "permission": [{"id": f"modelperm-{model_id}", "object": "model_permission",
                                    "created": self.created, "allow_create_engine": False,
                                    "allow_sampling": True, "allow_logprobs": True,
                                    "allow_search_indices": False, "allow_view": True,
                                    "allow_fine_tuning": False, "organization": "*",
                                    "group": None, "is_blocking": False}]}
        data = [card(self.name, self.root, None)]
        for name, (adapter, _) in self.adapters.items():
            data.append(card(name, adapter.path, self.name))
        return {"object": "list", "data": data}


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` (or vLLM's JSON form ``{"name": ..., "path": ...}``)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = loads(text.encode())
        except JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: expected name=path or "
                             '{"name": ..., "path": ...}')
        return obj["name"], obj["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return name, path


# -- requests ---------------------------------------------------------------------------------
@dataclass(slots=True)
class GenerationRequest:
    """A checked completions or chat request: one prompt per choice and what to generate."""

    kind: str  # "completion" or "chat"
    model: str
    adapter: Adapter | None
    lora_id: int | None
    prompts: list[EncodedPrompt]
    max_tokens: list[int]       # per prompt, after vLLM's clamp to the context left
    finish_reason: str          # "length", or "stop" for a chat reply of the dummy length
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    cache_salt: str | None = None
    allowed_token_ids: list[int] | None = None
    echo: bool = False
    return_token_ids: bool = False
    session_id: str | None = None
    report_full: bool = False   # vllm_xargs kv_cache_report_mode == "full"
    explicit_max_tokens: bool = False  # the body set max_tokens (or max_completion_tokens)
    priority: int = 0  # lower first under priority scheduling; ignored under fcfs (vLLM)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_INT_TEXT = re.compile(r"[+-]?[0-9]+(_[0-9]+)*(\.0+)?")


def _lax_int64(value: Any) -> int | None:
    """An ``int`` field as vLLM's pydantic models read it from JSON (lax mode): integers,
    booleans, floats with no fraction and such numbers written as strings; ``None`` for
    anything else (``null`` too) or outside int64."""
    if isinstance(value, bool):
        value = int(value)
    elif isinstance(value, float):
        value = int(value) if value.is_integer() else None
    elif isinstance(value, str):
        text = value.strip()
        value = (int(text.split(".")[0].replace("_", "")) if _INT_TEXT.fullmatch(text)
                 else None)
    if not _is_int(value) or not -(1 << 63) <= value < (1 << 63):
        return None
    return value


def _optional_bool(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean", key)
    return value


def _check_sampling(body: dict) -> None:
    """The sampling checks vLLM makes (SamplingParams._verify_args) whose values the emulator
    otherwise ignores."""
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise bad_request("temperature must be a number", "temperature")
        if temperature < 0:
            raise bad_request(f"temperature must be non-negative, got {float(temperature)}.",
                              "temperature", float(temperature), True)
    top_p = body.get("top_p")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) \
                or not 0 < top_p <= 1:
            raise bad_request(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p, True)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise APIError(f"n must be at least 1, got {n}.")
    if n > 1:
        raise bad_request("n > 1 is not supported by the prefixroute emulator "
                          "(one sequence per prompt)", "n")
    if body.get("use_beam_search"):
        raise bad_request("beam search is not supported by the prefixroute emulator",
                          "use_beam_search")
    if body.get("prompt_embeds") is not None:
        raise bad_request("prompt_embeds are not supported by the prefixroute emulator",
                          "prompt_embeds")
    for key in ("logprobs", "prompt_logprobs"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad_request(f"`{key}` must be an integer.", key, value, True)


def check_cache_salt(salt: Any) -> str | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.",
                          "cache_salt")
    if len(salt) > MAX_CACHE_SALT_LENGTH or any(c in salt for c in CACHE_SALT_FORBIDDEN):
        raise bad_request("Parameter 'cache_salt' must be at most 128 characters and must "
                          "not contain '@', '/', '\\\\', or NUL.", "cache_salt")
    return salt


def _all_ints(values: list) -> bool:
    # type() rather than isinstance(): booleans are ints to isinstance. map/set run in C.
    return bool(values) and set(map(type, values)) == {int}


def _token_list(value: Any, vocab_size: int | None, param: str) -> list[int]:
    if not _all_ints(value) or min(value) < 0:
        raise bad_request(f"{param} must hold non-negative integer token ids", param)
    if vocab_size is not None:
        if max(value) >= vocab_size:
            first = next(t for t in value if t >= vocab_size)  # vLLM names the first one
            raise APIError(f"Token id {first} is out of vocabulary")
    return value


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """vLLM get_max_tokens: the request's (or default) max_tokens, capped by the context left;
    a prompt longer than the context is an error."""
    if prompt_len > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. "
                          f"However, your prompt contains {prompt_len} input tokens, which "
                          f"exceeds this limit even without any output tokens. Please reduce "
                          f"the length of the input prompt.", "input_tokens", prompt_len, True)
    value = max_model_len - prompt_len
    if requested is not None:
        value = min(value, requested)
    if value < 1:
        raise bad_request(f"max_tokens must be at least 1, got {value}.", "max_tokens", value,
                          True)
    return value


def _requested_max_tokens(body: dict, keys: Sequence[str], max_model_len: int) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if not _is_int(value):
            raise bad_request(f"{key} must be an integer", key)
        if value < 1:
            raise bad_request(f"max_tokens must be at least 1, got {value}.", "max_tokens",
                              value, True)
        if value > max_model_len:
            raise bad_request(f"max_tokens={value} cannot be greater than "
                              f"max_model_len={max_model_len}. Please request fewer output "
                              f"tokens.", "max_tokens", value, True)
        return value
    return None


def _common(body: dict, models: ServedModels, kind: str):
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", err_type="Bad Request",
                       param="body")
    model, adapter, lora_id = models.resolve(body.get("model"))
    _check_sampling(body)
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    if options and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    include_usage = continuous = False
    if options:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        include_usage = bool(options.get("include_usage"))
        continuous = bool(options.get("continuous_usage_stats"))
    salt = check_cache_salt(body.get("cache_salt"))
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed:
            raise bad_request("allowed_token_ids must be a non-empty list of token ids",
                              "allowed_token_ids")
    session_id = body.get("session_id")
    xargs = body.get("vllm_xargs")
    report_full = False
    if xargs is not None:
        if not isinstance(xargs, dict):
            raise bad_request("vllm_xargs must be an object", "vllm_xargs")
        report_full = xargs.get("kv_cache_report_mode") == "full"
        if session_id is None and isinstance(xargs.get("session_id"), str):
            session_id = xargs["session_id"]
    if session_id is not None and not isinstance(session_id, str):
        raise bad_request("session_id must be a string", "session_id")
    priority = _lax_int64(body.get("priority", 0))
    if priority is None:
        raise bad_request("priority must be an integer within int64", "priority")
    return GenerationRequest(
        kind=kind, model=model, adapter=adapter, lora_id=lora_id, prompts=[], max_tokens=[],
        finish_reason="length", stream=stream, include_usage=include_usage,
        continuous_usage=continuous, cache_salt=salt, allowed_token_ids=allowed,
        return_token_ids=_optional_bool(body, "return_token_ids"), session_id=session_id,
        report_full=report_full, priority=priority)


def parse_completion(body: Any, models: ServedModels, encoder: PromptEncoder,
                     vocab_size: int | None) -> GenerationRequest:
    """Check a ``/v1/completions`` body and tokenize its prompt(s)."""
    request = _common(body, models, "completion")
    prompt = body.get("prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.",
                          "prompt")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad_request("add_special_tokens must be a boolean", "add_special_tokens")
    if isinstance(prompt, str):
        prompts = [encoder.encode_text(prompt, add_special, cache_salt=request.cache_salt)]
    elif isinstance(prompt, list) and _all_ints(prompt):
        prompts = [EncodedPrompt(_token_list(prompt, vocab_size, "prompt"))]
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompts = [encoder.encode_text(p, add_special, cache_salt=request.cache_salt)
                   for p in prompt]
    elif isinstance(prompt, list) and all(isinstance(p, list) and p for p in prompt):
        prompts = [EncodedPrompt(_token_list(p, vocab_size, "prompt")) for p in prompt]
    else:
        raise bad_request("prompt must be a string, a list of token ids, or a list of "
                          "strings or of token-id lists", "prompt")
    if any(not p.token_ids for p in prompts):
        raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.",
                          "prompt")
    requested = _requested_max_tokens(body, ("max_tokens",), models.max_model_len)
    request.explicit_max_tokens = requested is not None
    if requested is None and "max_tokens" not in body:
        requested = DEFAULT_COMPLETION_MAX_TOKENS
    request.prompts = prompts
    request.max_tokens = [_max_tokens(requested, len(p.token_ids), models.max_model_len)
                          for p in prompts]
    request.echo = _optional_bool(body, "echo")
    if request.allowed_token_ids is not None:
        request.allowed_token_ids = _token_list(request.allowed_token_ids, vocab_size,
                                                "allowed_token_ids")
    return request


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list):
        raise bad_request("messages must be a list of messages", "messages")
    if not messages:
        raise APIError("Cannot apply chat template to an empty conversation. Provide at "
                       "least one message.")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", "messages")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise bad_request(f"{where}.role must be a non-empty string", "messages")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of parts",
                              "messages")
        for j, part in enumerate(content):
            part_where = f"{where}.content[{j}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"{part_where} must be an object with a type", "messages")
            kind = part["type"]
            if kind in TEXT_PART_TYPES:
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"{part_where}.text must be a string", "messages")
            elif kind in MEDIA_PART_TYPES:
                payload = MEDIA_PART_TYPES[kind].payload
                if part.get(payload) is None and part.get("uuid") is None:
                    raise bad_request(f"{part_where} has no {payload} payload and no uuid",
                                      "messages")
            else:
                raise bad_request(f"{part_where}: unknown content part type {kind!r}",
                                  "messages")
    return messages


def parse_chat(body: Any, models: ServedModels, encoder: PromptEncoder,
               vocab_size: int | None) -> GenerationRequest:
    """Check a ``/v1/chat/completions`` body, render its template and tokenize."""
    request = _common(body, models, "chat")
    messages = _check_messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise bad_request("add_generation_prompt must be a boolean", "add_generation_prompt")
    prompt = encoder.encode_chat(messages, tools, add_generation_prompt,
                                 cache_salt=request.cache_salt)
    if not prompt.token_ids:
        raise bad_request("the rendered chat prompt is empty", "messages")
    requested = _requested_max_tokens(body, ("max_completion_tokens", "max_tokens"),
                                      models.max_model_len)
    request.explicit_max_tokens = requested is not None
    if requested is None and not body.get("ignore_eos"):
        left = models.max_model_len - len(prompt.token_ids)
        if left >= DUMMY_CHAT_REPLY_TOKENS:
            requested = DUMMY_CHAT_REPLY_TOKENS
            request.finish_reason = "stop"
    request.prompts = [prompt]
    request.max_tokens = [_max_tokens(requested, len(prompt.token_ids), models.max_model_len)]
    if request.allowed_token_ids is not None:
        request.allowed_token_ids = _token_list(request.allowed_token_ids, vocab_size,
                                                "allowed_token_ids")
    return request


# -- responses --------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, kind: str,
          *, full: bool = True) -> dict:
    """vLLM's UsageInfo. ``full`` (non-streaming bodies) writes every field; the final usage
    chunk of a stream writes only the ones set."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "total_tokens": prompt_tokens + completion_tokens,
                           "completion_tokens": completion_tokens}
    if cached_tokens is not None:
        details: dict[str, Any] = {"cached_tokens": cached_tokens}
        if kind == "chat":
            details["created_cache_tokens"] = 0
        elif full:
            details["created_cache_tokens"] = None
        if full:
            details["multimodal_tokens"] = None
        out["prompt_tokens_details"] = details
    if full:
        out["completion_tokens_details"] = None
    return out


def completion_body(response_id: str, created: int, model: str, choices: list[dict],
                    usage_info: dict) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage_info, "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None}


def completion_choice(index: int, text: str, finish_reason: str,
                      token_ids: list[int] | None, prompt_token_ids: list[int] | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": None, "token_ids": token_ids, "prompt_logprobs": None,
            "prompt_token_ids": prompt_token_ids, "routed_experts": None}


def chat_body(response_id: str, created: int, model: str, text: str, finish_reason: str,
              token_ids: list[int] | None, prompt_token_ids: list[int] | None,
              usage_info: dict) -> dict:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": text, "refusal": None,
                                     "annotations": None, "audio": None,
                                     "function_call": None, "reasoning": None},
                         "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                         "token_ids": token_ids, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage_info,
            "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(response_id: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None, token_ids: list[int] | None,
                     prompt_token_ids: list[int] | None) -> dict:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                              "finish_reason": finish_reason, "stop_reason": None,
                              "prompt_token_ids": prompt_token_ids, "token_ids": token_ids}
    return {"id": response_id, "object": "text_completion", "created": created,
            "model": model, "choices": [choice]}


def chat_role_chunk(response_id: str, created: int, model: str,
                    prompt_token_ids: list[int] | None) -> dict:
    return {"id": response_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": prompt_token_ids, "prompt_text": None}


def chat_chunk(response_id: str, created: int, model: str, text: str,
               finish_reason: str | None, token_ids: list[int] | None) -> dict:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = token_ids
    return {"id": response_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [choice]}


def usage_chunk(response_id: str, created: int, model: str, kind: str,
                usage_info: dict) -> dict:
    return {"id": response_id,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_info,
            "system_fingerprint": SYSTEM_FINGERPRINT}
