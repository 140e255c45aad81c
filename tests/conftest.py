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


@pytest.fixture(scope="session")
def interop_ds(tiny_model, tmp_path_factory):
    """12 demo samples, layers 0, 1, 2 (three aux layers, as SpecForge needs) on the tiny model (read-only)."""
    from tests.interoptools import build_tiny

    return build_tiny(tiny_model, tmp_path_factory.mktemp("interop-bf16") / "ds")


@pytest.fixture(scope="session")
def interop_pre_ds(tiny_norm_model, tmp_path_factory):
    """12 demo samples, layers 0, 1 and 3 = L-1 (before the final norm) on the random-norm model (read-only)."""
    from tests.interoptools import PRE_LAYERS, build_tiny

    return build_tiny(tiny_norm_model, tmp_path_factory.mktemp("interop-pre") / "ds", layers=PRE_LAYERS)
