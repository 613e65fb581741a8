"""Whole numbers written as decimal text by a client, an engine or Envoy (a header, a scraped
counter, a span attribute, a JSON key), read one way everywhere.

``str.isdigit`` takes '²' and other digits that ``int`` refuses, and ``int`` refuses text past
4,300 digits: either raised ValueError where a check of ``isdigit`` alone stood before ``int``
(a retried request's attempt count, a span's microseconds, a router's weights document).
"""

from __future__ import annotations

UINT64_DIGITS = 20  # 18,446,744,073,709,551,615
# Leading zeros read past the digit bound, up to this many characters in all: a header of
# thousands of zeros is refused before it is scanned.
MAX_PADDED_CHARS = 64


def whole_number(text: str, digits: int = UINT64_DIGITS) -> int | None:
    """``text`` as a whole number when it is plain ASCII digits, at most ``digits`` of them
    after any leading zeros (HTTP allows them: a zero-padded Content-Length is the same length),
    in at most MAX_PADDED_CHARS characters; None otherwise."""
    if len(text) > max(digits, MAX_PADDED_CHARS) or not (text.isascii() and text.isdigit()):
        return None
    significant = text.lstrip("0")
    return int(significant or "0") if len(significant) <= digits else None
