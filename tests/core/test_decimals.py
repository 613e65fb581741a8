"""`whole_number`: the one reading of decimal text that another process or a client wrote."""

from __future__ import annotations

import pytest

from gorgo.core.decimals import whole_number


@pytest.mark.parametrize(("text", "digits", "expected"), [
    ("0", 20, 0),
    ("42", 20, 42),
    ("18446744073709551615", 20, 2**64 - 1),
    ("1" * 21, 20, None),  # past its digits
    ("65535", 5, 65535),
    ("065535", 5, 65535),  # leading zeros are not digits of the bound: refused before
    ("0" * 25 + "7", 20, 7),
    ("0" * 63 + "7", 20, 7),
    ("0" * 64 + "7", 20, None),  # past MAX_PADDED_CHARS: refused unscanned
    ("000", 20, 0),
    ("²", 20, None),  # isdigit takes it, int refuses it: a ValueError before
    ("٣", 20, None),  # an Arabic-Indic 3: isdigit takes it and int reads it, no ASCII
    ("9" * 5000, 20, None),  # int refuses past 4,300 digits: a ValueError before
    ("-1", 20, None), ("+1", 20, None), ("1.0", 20, None), (" 1", 20, None), ("1e3", 20, None),
    ("", 20, None),
])
def test_whole_number(text: str, digits: int, expected: int | None) -> None:
    assert whole_number(text, digits) == expected
