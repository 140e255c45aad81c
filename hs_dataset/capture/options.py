"""The options of each capture backend (a build's ``backend_options``), read from the backend classes'
own source (their ``__init__`` signatures: names, defaults; their docstrings: the ``Args:`` lines), so
that ``hs-dataset build --help`` and the check of a configuration's ``backend_options`` cannot drift
from the code, and cost no import of the backends (torch, SGLang): the source is parsed, not run.

``isolate`` and the options of the child process it starts (:class:`~hs_dataset.capture.isolated.ProcessBackend`:
``timeout``, ``start_timeout``, ``max_inflight``) apply to every backend.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import inspect
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

from hs_dataset.capture.registry import ISOLATION_CLASS, class_path
from hs_dataset.config import did_you_mean
from hs_dataset.errors import ConfigError

__all__ = ["ISOLATE_OPTIONS", "BackendOption", "backend_options", "check_backend_options"]

# Constructor arguments the build passes itself (from the config): not options.
FROM_BUILD = ("model", "layers", "revision", "name", "options")
ISOLATE_HELP = "run the backend in a child process: its death or hang stops the build with a clear error"
# The options of the isolation (ProcessBackend) that every backend takes.
ISOLATE_OPTIONS = ("isolate", "timeout", "start_timeout", "max_inflight")
# The operators a default may use (``ring_bytes: int = DEFAULT_RING_BYTES`` with ``DEFAULT_RING_BYTES = 4 << 30``).
_OPERATORS: dict[type, Callable[..., Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                              ast.LShift: operator.lshift, ast.Pow: operator.pow,
                                              ast.USub: operator.neg}


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


def _value(node: ast.expr, names: dict[str, ast.expr]) -> Any:
    """The value of a default: a literal, a module constant, or arithmetic on them."""
    if isinstance(node, ast.Name) and node.id in names:
        return _value(names[node.id], names)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left, names), _value(node.right, names))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand, names))
    return ast.literal_eval(node)


@functools.lru_cache(maxsize=None)
def _options_of(module: str, cls: str) -> tuple[BackendOption, ...]:
    """The keyword options of class ``cls``'s ``__init__`` in ``module``'s source, with their help."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ConfigError(f"cannot find the source of {module}: is hs_dataset installed completely?")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    names = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    names.update({node.target.id: node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                  and isinstance(node.target, ast.Name) and node.value is not None})
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    helps = _arg_help(ast.get_docstring(klass) or "")
    a = init.args
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = list(zip(positional, defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
    return tuple(BackendOption(p.arg, None if d is None else _value(d, names), helps.get(p.arg, ""))
                 for p, d in params if p.arg != "self" and p.arg not in FROM_BUILD)


def backend_options(name: str) -> list[BackendOption]:
    """The options of backend ``name`` (``transformers`` or ``sglang``), then the isolation options.

    Raises:
        ConfigError: an unknown backend name.
    """
    own = list(_options_of(*class_path(name)))
    names = {o.name for o in own}
    iso = [dataclasses.replace(o, help=f"with isolate: {o.help}") for o in _options_of(*ISOLATION_CLASS)
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
