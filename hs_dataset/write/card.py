"""README.md rendering: the YAML front matter that makes plain ``load_dataset`` work, and the card.

One renderer for both uses: :func:`render_readme` writes a build's README.md (front matter from
:func:`readme_header` + the card of the local build); :func:`render_card` renders the card of a
published version, keeping the front matter the build wrote byte for byte (its ``configs:`` block is
what makes ``load_dataset(repo)`` find the shards, ``dataset_info:`` carries the features) and
adding the publication history. The body comes from ``cards/dataset_card.md`` (a
:class:`string.Template`) filled with provenance read from ``hs_dataset.json``.

The history is also embedded as a JSON HTML comment (invisible on the Hub), so the next push can
carry it forward: see :func:`parse_history`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import string
from pathlib import Path
from typing import Any

import yaml

from hs_dataset.write.card_quality import quality_section
from hs_dataset.write.card_text import cell, code, decode_snippet, load_snippet
from hs_dataset.write.shard_sizing import many_nodes_section
from hs_dataset.errors import MissingPathError
from hs_dataset.capture.layer_ids import drafter_layer_ids
from hs_dataset.layout import FINAL_COLUMN, escape_controls, layer_column, utf8_safe
from hs_dataset.records import Counts

__all__ = ["checksums_section", "content_id", "layer_ids_section", "parse_history", "readme_header", "render_card",
           "render_readme", "split_readme"]

TEMPLATE_ENV = "HS_DATASET_CARD_TEMPLATE"
# cards/dataset_card.md in a checkout; the same file (a symlink, copied into wheels) when installed.
DEFAULT_TEMPLATE = Path(__file__).resolve().parent / "templates" / "dataset_card.md"
HISTORY_MARKER = "hs_dataset:publish_history"
_HISTORY_RE = re.compile(r"<!--\s*" + re.escape(HISTORY_MARKER) + r"\s*(.*?)\s*-->", re.S)
_YAML_HEADER_RE = re.compile(r"\A---[ \t]*\r?\n(.*?\r?\n)?---[ \t]*(?:\r?\n|\Z)", re.S)


def split_readme(readme: str) -> tuple[str, str]:
    """-> (yaml header including both ``---`` lines, or "", body)."""
    match = _YAML_HEADER_RE.match(readme)
    if not match:
        return "", readme
    return match.group(0), readme[match.end():]


def content_id(metadata: dict) -> str:
    """``hs_dataset build <hex>`` of the shards' names and hashes: in ``configs:``, which ``datasets`` keys a
    folder's cache by (a new build in the same folder is never read from the old one's cache)."""
    h = hashlib.sha256()
    for f in metadata.get("shards") or []:
        h.update(f"{f.get('name')}\0{f.get('xxh3_128')}\0".encode())
    return f"hs_dataset build {h.hexdigest()[:16]}"


def readme_header(metadata: dict, num_examples: int, num_bytes: int, file_format: str) -> str:
    """The README front matter that lets plain ``load_dataset(dir_or_repo)`` load the shards: ``configs:``,
    and ``dataset_info:`` (features, split size) when ``metadata`` (a build's ``hs_dataset.json``)
    names the model and layers."""
    front: dict[str, Any] = {}
    config = metadata.get("config") or {}
    if "license" in config:  # builds made before the field existed have none (their cards still verify)
        front["license"] = str(config["license"])
    front |= {
        "configs": [{"config_name": "default",
                     "data_files": [{"split": "train", "path": f"data/train-*.{file_format}"}]}],
    }
    if metadata.get("shards"):
        front["configs"][0]["description"] = content_id(metadata)
    model = metadata.get("model") or {}
    if "hidden_size" in model and "layers" in metadata:
        import datasets  # deferred: only the front matter's schema needs datasets (and torch)
        from hs_dataset.codec.encode import make_features  # deferred: as datasets
        from hs_dataset.prepare.tags import tag_dtypes  # deferred: as datasets

        features = make_features(tuple(metadata["layers"]), int(model["hidden_size"]),
                                 metadata.get("storage_dtype", "bfloat16"),
                                 messages=(metadata.get("config") or {}).get("responses") == "regenerate",
                                 long_rows=bool(metadata.get("long_rows")),
                                 teacher_k=int((metadata.get("teacher") or {}).get("k", 0)),
                                 store_final=metadata.get("store_final", True) is not False,
                                 tags=tag_dtypes(metadata.get("config") or {}))
        info = datasets.DatasetInfo(features=features)
        info.splits = datasets.SplitDict()
        info.splits.add(datasets.SplitInfo(name="train", num_bytes=num_bytes, num_examples=num_examples))
        front["dataset_info"] = info._to_yaml_dict()
    front["tags"] = ["hidden-states", "eagle3", "speculative-decoding"]
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n"


def render_readme(metadata: dict, output_dir: str) -> str:
    """A finished build's README.md: front matter + the card of the local (unpublished) build."""
    return render_card(metadata, {"local_dir": output_dir})  # no readme given: the header is made from metadata


def parse_history(readme: str) -> list[dict]:
    """Publication history embedded in a card rendered by :func:`render_card` ([] if none)."""
    match = _HISTORY_RE.search(readme or "")
    if not match:
        return []
    try:
        data = json.loads(match.group(1))
    except ValueError:
        return []
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def human_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "n/a"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(n)} bytes" if unit == "B" else f"{size:.2f} {unit} ({int(n)} bytes)"
        size /= 1024
    return str(n)


def _responses(config: dict) -> str:
    """How the assistant replies came about (the ``responses`` and ``generation`` fields)."""
    if config.get("responses") != "regenerate":
        return "from the source"
    return "regenerated by the target model, generation `" + code(json.dumps(config.get("generation") or {},
                                                                              sort_keys=True)) + "`"


def checksums_section(metadata: dict, repo_id: str | None, version: str) -> str:
    """Every shard's rows, bytes and xxh3-128 (from ``hs_dataset.json``'s ``shards``), and how to verify."""
    shards = metadata.get("shards")
    if not isinstance(shards, list) or not shards:
        return "n/a: this build records no shard checksums."
    target = f"{code(repo_id)} --revision {code(version)}" if repo_id else "DIR"
    rows = ["| shard | rows | bytes | xxh3-128 |", "|---|---|---|---|"]
    rows += [f"| `{code(s.get('name'))}` | {cell(s.get('rows'))} | {cell(s.get('bytes'))} | `{code(s.get('xxh3_128'))}` |"
             for s in shards if isinstance(s, dict)]
    return (f"Each shard's rows, size and xxh3-128 content hash, as recorded when it was written (also in "
            f"`hs_dataset.json`, under `shards`). Check a copy with `hs-dataset verify {target}`.\n\n"
            f"<details><summary>{len(shards)} shards</summary>\n\n" + "\n".join(rows) + "\n\n</details>")


def layer_ids_section(metadata: dict) -> str:
    """The drafter config's layer ids for the captured layers, per engine and trainer
    (:func:`hs_dataset.capture.layer_ids.drafter_layer_ids`): each counts the layers differently."""
    model = metadata.get("model") or {}
    layers = metadata.get("layers") or []
    if not layers or "architecture" not in model or "num_layers" not in model:
        return "n/a: this build does not record its model's architecture and depth."
    ids = drafter_layer_ids(str(model["architecture"]), int(model["num_layers"]), layers)
    sglang = ids["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    rows = [("vLLM, speculators (`--target-layer-ids`)", "`eagle_aux_hidden_state_layer_ids`",
             ids["vllm"]["eagle_aux_hidden_state_layer_ids"], ids["vllm"]["rule"]),
            ("SGLang", "`eagle_config.eagle_aux_hidden_state_layer_ids`", sglang, ids["sglang"]["rule"]),
            ("SpecForge", "`aux_hidden_state_layer_ids`", sglang, ids["specforge"]["rule"]),
            ("ModelOpt", "`eagle_aux_hidden_state_layer_ids`", ids["modelopt"]["eagle_aux_hidden_state_layer_ids"],
             ids["modelopt"]["rule"])]
    table = ["| engine / trainer | drafter config key | ids | rule |", "|---|---|---|---|"]
    table += [f"| {who} | {key} | {'none' if v is None else '`' + code(json.dumps(v)) + '`'} | {cell(rule)} |"
              for who, key, v, rule in rows]
    return (f"The stored layers {cell(layers)} (hs_dataset's convention: layer k is the output of decoder layer "
            "k) are these ids in a drafter's config:\n\n" + "\n".join(table))


def _history_table(history: list[dict], tags: dict[str, str], current_version: str) -> str:
    rows = ["| version | commit | pushed (UTC) | notes |", "|---|---|---|---|"]
    for entry in history:
        version = entry.get("version", "?")
        if version == current_version and entry is history[-1]:
            commit = "this commit"
        else:
            commit = entry.get("commit") or tags.get(version) or "n/a"
            commit = f"`{code(commit)}`" if commit != "n/a" else commit
        notes = []
        if entry.get("force"):
            prev = entry.get("previous_commit")
            notes.append(f"force-pushed, replaced `{code(prev)}`" if prev else "force-pushed")
        if entry.get("note"):
            notes.append(cell(entry["note"]))
        rows.append(f"| `{code(version)}` | {commit} | {cell(entry.get('pushed_at'))} | {'; '.join(notes) or ''} |")
    return "\n".join(rows)


def _bytes_per_token(metadata: dict) -> str:
    """This build's bytes per token, and what the other storage options would take for its tokens."""
    from hs_dataset.codec.sizes import storage_options  # deferred: keeps the card's imports light

    counts, model = metadata.get("counts") or {}, metadata.get("model") or {}
    tokens = int(counts.get("tokens_written") or 0)
    if not tokens or "hidden_size" not in model:
        return "n/a"
    mine = int(metadata.get("bytes", 0)) / tokens
    n_states = len(metadata.get("layers") or []) + 1
    masked = float(metadata.get("masked_fraction") or 0.8)
    others = "; ".join(f"{name} {b:,.0f} B/token ({human_bytes(b * tokens).split(' (')[0]})"
                       for name, b in storage_options(n_states, int(model["hidden_size"]), masked_fraction=masked))
    return f"{mine:,.0f} B/token as built (shards, framing included); uncoded options for these tokens: {others}"


def render_card(metadata: dict, extra: dict) -> str:
    """Render the README.md published with a dataset version.

    ``metadata``: the build's ``hs_dataset.json``.
    ``extra`` (all optional): ``readme`` (the build's README.md text, whose YAML header is kept
    verbatim), ``repo_id``, ``version``, ``pushed_at`` (ISO UTC), ``build_command`` (overrides
    metadata's), ``history`` (list of ``{version, commit, pushed_at, force, previous_commit}``,
    oldest first, the entry for this version last), ``tags`` ({tag: commit} for the table),
    ``template`` (template text; default ``cards/dataset_card.md`` or ``$HS_DATASET_CARD_TEMPLATE``).
    """
    header, _ = split_readme(extra.get("readme") or "")
    if not header:
        counts = metadata.get("counts") or {}
        header = readme_header(metadata, Counts.rows_of(counts), int(metadata.get("bytes", 0)),
                               (metadata.get("config") or {}).get("file_format", "arrow"))
    if not header.endswith("\n"):
        header += "\n"
    template_text = extra.get("template")
    if template_text is None:
        template_path = Path(os.environ.get(TEMPLATE_ENV) or DEFAULT_TEMPLATE)
        if not template_path.is_file():
            raise MissingPathError(f"dataset card template not found at {template_path}; set ${TEMPLATE_ENV} or pass "
                                   "extra['template']", path=str(template_path))
        template_text = template_path.read_text(encoding="utf-8")

    model = metadata.get("model") or {}
    tokenizer = metadata.get("tokenizer") or {}
    counts = metadata.get("counts") or {}
    backend = metadata.get("backend") or {}
    layers = metadata.get("layers") or []
    columns = metadata.get("columns") or []
    hidden_columns = [c for c in columns if "hidden" in str(c)] or [layer_column(k) for k in layers] + [FINAL_COLUMN]
    storage_dtype = str(metadata.get("storage_dtype") or "bfloat16")
    version = str(extra.get("version") or "unpublished")
    repo_id = str(extra.get("repo_id") or extra.get("local_dir") or "local build")
    history = list(extra.get("history") or [])
    tags = dict(extra.get("tags") or {})
    build_command = extra.get("build_command") or metadata.get("build_command") or "n/a"
    build_command = escape_controls(str(build_command).replace("~~~~", "~ ~ ~ ~"))

    versions = backend.get("versions") or {}
    versions_table = "\n".join(
        ["| package | version |", "|---|---|"] + [f"| {cell(k)} | `{code(v)}` |" for k, v in sorted(versions.items())]
    ) if versions else "n/a"
    forced = [e for e in history if e.get("force")]
    force_note = ""
    if forced:
        lines = ["", "**Force-pushed versions.** These tags were moved to new commits; the commits they pointed "
                     "at before are listed so that earlier downloads can be identified:", ""]
        for e in forced:
            lines.append(f"- `{code(e.get('version'))}` force-pushed at {cell(e.get('pushed_at'))}, previous commit "
                         f"`{code(e.get('previous_commit'))}`")
        force_note = "\n".join(lines) + "\n"

    values = {
        "title": cell(extra.get("title") or f"{repo_id} ({version})"),
        "load_section": load_snippet(extra.get("repo_id"), version, extra.get("local_dir")),
        "repo_id": code(repo_id),
        "version": code(version),
        **{f"model_{k}": code(model.get(k)) for k in ("path", "revision")},
        "architecture": code(model.get("architecture")),
        **{k: cell(model.get(k)) for k in ("hidden_size", "num_layers")},
        "layers": cell(layers),
        "storage_dtype": code(storage_dtype),
        "stored_as": cell(metadata.get("stored_as") or "uint16 bits"),
        "hidden_columns": ", ".join(f"`{code(c)}`" for c in hidden_columns) or "n/a",
        "decode_snippet": decode_snippet(storage_dtype, hidden_columns[0] if hidden_columns else "hidden",
                                         model.get("hidden_size")),
        "decode_helper": code(metadata.get("decode")),
        **{f"tokenizer_{k}": code(tokenizer.get(k)) for k in ("path", "class")},
        "token_offsets": cell(tokenizer.get("token_offsets")),
        "trust_remote_code": cell({True: "yes", False: "no"}.get(bool(tokenizer["trust_remote_code"]))
                                   if "trust_remote_code" in tokenizer else None),
        "chat_template_sha256": code(tokenizer.get("chat_template_sha256")),
        "source": code(metadata.get("source")),
        **{k: cell(metadata.get(k)) for k in ("layer_convention", "max_length", "sample_ids", "format_version")},
        "license": code((metadata.get("config") or {}).get("license", "not recorded")),
        "layer_ids": layer_ids_section(metadata),
        "responses": _responses(metadata.get("config") or {}),
        "samples_in": cell(counts.get("samples_in")),
        "samples_written": cell(counts.get("written")),
        "samples_rejected": cell(counts.get("rejected")),
        "tokens_written": cell(counts.get("tokens_written")),
        "data_bytes": human_bytes(metadata.get("bytes")),
        "bytes_per_token": _bytes_per_token(metadata),
        "backend_name": cell(backend.get("name")),
        "versions_table": versions_table,
        "columns": ", ".join(f"`{code(c)}`" for c in columns) or "n/a",
        "checksums": checksums_section(metadata, extra.get("repo_id"), version),
        "build_command": build_command,
        "history_table": _history_table(history, tags, version) if history else "n/a",
        "force_note": force_note,
        "quality": quality_section(metadata),
        "many_nodes": many_nodes_section(metadata, extra.get("repo_id"), version),
    }
    if "quality}" not in template_text and "$quality" not in template_text:  # an older custom template
        template_text = template_text.rstrip() + "\n\n${quality}\n"
    body = string.Template(template_text).safe_substitute(values)
    history_json = json.dumps(history, sort_keys=True).replace("--", "\\u002d\\u002d")
    return utf8_safe(f"{header}\n{body.rstrip()}\n\n<!-- {HISTORY_MARKER} {history_json} -->\n")

