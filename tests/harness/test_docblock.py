"""Benches replace only their own marked block in a shared doc."""

from __future__ import annotations

from pathlib import Path

from gorgo.harness.docblock import command_lines, public_args, write_block


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


def test_command_lines_quote_the_command_and_say_the_wall_time() -> None:
    head, took = command_lines("bench/x.py", ["--trace", "a b"], 90.0)
    assert head == ["```", ".venv/bin/python bench/x.py --trace 'a b'", "```", ""]
    assert took.startswith(" in 1.5 min on ")
    assert command_lines("bench/x.py", [], None)[1] == ""
