"""The state file: atomic replace, resume, and refusal of a file it cannot trust."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.state_store import StateError, load_state, save_state


def test_round_trip_and_no_temporary_files_left(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.json"
    assert load_state(path) is None
    save_state(path, {"next_version": 5, "history": [{"a": 1.5}]})
    save_state(path, {"next_version": 6, "history": []})
    assert load_state(path) == {"next_version": 6, "history": []}
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_failed_write_keeps_the_old_state(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    save_state(path, {"next_version": 5})
    with pytest.raises(ValueError):
        save_state(path, {"bad": float("nan")})  # not valid JSON: refused before writing
    assert load_state(path) == {"next_version": 5}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


@pytest.mark.parametrize(("text", "match"), [("{half", "not valid JSON"), ("[1]", "object")])
def test_unusable_state_file_is_an_error(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(StateError, match=match):
        load_state(path)
