"""What Envoy's string-tagged request spans mean in OpenTelemetry's conventions, typed.

Envoy's custom tags are strings, so the rendered bootstrap tags raw values under ``gorgo.*`` names
(the first upstream byte in microseconds, ``stream`` as "true"/"false", model, operation,
provider) and `REWRITES` says how each becomes a GenAI attribute of the convention's type and
unit. The time to first chunk is set only on streamed answers: on a whole answer the first byte
comes once the answer is complete. One table, two renderings: `typed_attributes` (Python, for the
tuner's own use and the tests) and `ottl_statements`, the OpenTelemetry Collector's transform
processor statements that deploy/otel-collector.yaml ships (tests/deploy checks they are equal).

The same two renderings drop Envoy's ``status: canceled`` tag from its span of the ext_proc
stream: Envoy tags every such stream so when it closes it at the request's end, which is how the
router learns the request is over, not a failure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gorgo.core.contract import (
    EXTPROC_SPAN,
    GENAI_MODEL_ATTR,
    GENAI_OPERATION_ATTR,
    GENAI_PROVIDER_ATTR,
    GENAI_STREAM_ATTR,
    GENAI_TTFC_ATTR,
    SPAN_PREFIX,
    TTFT_ATTR,
)
from gorgo.core.decimals import whole_number

TEXT = "text"
BOOL = "bool"
US_TO_S = "us_to_s"
STREAM_TAG = SPAN_PREFIX + "stream"
MISSING = ("", "-")  # Envoy writes "-" where the metadata has no such key
# Envoy's tag on its span of a gRPC stream it closed itself.
CANCELED_TAG = ("status", "canceled")


@dataclass(frozen=True, slots=True)
class Rewrite:
    target: str  # the convention's attribute
    source: str  # the gorgo.* string tag it is made from
    kind: str  # TEXT, BOOL ("true"/"false") or US_TO_S (a count of microseconds -> seconds)
    streamed_only: bool = False


REWRITES = (
    Rewrite(GENAI_OPERATION_ATTR, SPAN_PREFIX + "operation", TEXT),
    Rewrite(GENAI_PROVIDER_ATTR, SPAN_PREFIX + "provider", TEXT),
    Rewrite(GENAI_MODEL_ATTR, SPAN_PREFIX + "model", TEXT),
    Rewrite(GENAI_STREAM_ATTR, STREAM_TAG, BOOL),
    Rewrite(GENAI_TTFC_ATTR, TTFT_ATTR, US_TO_S, streamed_only=True),
)


def _typed(kind: str, raw: str) -> str | bool | float | None:
    if kind == TEXT:
        return raw
    if kind == BOOL:
        return {"true": True, "false": False}.get(raw)
    us = whole_number(raw)  # Envoy writes a whole number of microseconds
    if us is None:
        return None
    x = us / 1e6
    return x if math.isfinite(x) else None


def typed_attributes(name: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """A span's attributes after the Collector's rewrite: the GenAI attributes added, typed, and
    the ext_proc stream's spurious ``canceled`` dropped; the raw ``gorgo.*`` tags stay."""
    out = dict(attrs)
    if name == EXTPROC_SPAN and out.get(CANCELED_TAG[0]) == CANCELED_TAG[1]:
        del out[CANCELED_TAG[0]]
    streamed = attrs.get(STREAM_TAG) == "true"
    for r in REWRITES:
        raw = attrs.get(r.source)
        if not isinstance(raw, str) or raw in MISSING or (r.streamed_only and not streamed):
            continue
        value = _typed(r.kind, raw)
        if value is not None:
            out[r.target] = value
    return out


def _attr(key: str) -> str:
    return f'attributes["{key}"]'


def ottl_statements() -> list[str]:
    """`typed_attributes` as transform-processor statements (span context, error_mode ignore)."""
    key, value = CANCELED_TAG
    out = [f'delete_key(attributes, "{key}") where name == "{EXTPROC_SPAN}" and '
           f'{_attr(key)} == "{value}"']
    for r in REWRITES:
        src, dst = _attr(r.source), _attr(r.target)
        when = f" and {_attr(STREAM_TAG)} == \"true\"" if r.streamed_only else ""
        if r.kind == TEXT:
            present = " and ".join(f'{src} != "{m}"' for m in MISSING)
            out.append(f"set({dst}, {src}) where {src} != nil and {present}{when}")
        elif r.kind == BOOL:
            out += [f'set({dst}, {v}) where {src} == "{v}"{when}' for v in ("true", "false")]
        else:
            out.append(f'set({dst}, Double({src}) / 1000000.0) where '
                       f'IsMatch({src}, "^[0-9]+$"){when}')
    return out
