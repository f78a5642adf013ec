"""Reading requests in tests' scripted HTTP/1.1 servers (a replica that answers from a script)."""

from __future__ import annotations

import asyncio


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """The next request's head, its body read and dropped; ``None`` once the client has gone."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head
