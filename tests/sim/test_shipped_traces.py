"""The traces the repository ships: where they are found by default and that they are intact."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gorgo.sim import traces

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"


def _sums() -> dict[str, str]:
    """``data/SHA256SUMS`` (``sha256sum`` format, paths relative to data/) as path -> digest."""
    out: dict[str, str] = {}
    for line in (DATA / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            out[name.lstrip("*")] = digest
    return out


def test_default_traces_dir_is_the_repositorys_data_traces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(traces.TRACES_ENV, raising=False)
    default = traces.traces_dir()
    assert default == DATA / "traces"
    assert default.resolve().is_relative_to(REPO)
    for file in (traces.MOONCAKE_FILE, traces.AZURE_FILE):
        assert (default / file).is_file(), file


def test_every_shipped_trace_matches_its_checksum() -> None:
    sums = _sums()
    # Both trace files the loaders read are pinned, and nothing else hides under data/traces.
    shipped = {f"traces/{traces.MOONCAKE_FILE}", f"traces/{traces.AZURE_FILE}"}
    assert shipped <= set(sums)
    on_disk = {
        p.relative_to(DATA).as_posix()
        for p in (DATA / "traces").rglob("*")
        if p.is_file() and p.name != "README.md"
    }
    assert on_disk == set(sums)
    for name, digest in sums.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


def test_each_trace_folder_documents_its_license_and_checksum() -> None:
    sums = _sums()
    for name, digest in sums.items():
        readme = (DATA / name).parent / "README.md"
        text = readme.read_text(encoding="utf-8")
        assert digest in text, readme
        assert "License" in text and "Commit" in text, readme
