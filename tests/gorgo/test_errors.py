"""The output-path checks a command runs before its work."""

from __future__ import annotations

from pathlib import Path

import pytest

from gorgo.errors import UserError, output_dir, output_file


def test_output_file_is_checked_without_a_trace(tmp_path: Path) -> None:
    new = tmp_path / "new.json"
    assert output_file(new) == new and not new.exists()  # no empty file left behind
    kept = tmp_path / "kept.json"
    kept.write_text("earlier")
    output_file(kept)
    assert kept.read_text() == "earlier"
    with pytest.raises(UserError, match=r"cannot write .*: Is a directory"):
        output_file(tmp_path)
    with pytest.raises(UserError, match=r"cannot write .*: No such file or directory"):
        output_file(tmp_path / "missing" / "x.json")


def test_output_dir_is_created_or_refused(tmp_path: Path) -> None:
    assert output_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"cannot create the folder .*: Not a directory"):
        output_dir(tmp_path / "file" / "d")
