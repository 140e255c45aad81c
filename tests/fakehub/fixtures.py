"""Fixtures: the local Hub-compatible server, with the real huggingface_hub client pointed at it (a pytest
plugin: tests/conftest.py). A test module's ``TOKEN`` is the token the client uses (default below)."""

from __future__ import annotations

import pytest

from tests.fakehub.server import running_hub
from tests.fakehub.tools import hub_client_env

DEFAULT_TOKEN = "hf_FakeHubTestToken0123456789ABCDEFGH"


@pytest.fixture
def hub(tmp_path, request):
    """A running local Hub, the client's environment set to it (``HF_ENDPOINT``, a home, the module's token)."""
    token = getattr(request.module, "TOKEN", DEFAULT_TOKEN)
    with running_hub(tmp_path) as server, hub_client_env(server, tmp_path / "home", token=token):
        yield server
