"""The chat content-part types an engine takes as media, in one list.

Source: vLLM 0.32 ``vllm/renderers/chat_utils.py`` (``vllm/entrypoints/chat_utils.py`` before
it moved): ``MM_PARSER_MAP`` and ``_parse_chat_message_content_part``, which hand these types
to the multimodal parser (everything else is text, a refusal, a thinking part, a tool
reference, ``prompt_embeds``, or a 400 "Unsupported chat content part type"):

==================  ======================  =========  =================================
type                payload key             modality   payload
==================  ======================  =========  =================================
``image_url``       ``image_url``           image      ``{"url": ...}``, a URL or ``data:``
``input_image``     ``image_url``           image      a URL string (OpenAI Responses)
``image_pil``       ``image_pil``           image      a PIL image (in-process callers)
``image_embeds``    ``image_embeds``        image      base64 tensor(s)
``audio_url``       ``audio_url``           audio      ``{"url": ...}``
``input_audio``     ``input_audio``         audio      ``{"data": base64, "format": ...}``
``audio_embeds``    ``audio_embeds``        audio      base64 tensor(s)
``video_url``       ``video_url``           video      ``{"url": ...}``
``video_embeds``    ``video_embeds``        video      base64 tensor(s)
==================  ======================  =========  =================================

``prompt_embeds`` parts are spliced into the prompt as embeddings, not multimodal items: they
take no ``uuid`` and get no multimodal hash, so they are not listed.

Every media item enters vLLM's block hashes through its identity (a caller's ``uuid``, else a
hash of the media), so whoever assigns identities (the gateway, per trust group) must see every
type here: inline media it does not recognise keeps the engine's content hash, the same for
every trust group. The gateway's sanitizer, its prompt preparation and the emulator all read
this table.

A part without ``type`` is still media to vLLM when it carries a payload key
(``_parse_chat_message_content_mm_part`` looks for them in the order of
:data:`UNTYPED_PAYLOAD_ORDER`); :func:`media_part_type` resolves it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class MediaPartType:
    """One media content-part type: where its payload sits and what the engine makes of it.

    ``by_url``: the payload is a URL, so the media travels inside the request only as a
    ``data:`` URL (anything else the engine fetches and hashes itself); otherwise the payload
    is always the media itself (base64 audio, embeddings, an in-process image)."""

    type: str
    payload: str
    modality: str
    by_url: bool


MEDIA_PART_TYPES: Mapping[str, MediaPartType] = {
    t.type: t for t in (
        MediaPartType("image_url", "image_url", "image", by_url=True),
        MediaPartType("input_image", "image_url", "image", by_url=True),
        MediaPartType("image_pil", "image_pil", "image", by_url=False),
        MediaPartType("image_embeds", "image_embeds", "image", by_url=False),
        MediaPartType("audio_url", "audio_url", "audio", by_url=True),
        MediaPartType("input_audio", "input_audio", "audio", by_url=False),
        MediaPartType("audio_embeds", "audio_embeds", "audio", by_url=False),
        MediaPartType("video_url", "video_url", "video", by_url=True),
        MediaPartType("video_embeds", "video_embeds", "video", by_url=False),
    )
}

# Text content parts both chat paths render as text.
TEXT_PART_TYPES = ("text", "input_text")

# vLLM's order of payload keys for a part with no ``type`` (or with a ``uuid``).
UNTYPED_PAYLOAD_ORDER = ("image_url", "image_pil", "image_embeds", "audio_embeds",
                         "video_embeds", "audio_url", "input_audio", "video_url")


def media_part_type(part: Mapping[str, Any]) -> MediaPartType | None:
    """The media type of a content part, or ``None`` when the engine does not take it as
    media: by its ``type``, or for a part without one by the first payload key it carries."""
    kind = part.get("type")
    if kind is not None:
        return MEDIA_PART_TYPES.get(kind) if isinstance(kind, str) else None
    for key in UNTYPED_PAYLOAD_ORDER:
        if key in part:
            return MEDIA_PART_TYPES[key]
    return None
