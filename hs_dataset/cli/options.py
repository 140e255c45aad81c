"""Options shared by the commands, defined once: the builder script and its config overrides
(``--set``, ``--model``, ``--layers``...), ``--no-progress``, ``--debug``, and ``build --help``'s list
of every config field and backend option, generated from :func:`hs_dataset.config.config_fields`
and the backends' own signatures (:mod:`hs_dataset.capture.options`), so it cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any, NoReturn

from hs_dataset.capture.options import backend_options, check_backend_options
from hs_dataset.config import HiddenStatesConfig, coerce_field, config_fields, describe_type, did_you_mean, field_types
from hs_dataset.errors import ConfigError, MissingPathError
from hs_dataset.layout import BACKENDS

__all__ = ["CliParser", "add_config_args", "add_progress_arg", "command_line", "common_parser", "config_help",
           "layers_arg", "load_preset", "make_config", "parse_value", "unknown_arguments"]

# Fields with their own flag (``--max-samples N`` = ``--set max_samples=N``), in this order.
FLAG_FIELDS = ("model", "source", "layers", "max_samples", "backend", "storage_dtype", "on_nonfinite", "duplicates")


def parse_value(text: str) -> Any:
    """A nested ``--set a.b=value``: JSON when it parses as JSON (numbers, lists, null, true), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_sets(config: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` overrides, each checked against its field's type (:func:`coerce_field`);
    ``a.b=value`` sets a key of an object field (``backend_options.tp_size=8``, ``generation.seed=1``).

    Raises:
        ConfigError: no ``=``, an unknown field (naming the closest), a value of the wrong type.
    """
    types = field_types()
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set max_length=2048")
        key, value = item.split("=", 1)
        name, *path = key.strip().split(".")
        if not path:
            config[name] = coerce_field(name, value)
            continue
        if name not in types:
            coerce_field(name, value)  # the unknown-field error, with the closest name
        if describe_type(types[name]) != "JSON object":
            raise ConfigError(f"--set {key}=...: {name} is a {describe_type(types[name])}, not an object; "
                              f"use --set {name}=VALUE")
        target = config.setdefault(name, {})
        for p in path[:-1]:
            target = target.setdefault(p, {})
            if not isinstance(target, dict):
                raise ConfigError(f"--set {key}=...: {p} is not an object")
        target[path[-1]] = parse_value(value)
    return config


def load_preset(path: str, sets: list[str]) -> dict[str, Any]:
    """Load a builder script (a ``CONFIG`` dict, optionally ``prepare(config)``), apply the overrides, prepare.

    Raises:
        MissingPathError: no such script. ConfigError: no ``CONFIG`` dict, an unknown field or a bad value.
    """
    if not Path(path).is_file():
        raise MissingPathError(f"builder script {path!r} not found: give the path of a .py file with a CONFIG dict, "
                               "e.g. builder_scripts/tiny_demo.py")
    spec = importlib.util.spec_from_file_location(f"hs_preset_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"builder script {path!r} cannot be loaded as Python: name it *.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not isinstance(getattr(mod, "CONFIG", None), dict):
        raise ConfigError(f"{path} defines no CONFIG dict: add CONFIG = {{'model': ..., 'source': ..., 'layers': [...]}}")
    for key in mod.CONFIG:
        if key not in field_types():
            raise ConfigError(f"{path}: CONFIG has no field {key!r}{did_you_mean(key, field_types())}; "
                              "`hs-dataset build --help` lists the fields")
    config = apply_sets(json.loads(json.dumps(mod.CONFIG)), sets)
    if hasattr(mod, "prepare"):
        mod.prepare(config)
    return config


def make_config(a: argparse.Namespace) -> HiddenStatesConfig:
    """The :class:`~hs_dataset.config.HiddenStatesConfig` of a command line (``a.script`` + ``a.set``), its
    ``backend_options`` checked too: every error of the configuration itself, before anything is loaded.

    Raises:
        ConfigError: see :func:`load_preset`; an unknown backend or backend option (naming the closest).
    """
    config = HiddenStatesConfig(**load_preset(a.script, a.set))
    check_backend_options(config.backend, dict(config.backend_options, trust_remote_code=config.trust_remote_code))
    return config


def command_line() -> str:
    """This command line, as the user would type it again (recorded in the build's metadata)."""
    return "hs-dataset " + " ".join(shlex.quote(x) for x in sys.argv[1:])


def layers_arg(text: str | None) -> tuple[int, ...] | None:
    """``--layers 1,29,57`` (or ``[1,29,57]``) of export/import."""
    if text is None:
        return None
    try:
        return coerce_field("layers", text)
    except ConfigError:
        raise ConfigError(f"--layers {text!r}: expected layer ids, e.g. --layers 1,29,57 or --layers [1,29,57]") from None


class _SetField(argparse.Action):
    """An option that stands for ``--set <field>=<value>`` (applied in command-line order)."""

    def __init__(self, option_strings, dest, field: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.field = field

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        items.append(f"{self.field}={values}")
        setattr(namespace, self.dest, items)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The builder script, ``--set`` and a flag for each of :data:`FLAG_FIELDS`; the full list is in ``--help``."""
    p.add_argument("script", help="builder script (a CONFIG dict), e.g. builder_scripts/tiny_demo.py")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="set a config field (listed below); a.b=VALUE sets a key of an object field")
    fields = {f.name: f for f in config_fields()}
    types = field_types()
    for name in FLAG_FIELDS:
        f = fields[name]
        kind = describe_type(types[name])
        choices = tuple(kind.split("|")) if "|" in kind else f.metadata.get("choices")
        p.add_argument("--" + name.replace("_", "-"), action=_SetField, dest="set", field=name, choices=choices,
                       metavar=None if choices else name.upper(), help=f"= --set {name}=...: {f.metadata['help']}")


def add_progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true",
                   help="no progress display (a log file gets plain lines, a terminal a bar, by default)")


class CliParser(argparse.ArgumentParser):
    """A parser whose usage errors are one line and a pointer to ``--help``, like the commands' other errors
    (argparse's own print the whole usage first: 14 lines for ``build``, the error under them)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def unknown_arguments(parser: argparse.ArgumentParser, cmd: str, extras: list[str]) -> ConfigError:
    """The error for words ``cmd`` does not take, with the closest of its flags for a misspelt one."""
    flags = [o for sub in parser._actions if isinstance(sub, argparse._SubParsersAction)  # noqa: SLF001
             for a in sub.choices[cmd]._actions for o in a.option_strings if o.startswith("--")]  # noqa: SLF001
    hints = "".join(did_you_mean(w.split("=")[0], flags) for w in extras if w.startswith("--"))
    return ConfigError(f"unrecognized arguments: {' '.join(extras)}{hints} (see hs-dataset {cmd} --help)")


def common_parser() -> argparse.ArgumentParser:
    """``--debug``, accepted after any command (``hs-dataset build ... --debug``)."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of an error (also: HS_DATASET_DEBUG=1)")
    return c


def _default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # a dict field
        return "{}"
    if f.default == "" or f.default == ():
        return "(required)"
    return json.dumps(list(f.default) if isinstance(f.default, tuple) else f.default)


def _wrapped(head: str, text: str) -> str:
    return head + "\n" + textwrap.fill(text, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)


def config_help() -> str:
    """Every config field (type, default, one line) and every backend option: ``build --help``'s epilog."""

    types = field_types()
    lines = ["config fields (--set NAME=VALUE, or a builder script's CONFIG keys):"]
    for f in config_fields():
        lines.append(_wrapped(f"  {f.name}: {describe_type(types[f.name])} = {_default_text(f)}", f.metadata["help"]))
    for backend in BACKENDS:
        lines.append(f"\nbackend_options of backend={backend} (--set backend_options.NAME=VALUE):")
        for o in backend_options(backend):
            lines.append(_wrapped(f"  {o.name} = {json.dumps(o.default)}", o.help or "(no description)"))
    return "\n".join(lines)


class ConfigHelp(argparse.Action):
    """``-h/--help`` that appends :func:`config_help` (computed only when asked: it imports the backends)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.epilog = config_help()
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.print_help()
        parser.exit()
