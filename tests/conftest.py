"""Fixtures shared by the CPU pipeline tests (helpers: tests/buildtools.py)."""

from __future__ import annotations

import pytest

from hs_dataset.tiny import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random-weight Llama (4 layers, hidden 64) with a ChatML tokenizer, made once per session."""
    return str(make_tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-chatml-0", template="chatml", seed=0))
