"""Benches replace only their own marked block in a shared doc."""

from __future__ import annotations

from pathlib import Path

from gorgo.harness.docblock import public_args, write_block


def test_block_is_created_then_replaced_keeping_the_rest(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n\n## Other\n\nkeep me\n")
    write_block(doc, "## Mine", "<!-- b -->", "<!-- e -->", "one\n", "# Benchmarks")
    write_block(doc, "## Mine", "<!-- b -->", "<!-- e -->", "two\n", "# Benchmarks")
    text = doc.read_text()
    assert "keep me" in text and "two" in text and "one" not in text
    assert text.count("## Mine") == 1


def test_public_args_drop_the_local_output_path() -> None:
    assert public_args(["--rate", "3", "--out", "x.json", "--out=y", "--write-docs"]) == [
        "--rate", "3", "--write-docs"]
