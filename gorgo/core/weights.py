"""The weights of the cost terms: a read-only mapping from weight key to factor, plus a version.

Its keys are the registry's weighted terms (`gorgo.core.terms.WEIGHTED`), so a new weighted term
needs no change here; the version is stamped into every decision so a span says which weights
routed it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from gorgo.core.terms import WEIGHTED, CostTerm


class Weights(Mapping[str, float]):
    """Immutable; unknown keys are an error, missing ones take the term's default."""

    __slots__ = ("_values", "version")

    def __init__(self, values: Mapping[str, float] | None = None, version: int = 0) -> None:
        merged = {k: t.default for k, t in WEIGHTED.items()}
        for key, value in (values or {}).items():
            if key not in WEIGHTED:
                raise KeyError(f"unknown weight {key!r} (known: {', '.join(WEIGHTED)})")
            merged[key] = float(value)
        object.__setattr__(self, "_values", merged)
        object.__setattr__(self, "version", int(version))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Weights are immutable: use replace()")

    def __getitem__(self, key: str) -> float:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Weights):
            return NotImplemented
        return self._values == other._values and self.version == other.version

    def __hash__(self) -> int:
        return hash((tuple(self._values.items()), self.version))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v:g}" for k, v in self._values.items())
        return f"Weights({inner}, version={self.version})"

    def factor(self, term: CostTerm) -> float:
        """The factor on ``term`` (1 for an unweighted term)."""
        return 1.0 if term.weight is None else self._values[term.weight]

    def replace(self, values: Mapping[str, float] | None = None,
                version: int | None = None) -> Weights:
        return Weights({**self._values, **(values or {})},
                       self.version if version is None else version)
