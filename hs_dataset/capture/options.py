"""The options of each capture backend (a build's ``backend_options``), read from the backend classes'
own signatures (names, defaults) and docstrings (the ``Args:`` lines), so that ``hs-dataset build
--help`` and the check of a configuration's ``backend_options`` cannot drift from the code.

``isolate`` and the options of the child process it starts (:class:`~hs_dataset.capture.isolated.ProcessBackend`:
``timeout``, ``start_timeout``, ``max_inflight``) apply to every backend.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from typing import Any

from hs_dataset.capture.registry import backend_class
from hs_dataset.config import did_you_mean
from hs_dataset.errors import ConfigError

__all__ = ["ISOLATE_OPTIONS", "BackendOption", "backend_options", "check_backend_options"]

# Constructor arguments the build passes itself (from the config): not options.
FROM_BUILD = ("model", "layers", "revision", "name", "options")
ISOLATE_HELP = "run the backend in a child process: its death or hang stops the build with a clear error"
# The options of the isolation (ProcessBackend) that every backend takes.
ISOLATE_OPTIONS = ("isolate", "timeout", "start_timeout", "max_inflight")


@dataclass(frozen=True)
class BackendOption:
    """One ``backend_options`` key: its name, default and one-line help."""

    name: str
    default: Any
    help: str


def _arg_help(doc: str) -> dict[str, str]:
    """``{argument: its first sentence}`` from a Google-style ``Args:`` section."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    try:
        start = lines.index("Args:") + 1
    except ValueError:
        return out
    current: list[str] = []
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next section
        m = re.match(r"^ {4}([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*): (.*)$", line)
        if m:
            current = m.group(1).split(", ")
            for name in current:
                out[name] = m.group(2).strip()
        elif current and line.strip():
            for name in current:
                out[name] += " " + line.strip()
    return {k: re.sub(r"``", "", v) for k, v in out.items()}


def _options_of(cls: type) -> list[BackendOption]:
    helps = _arg_help(cls.__doc__ or "")
    opts = []
    for p in inspect.signature(cls).parameters.values():
        if p.name == "self" or p.name in FROM_BUILD or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        opts.append(BackendOption(p.name, None if p.default is p.empty else p.default, helps.get(p.name, "")))
    return opts


def backend_options(name: str) -> list[BackendOption]:
    """The options of backend ``name`` (``transformers`` or ``sglang``), then the isolation options.

    Raises:
        ConfigError: an unknown backend name.
    """
    from hs_dataset.capture.isolated import ProcessBackend  # deferred: it imports torch

    own = _options_of(backend_class(name))
    names = {o.name for o in own}
    iso = [dataclasses.replace(o, help=f"with isolate: {o.help}") for o in _options_of(ProcessBackend)
           if o.name in ISOLATE_OPTIONS and o.name not in names]
    return own + [BackendOption("isolate", False, ISOLATE_HELP)] + iso


def check_backend_options(name: str, options: dict[str, Any]) -> None:
    """Refuse a ``backend_options`` key that backend ``name`` does not take, naming the closest one.

    Raises:
        ConfigError: an unknown backend or option.
    """
    known = [o.name for o in backend_options(name)]
    for key in options:
        if key not in known:
            raise ConfigError(f"backend_options.{key}: the {name} backend has no option {key!r}"
                              f"{did_you_mean(key, known)}; its options: {', '.join(known)}")
