"""Fixtures shared by the core's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tokenizer import build_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A served model's tokenizer and chat template (`tests.support.tokenizer`)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    return build_model_dir(tmp_path_factory.mktemp("tok"))
