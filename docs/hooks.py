"""MkDocs hook: the command-line page generated from the argparse parsers (``hs_dataset.cli.make_parser``), so
it says what ``hs-dataset COMMAND --help`` says and cannot drift. docs/cli.md holds the marker it replaces."""

from __future__ import annotations

import os
from typing import Any

MARKER = "<!-- cli-reference -->"


def cli_reference() -> str:
    """Every command's ``--help``, and ``build``'s list of config fields and backend options."""
    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal's width: the same text on every machine
    from hs_dataset.cli import make_parser  # deferred: the docs build imports the package only here
    from hs_dataset.cli.options import config_help

    parser = make_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]  # noqa: SLF001
    out = ["## hs-dataset", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, p in sub.choices.items():  # type: ignore[attr-defined]
        out += [f"## hs-dataset {name}", "", "```text", p.format_help().rstrip(), "```", ""]
    out += ["## Config fields and backend options", "",
            "What `hs-dataset build --help` and `plan --help` add after the flags: every field of a builder script's "
            "`CONFIG` (`--set NAME=VALUE`) and every option of each backend (`--set backend_options.NAME=VALUE`).", "",
            "```text", config_help().rstrip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return markdown.replace(MARKER, cli_reference()) if MARKER in markdown else markdown
