"""The requests the diagnostics read: OpenAI chat and completions bodies, parsed and checked.

A request reaches the engine as one token sequence. For ``/v1/completions`` vLLM tokenizes the
prompt *with* the tokenizer's special tokens (its post-processor's BOS); for
``/v1/chat/completions`` it renders the chat template and tokenizes the result *without* adding
special tokens (the template writes them). :class:`PromptEncoder` is that step, injected by the
edge that owns a tokenizer, so the diagnostics stay pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

from prefixroute.core.errors import InputError

CHAT = "chat"
COMPLETION = "completion"
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """One logged request: a chat (``messages``, optional ``tools``) or a completion
    (``prompt`` text, or ``prompt_token_ids`` when the caller sent ids).

    Message contents are plain strings: OpenAI content-part lists are flattened the way vLLM
    does for string-content templates (text parts joined with newlines). ``where`` names the
    source ("log.jsonl:7") for messages.
    """

    kind: str
    tenant: str = DEFAULT_TENANT
    messages: tuple[dict, ...] | None = None
    tools: list | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    model: str = ""
    cache_salt: str | None = None
    where: str = ""
    # Likely mistakes that do not stop the lint (a user message without ``content``), for the
    # edge to show; see :func:`_content_notes`.
    notes: tuple[str, ...] = ()

    @property
    def cache_partition(self) -> tuple[str, str, str | None]:
        """Requests share cached blocks only within one tenant, model and cache salt."""
        return (self.tenant, self.model, self.cache_salt)


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the engine tokenizes for a request: the text, and whether the tokenizer's special
    tokens are added (completions yes, rendered chat templates no)."""

    text: str
    add_special_tokens: bool


class PromptEncoder(Protocol):
    """A tokenizer and chat template, as the diagnostics need them."""

    def render(self, request: PromptRequest) -> Prompt:
        """The text the engine tokenizes for ``request``."""
        ...

    def encode_prompts(self, prompts: Sequence[Prompt]) -> list[Sequence[int]]:
        """Token ids of each prompt, in order."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        ...


def flatten_content(content: Any, where: str = "", field: str = "content") -> str:
    """A message's content as one string: strings as they are, content-part lists as their text
    parts joined with newlines (vLLM's "string" content format), ``None`` as empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text") \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and "type" in part:
                raise InputError(f"content part of type {part['type']!r} is not supported "
                                 "(text only)", where=where, field=f"{field}[{i}]")
            else:
                raise InputError("content part must be a string or a text part",
                                 where=where, field=f"{field}[{i}]")
        return "\n".join(texts)
    raise InputError("content must be a string or a list of parts", where=where, field=field)


# Messages that may carry no content: an assistant turn that only calls tools, and (legacy)
# function results; every other role without ``content`` renders as an empty turn.
_MAY_OMIT_CONTENT = ("assistant",)


def _content_notes(messages: list, where: str) -> tuple[str, ...]:
    """A message without ``content`` is rendered as an empty turn, so a typo ("contnet") goes
    unnoticed and the lint measures the wrong prompt; name it, with the key that is there."""
    import difflib

    notes = []
    for i, message in enumerate(messages):
        if "content" in message or message.get("role") in _MAY_OMIT_CONTENT:
            continue
        others = [key for key in message if key != "role"]
        close = difflib.get_close_matches("content", others, n=1, cutoff=0.6)
        hint = f" (is {close[0]!r} a misspelt 'content'?)" if close else ""
        notes.append(f"{where}: messages[{i}] ({message.get('role')}) has no content; rendered "
                     f"as an empty message{hint}")
    return tuple(notes)


def _messages(value: Any, where: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise InputError("messages must be a non-empty list", where=where, field="messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise InputError("each message must be an object", where=where,
                             field=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InputError("message has no role", where=where, field=f"messages[{i}].role")
        flat = dict(message)
        flat["content"] = flatten_content(message.get("content"), where,
                                          f"messages[{i}].content")
        messages.append(flat)
    return tuple(messages)


def _string(body: dict, key: str, where: str, default: Any) -> Any:
    value = body.get(key, default)
    if value is not default and not isinstance(value, str):
        raise InputError(f"{key} must be a string", where=where, field=key)
    return value


def parse_body(body: Any, where: str = "") -> PromptRequest:
    """A request from an OpenAI chat body (``messages``), a completions body (``prompt``) or a
    bare message list. Optional ``tenant``, ``model``, ``cache_salt`` and ``tools``."""
    if isinstance(body, list):
        body = {"messages": body}
    if not isinstance(body, dict):
        raise InputError("expected a JSON object (an OpenAI chat or completions body)",
                         where=where)
    tenant = _string(body, "tenant", where, DEFAULT_TENANT)
    model = _string(body, "model", where, "")
    salt = _string(body, "cache_salt", where, None)
    if "messages" in body and "prompt" in body:
        raise InputError("a body has either messages (chat) or prompt (completions), not both",
                         where=where)
    if "messages" in body:
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise InputError("tools must be a list", where=where, field="tools")
        messages = _messages(body["messages"], where)
        return PromptRequest(CHAT, tenant, messages=messages, tools=tools, model=model,
                             cache_salt=salt, where=where,
                             notes=_content_notes(body["messages"], where))
    if "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return PromptRequest(COMPLETION, tenant, prompt=prompt, model=model,
                                 cache_salt=salt, where=where)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return PromptRequest(COMPLETION, tenant, prompt_token_ids=tuple(prompt), model=model,
                                 cache_salt=salt, where=where)
        raise InputError("prompt must be a string or a list of token ids (batched prompts "
                         "are not supported)", where=where, field="prompt")
    raise InputError("neither messages (chat) nor prompt (completions) found", where=where)


def parse_log(lines: Iterable[str], source: str) -> list[PromptRequest]:
    """Requests from JSONL text, one body per line; blank lines are skipped.

    One log holds one format: chat and completions requests tokenize differently (template vs
    special tokens), so a mixed log is almost always two logs pasted together and is refused
    with the line of the first request that breaks the pattern.
    """
    requests: list[PromptRequest] = []
    first_kind: tuple[str, str] | None = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON ({exc.msg} at column {exc.colno})",
                             where=where) from None
        request = parse_body(body, where)
        if first_kind is None:
            first_kind = (request.kind, where)
        elif request.kind != first_kind[0]:
            raise InputError(f"mixed formats: this is a {request.kind} request but "
                             f"{first_kind[1]} is a {first_kind[0]} request; "
                             "lint one format per log", where=where)
        requests.append(request)
    if not requests:
        raise InputError("no requests found", where=source)
    return requests
