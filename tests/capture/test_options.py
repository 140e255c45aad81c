"""The backends' options (hs_dataset.capture.options) are the keywords their constructors take, with the same
defaults: the declared options cannot drift from the code that uses them."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

from hs_dataset.capture.options import OPTIONS, IsolateOptions, backend_options, check_backend_options
from hs_dataset.capture.registry import class_path
from hs_dataset.errors import ConfigError

FROM_BUILD = {"self", "model", "layers", "revision", "name", "options"}  # passed by the build itself, not options


def keywords(module: str, cls: str) -> dict[str, object]:
    init = getattr(importlib.import_module(module), cls).__init__
    return {p.name: p.default for p in inspect.signature(init).parameters.values() if p.name not in FROM_BUILD}


@pytest.mark.parametrize("backend", sorted(OPTIONS))
def test_each_backends_options_are_its_constructors_keywords(backend):
    declared = {f.name: f.default for f in dataclasses.fields(OPTIONS[backend])}
    assert declared == keywords(*class_path(backend))
    iso = {f.name: f.default for f in dataclasses.fields(IsolateOptions)}
    assert iso == keywords("hs_dataset.capture.isolated", "ProcessBackend")
    names = [o.name for o in backend_options(backend)]
    assert names[:len(declared)] == list(declared) and "isolate" in names and "start_timeout" in names
    assert all(o.help for o in backend_options(backend))


def test_an_unknown_option_names_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'batch_tokens'"):
        check_backend_options("transformers", {"batch_token": 4})
    check_backend_options("sglang", {"tp_size": 2, "isolate": True, "timeout": 10})
