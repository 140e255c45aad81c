"""The card's text pieces: markdown-safe cells, and the load and decode snippets a reader copies."""

from __future__ import annotations

from typing import Any

from hs_dataset.layout import escape_controls

__all__ = ["cell", "code", "decode_snippet", "load_snippet"]


def cell(value: Any) -> str:
    """A value safe inside a markdown table cell."""
    if value is None or value == "":
        return "n/a"
    if isinstance(value, (list, tuple)):
        value = ", ".join(str(v) for v in value)
    text = str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")
    return escape_controls(text)  # ESC, BEL, U+202E of a file name: escaped, never raw in the card


def code(value: Any) -> str:
    """Text for inside a single-backtick span (backticks would end it)."""
    return cell(value).replace("`", "'")


def decode_snippet(storage_dtype: str, column: str, hidden_size: Any = None) -> str:
    """A copy-pasteable decoder for one hidden-state column: zero-copy views of the Arrow buffers, never Python lists."""
    helper = ("from hs_dataset.read import decode_row\n"
              "row = decode_row(ds.with_format('arrow')[0:1])  # dict of torch tensors: the states in bf16 [tokens, "
              "hidden], zero-copy, safe to write to")
    if storage_dtype != "bfloat16":  # fp8 e4m3 + a per-token scale: the project's decoder
        return helper
    hidden = int(hidden_size) if isinstance(hidden_size, int) else "hidden_size"
    return (
        helper + "\n\n"
        "# without hs_dataset: the bf16 bits as a view of the Arrow buffer (read-only: .clone() before in-place ops)\n"
        "import numpy as np, torch\n"
        "table = ds.with_format('arrow')[0:1]  # one row as an Arrow table, no Python lists\n"
        f'bits = table["{column}"].chunk(0).storage.flatten().flatten().to_numpy(zero_copy_only=True)\n'
        f"hidden = torch.from_numpy(bits.view(np.int16).reshape(-1, {hidden})).view(torch.bfloat16)  # [tokens, hidden]"
    )


def load_snippet(repo_id: str | None, version: str, local_dir: str | None) -> str:
    """How to load this version (published) or this build (local) for training: one copy on disk at most."""
    if repo_id is None:
        where = local_dir or "<build directory>"
        return ("## Load this build\n\n```python\nfrom hs_dataset.read import open_dataset\n\n"
                f'ds = open_dataset("{code(where)}")  # memory-maps the shards in place\n```\n\n'
                "`open_dataset` checks every shard against the xxh3-128 hashes below and keeps no copy. Plain "
                "`load_dataset(DIR)` works too, but checks no hash (a damaged or replaced shard is served) and keeps "
                "an Arrow copy in the `datasets` cache.\n\n"
                "Publish it as a version with `hs-dataset push DIR org/name --version v1.0`.")
    repo, rev = code(repo_id), code(version)
    return ("## Load a pinned version\n\n```python\n"
            "from hs_dataset.read import iter_torch, open_dataset\n\n"
            f'ds = open_dataset("{repo}", revision="{rev}")  # downloaded once, checked, memory-mapped: one copy on disk\n'
            "for sample in iter_torch(ds):  # dicts of torch tensors: each state bf16 [tokens, hidden], zero-copy\n"
            "    ...\n"
            "# or stream it over HTTP, nothing written to disk:\n"
            f'# ds = open_dataset("{repo}", revision="{rev}", streaming=True)\n```\n\n'
            "`pip install hs-dataset` gives `open_dataset`; it downloads the version's files once (a download "
            "killed midway resumes), checks every shard against the xxh3-128 hashes below, maps the files "
            "where they are and checks each 1 MiB block's hash as it is read: opened again, nothing is downloaded. "
            "Plain `datasets` works too: "
            f'`load_dataset("{repo}", revision="{rev}", split="train")`, but it takes about twice the version\'s size on '
            "disk (the hub cache, and the Arrow conversion in the `datasets` cache), and `with_format(\"torch\")` gives "
            "int64 copies of the stored bits, not bf16 (decode them as below); it checks none of the xxh3-128 "
            "hashes below.\n\n"
            "Each published version is a git tag of this repository; `main` holds the newest version.\n"
            "Pin a `revision` for training runs that must be reproducible.")
