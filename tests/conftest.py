"""Fixtures shared by the CPU pipeline tests (helpers: tests/buildtools.py)."""

from __future__ import annotations

import pytest

from hs_dataset.backends.transformers import TransformersBackend
from hs_dataset.tiny import make_tiny_model_dir
from tests.buildtools import LAYERS


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random-weight Llama (4 layers, hidden 64) with a ChatML tokenizer, made once per session."""
    return str(make_tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-chatml-0", template="chatml", seed=0))


@pytest.fixture(scope="module")
def backend(tiny_model):
    """A started transformers backend for the tiny model, shared by a module's builds."""
    b = TransformersBackend(tiny_model, LAYERS, device="cpu", batch_tokens=2048)
    yield b
    b.close()


@pytest.fixture(scope="session")
def tiny_norm_model(tmp_path_factory) -> str:
    """The tiny Llama with random RMSNorm weights (U(0.5, 1.5)): post-norm differs from pre-norm."""
    return str(make_tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-chatml-norms", template="chatml", seed=0,
                                   random_norms=True))
