"""``hs-dataset``: build, inspect, push and list versions of hidden-state datasets.

    hs-dataset build builder_scripts/tiny_demo.py --output demo_out [--set key=value ...]
    hs-dataset build ... --num-shards N|auto [--shard-index I]    (one worker of many; or --ray [ADDRESS])
    hs-dataset merge demo_out [SHARD_DIR ...]                      (the shards into one build)
    hs-dataset inspect demo_out
    hs-dataset push demo_out org/name --version v1.0
    hs-dataset versions org/name
    hs-dataset verify demo_out [--quick]          (or: hs-dataset verify org/name --revision v1.0)
    hs-dataset export demo_out --to specforge|speculators|modelopt out [--layers 1,29,57]
    hs-dataset import out --from specforge|speculators|modelopt demo_back [--model DIR] [--layers 1,29,57]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from .layout import DATA_DIR, META_FILE
from .scaleout import add_build_args, scaleout_build, wants_scaleout


def parse_value(text: str) -> Any:
    """``--set`` values are JSON when they parse as JSON (numbers, lists, null, true), else strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_sets(config: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` overrides; ``a.b=value`` sets a nested key (e.g. backend_options.tp_size=8)."""
    for item in sets:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: expected key=value")
        key, value = item.split("=", 1)
        target = config
        *parents, leaf = key.strip().split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[leaf] = parse_value(value)
    return config


def load_preset(path: str, sets: list[str]) -> dict[str, Any]:
    """Load a builder script (``CONFIG`` dict, optional ``prepare(config)``), apply overrides, prepare."""
    spec = importlib.util.spec_from_file_location(f"hs_preset_{Path(path).stem}", path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise SystemExit(f"builder script {path!r} not found")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not isinstance(getattr(mod, "CONFIG", None), dict):
        raise SystemExit(f"{path} defines no CONFIG dict")
    config = apply_sets(json.loads(json.dumps(mod.CONFIG)), sets)
    if hasattr(mod, "prepare"):
        mod.prepare(config)
    return config


class _SetField(argparse.Action):
    """An option that stands for ``--set <field>=<value>`` (applied in command-line order)."""

    def __init__(self, option_strings, dest, field: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.field = field

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        items.append(f"{self.field}={values}")
        setattr(namespace, self.dest, items)


def cmd_build(a: argparse.Namespace) -> int:
    from .shard_writer import build
    from .dataset_builder import HiddenStatesConfig

    config = HiddenStatesConfig(**load_preset(a.script, a.set))
    command = "hs-dataset " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    if wants_scaleout(a):  # --num-shards / --shard-index / --ray: hs_dataset.scaleout
        if not scaleout_build(a, config, command):
            return 0  # this worker's shard is built; the worker of the last shard merges (and pushes)
    else:
        s = build(config, a.output, progress=not a.no_progress, build_command=command)
        c = s.counts
        print(f"built {s.output_dir}: {c.written} samples written, {c.rejected} rejected (of {c.samples_in}), "
              f"{c.tokens_written} tokens, {s.bytes_written / 2**20:.1f} MiB in {s.seconds:.1f}s "
              f"({s.parts_built} parts built, {s.parts_skipped} already done)")
        if c.rejected:
            print(f"rejected samples and reasons: {Path(a.output) / 'rejects.jsonl'}")
    if a.push:
        from .publish import push_dataset

        if not a.version:
            raise SystemExit("--push needs --version (e.g. --version v1.0)")
        r = push_dataset(a.output, a.push, a.version, force=a.force)
        print(r)
    return 0


def cmd_merge(a: argparse.Namespace) -> int:
    from .errors import HsDatasetError
    from .merge import merge_shards

    try:
        print(merge_shards(a.out, a.shards or None, full=a.full).message())
    except HsDatasetError as e:  # a shard missing, unfinished, odd; one still being built; OUT of another build
        raise SystemExit(f"hs-dataset merge: {e}") from None
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    import pyarrow as pa

    out = Path(a.dir)
    meta_path = out / META_FILE
    if not meta_path.exists():
        raise SystemExit(f"{out} is not a finished hs_dataset build (no {META_FILE})")
    meta = json.loads(meta_path.read_text())
    files = sorted((out / DATA_DIR).glob("train-*"))
    print(f"dataset:   {out}")
    print(f"model:     {meta['model']['architecture']} ({meta['model']['path']}), hidden {meta['model']['hidden_size']}, "
          f"{meta['model']['num_layers']} layers")
    print(f"layers:    {meta['layers']} + final   ({meta['layer_convention']})")
    print(f"dtype:     {meta['storage_dtype']} stored as {meta['stored_as']}")
    c = meta["counts"]
    print(f"samples:   {c['written']} written, {c['rejected']} rejected, {c['samples_in']} in; {c['tokens_written']} tokens")
    print(f"files:     {len(files)} shards, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB")
    if c["tokens_written"]:
        print(f"bytes/token: {meta['bytes'] / c['tokens_written']:.1f}")
    print(f"backend:   {meta['backend']['name']} {meta['backend'].get('versions', {})}")
    if files and files[0].suffix == ".arrow":
        with pa.memory_map(str(files[0])) as src:
            print("schema:\n" + str(pa.ipc.open_stream(src).schema.remove_metadata()))
    return 0


def cmd_push(a: argparse.Namespace) -> int:
    from .publish import push_dataset

    print(push_dataset(a.dir, a.repo_id, a.version, force=a.force))
    return 0


def cmd_versions(a: argparse.Namespace) -> int:
    from .publish import list_versions

    for v in list_versions(a.repo_id):
        print(v)
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from .verify import verify_build, verify_repo

    if Path(a.target).is_dir() and a.revision is None:
        report = verify_build(a.target, quick=a.quick)
    else:
        report = verify_repo(a.target, revision=a.revision, quick=a.quick)
    print(report.message())
    return 0 if report.ok else 1


def _layers_arg(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    v = parse_value(text)
    items = v if isinstance(v, list) else [x for x in str(v).replace(",", " ").split() if x]
    try:
        return tuple(int(x) for x in items)
    except (TypeError, ValueError):
        raise SystemExit(f"--layers {text!r}: expected layer ids, e.g. 1,29,57 or [1,29,57]") from None


def cmd_export(a: argparse.Namespace) -> int:
    from .interop import LAYER_IDS_FILE, InteropError, export_dataset

    try:
        s = export_dataset(a.dir, a.to, a.out, layers=_layers_arg(a.layers), group_size=a.group_size)
    except InteropError as e:
        raise SystemExit(f"hs-dataset export: {e}") from None
    print(f"exported {s.samples} samples to {s.output_dir} ({a.to} layout): {s.files} files, "
          f"{s.bytes_written / 2**20:.1f} MiB in {s.seconds:.1f}s")
    ids = s.layer_ids
    print(f"drafter layer ids ({Path(s.output_dir) / LAYER_IDS_FILE}): vLLM "
          f"{ids['vllm']['eagle_aux_hidden_state_layer_ids']}, SGLang "
          f"{ids['sglang']['eagle_config']['eagle_aux_hidden_state_layer_ids']}")
    for w in s.warnings:
        print(f"warning: {w}")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    from .interop import InteropError, import_dataset

    opts = [("--model", a.model), ("--layers", a.layers), ("--storage-dtype", a.storage_dtype),
            ("--file-format", a.file_format), ("--pad-id", a.pad_id if a.pad_id != "0" else None)]
    command = " ".join(["hs-dataset", "import", shlex.quote(a.src), "--from", a.from_, shlex.quote(a.out)]
                       + [f"{k} {shlex.quote(v)}" for k, v in opts if v is not None]
                       + ["--final-prenorm"] * a.final_prenorm + ["--trust-remote-code"] * a.trust_remote_code)
    try:
        pad_id = None if str(a.pad_id).lower() == "none" else int(a.pad_id)
    except ValueError:
        raise SystemExit(f"--pad-id {a.pad_id!r}: expected a token id or 'none'") from None
    try:
        s = import_dataset(a.src, a.from_, a.out, model=a.model, layers=_layers_arg(a.layers),
                           storage_dtype=a.storage_dtype, file_format=a.file_format, progress=not a.no_progress,
                           build_command=command, pad_id=pad_id, final_prenorm=True if a.final_prenorm else None,
                           trust_remote_code=a.trust_remote_code)
    except InteropError as e:
        raise SystemExit(f"hs-dataset import: {e}") from None
    print(f"imported {s.written} samples from {a.src} ({a.from_}) into {s.output_dir}: {s.rejected} rejected "
          f"(of {s.samples}), {s.bytes_written / 2**20:.1f} MiB in {s.seconds:.1f}s")
    for note in s.notes:
        print(note)
    if s.rejected:
        print(f"rejected samples and reasons: {Path(a.out) / 'rejects.jsonl'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hs-dataset", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or resume) a dataset from a builder script")
    b.add_argument("script", help="builder script, e.g. builder_scripts/tiny_demo.py")
    b.add_argument("--output", "-o", required=True, help="output directory (resumable)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--on-nonfinite", choices=("fail", "reject"), action=_SetField, dest="set", field="on_nonfinite",
                   help="NaN/Inf in a captured state: stop the build naming the sample and layer (fail, the "
                        "default), or write the sample to rejects.jsonl and go on (reject)")
    b.add_argument("--push", metavar="ORG/NAME", help="push to the Hub when the build is done")
    b.add_argument("--version", help="version tag for --push, e.g. v1.0")
    b.add_argument("--force", action="store_true", help="with --push: replace an existing version")
    add_build_args(b)
    b.set_defaults(fn=cmd_build)
    g = sub.add_parser("merge", help="merge the shards of a build made by many workers into one finished build")
    g.add_argument("out", help="the output directory of the sharded build (--output of its workers)")
    g.add_argument("shards", nargs="*", metavar="SHARD_DIR",
                   help="shard builds to merge (default: every one in OUT/.hs_build/shards/)")
    g.add_argument("--full", action="store_true", help="check every shard file's whole content hash (default: "
                                                       "size, first/last MiB and rows; push checks the hashes)")
    g.set_defaults(fn=cmd_merge)
    i = sub.add_parser("inspect", help="schema, counts, layers, dtype and sizes of a built dataset")
    i.add_argument("dir")
    i.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("push", help="upload a built dataset to the Hub as a tagged version")
    p.add_argument("dir")
    p.add_argument("repo_id")
    p.add_argument("--version", required=True)
    p.add_argument("--force", action="store_true", help="replace an existing version (recorded in the card)")
    p.set_defaults(fn=cmd_push)
    v = sub.add_parser("versions", help="list the versions of a dataset repo with their counts")
    v.add_argument("repo_id")
    v.set_defaults(fn=cmd_versions)
    c = sub.add_parser("verify", help="check every shard of a build, or of a published version, against its "
                                      "recorded size, rows and content hash (exit 1 naming the parts to rebuild)")
    c.add_argument("target", help="a build directory, or a dataset repo id (org/name)")
    c.add_argument("--revision", help="with a repo id: the version to download and check (default: main)")
    c.add_argument("--quick", action="store_true", help="size, first/last MiB and rows only (a repo: the Hub's file "
                                                        "list and sizes, nothing downloaded)")
    c.set_defaults(fn=cmd_verify)
    e = sub.add_parser("export", help="write a built dataset in another tool's offline layout")
    e.add_argument("dir", help="a finished build directory")
    e.add_argument("--to", required=True, choices=("specforge", "speculators", "modelopt"), help="target layout")
    e.add_argument("--layers", help="stored layers to write as the EAGLE-3 aux layers (default: all but L-1)")
    e.add_argument("out", help="new output directory")
    e.add_argument("--group-size", type=int, default=2000,
                   help="samples per rows_<a>-<b> folder (SpecForge's --file-group-size, default 2000)")
    e.set_defaults(fn=cmd_export)
    m = sub.add_parser("import", help="make a build directory from SpecForge, speculators or ModelOpt hidden states")
    m.add_argument("src", help="SpecForge output dir (rows_*/data_*.ckpt), speculators' preprocessed-data dir "
                               "(with hidden_states/hs_*.safetensors) or legacy data_*.pt dir, "
                               "ModelOpt dump dir (*.pt)")
    m.add_argument("--from", dest="from_", required=True, choices=("specforge", "speculators", "modelopt"))
    m.add_argument("out", help="output build directory (resumable)")
    m.add_argument("--model", help="the target model's directory (config.json + tokenizer); default: the one "
                                   "recorded by hs-dataset export")
    m.add_argument("--layers", help="the files' layers in hs_dataset's convention (output of decoder layer k), e.g. "
                                    "1,29,57 (ending with L-1 where the last entry is before the final norm); "
                                    "default: recorded by the export / data_config.json, else the format's default")
    m.add_argument("--pad-id", default="0", help="SpecForge: strip trailing tokens with this id outside the loss "
                                                 "mask (its batch padding; 'none' keeps them)")
    m.add_argument("--final-prenorm", action="store_true",
                   help="ModelOpt: hidden_states is before the final norm (its vLLM dumps do not say so)")
    m.add_argument("--storage-dtype", default="bfloat16", choices=("bfloat16", "fp8_e4m3"))
    m.add_argument("--file-format", default="arrow", choices=("arrow", "parquet"))
    m.add_argument("--trust-remote-code", action="store_true",
                   help="the model's tokenizer is its own Python code (Kimi-K2.5's tiktoken tokenizer)")
    m.add_argument("--no-progress", action="store_true")
    m.set_defaults(fn=cmd_import)
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
