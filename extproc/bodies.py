"""An HTTP body read within a size bound, whoever sends it: an engine's answer (a health probe,
a metrics page, its KV-event sources) or a client's admin call. Never held whole past the bound,
whatever the other side sends (an endless health body once took the router to 1.4 GB)."""

from __future__ import annotations

import aiohttp


class TooLarge(ValueError):
    """A body past its bound."""


async def read_capped(content: aiohttp.StreamReader, most: int, what: str) -> bytes:
    """The body of ``content``, read up to ``most`` bytes (TooLarge past them)."""
    body = bytearray()
    async for chunk in content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > most:
            raise TooLarge(f"{what} over {most} bytes")
    return bytes(body)
