"""``hs-dataset export`` and ``hs-dataset import``: SpecForge, speculators and ModelOpt layouts."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from hs_dataset.cli.build import add_reject_rate_arg
from hs_dataset.cli.options import add_progress_arg, layers_arg
from hs_dataset.cli.render import print_rejects
from hs_dataset.errors import ConfigError, RejectRateError
from hs_dataset.layout import FILE_FORMATS, REJECTS_FILE, STORAGE_DTYPES
from hs_dataset.write.rejects import read_rejects

__all__ = ["cmd_export", "cmd_import", "register"]

FORMATS = ("specforge", "speculators", "modelopt")


def cmd_export(a: argparse.Namespace) -> int:
    from hs_dataset.interop import LAYER_IDS_FILE, export_dataset  # deferred: imports torch, datasets

    s = export_dataset(a.dir, a.to, a.out, layers=layers_arg(a.layers), group_size=a.group_size)
    print(f"exported {s.samples} samples to {s.output_dir} ({a.to} layout): {s.files} files, "
          f"{s.bytes_written / 2**20:.1f} MiB in {s.seconds:.1f}s")
    if a.to == "modelopt":
        print("ModelOpt reads the exported loss_mask only with answer_only_loss=True (its training.answer_only_loss); "
              "by default it trains on every token")
    ids = s.layer_ids
    print(f"drafter layer ids ({Path(s.output_dir) / LAYER_IDS_FILE}): vLLM "
          f"{ids['vllm']['eagle_aux_hidden_state_layer_ids']}, SGLang "
          f"{ids['sglang']['eagle_config']['eagle_aux_hidden_state_layer_ids']}")
    for w in s.warnings:
        print(f"warning: {w}")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    from hs_dataset.interop import import_dataset  # deferred: imports torch, datasets

    opts = [("--model", a.model), ("--layers", a.layers), ("--storage-dtype", a.storage_dtype),
            ("--file-format", a.file_format), ("--pad-id", a.pad_id if a.pad_id != "0" else None)]
    command = " ".join(["hs-dataset", "import", shlex.quote(a.src), "--from", a.from_, shlex.quote(a.out)]
                       + [f"{k} {shlex.quote(v)}" for k, v in opts if v is not None]
                       + ["--final-prenorm"] * a.final_prenorm + ["--trust-remote-code"] * a.trust_remote_code
                       + ["--skip-model-check"] * a.skip_model_check)
    try:
        pad_id = None if str(a.pad_id).lower() == "none" else int(a.pad_id)
    except ValueError:
        raise ConfigError(f"--pad-id {a.pad_id!r}: expected a token id or 'none'") from None
    s = import_dataset(a.src, a.from_, a.out, model=a.model, layers=layers_arg(a.layers),
                       storage_dtype=a.storage_dtype, file_format=a.file_format, progress=not a.no_progress,
                       build_command=command, pad_id=pad_id, final_prenorm=True if a.final_prenorm else None,
                       trust_remote_code=a.trust_remote_code, check_model=not a.skip_model_check)
    print(f"imported {s.written} samples from {a.src} ({a.from_}) into {s.output_dir}: {s.rejected} rejected "
          f"(of {s.samples}), {s.bytes_written / 2**20:.1f} MiB in {s.seconds:.1f}s")
    for note in s.notes:
        print(note)
    if s.rejected:  # as hs-dataset build: too many rejects is an error, the rows written are kept
        too_many = s.rejected > a.max_reject_rate * s.samples
        print_rejects(read_rejects(a.out), s.samples, most=8 if too_many else 3,
                      file=sys.stderr if too_many else sys.stdout)
        if too_many:
            raise RejectRateError(
                f"{s.rejected} of {s.samples} files rejected ({s.rejected / s.samples:.0%}), more than "
                f"--max-reject-rate {a.max_reject_rate:g}: the import in {a.out} is kept (finished; {REJECTS_FILE} "
                f"lists every reject). Fix the files or the options (see the reasons above), or accept it: the "
                f"same command with --max-reject-rate {min(1.0, round(s.rejected / s.samples + 0.005, 2)):g}")
        print(f"rejected samples and reasons: {Path(a.out) / REJECTS_FILE}")
    return 0


def register(sub, common: argparse.ArgumentParser) -> None:
    e = sub.add_parser("export", parents=[common], help="write a built dataset in another tool's offline layout")
    e.add_argument("dir", help="a finished build directory")
    e.add_argument("--to", required=True, choices=FORMATS, help="target layout")
    e.add_argument("--layers", help="stored layers to write as the EAGLE-3 aux layers (default: all but L-1)")
    e.add_argument("out", help="new output directory")
    e.add_argument("--group-size", type=int, default=2000,
                   help="samples per rows_<a>-<b> folder (SpecForge's --file-group-size, default 2000)")
    e.set_defaults(fn=cmd_export)
    m = sub.add_parser("import", parents=[common],
                       help="make a build directory from SpecForge, speculators or ModelOpt hidden states")
    m.add_argument("src", help="SpecForge output dir (rows_*/data_*.ckpt), speculators' preprocessed-data dir "
                               "(with hidden_states/hs_*.safetensors) or legacy data_*.pt dir, "
                               "ModelOpt dump dir (*.pt)")
    m.add_argument("--from", dest="from_", required=True, choices=FORMATS)
    m.add_argument("out", help="output build directory (resumable)")
    m.add_argument("--model", help="the target model's directory (config.json, tokenizer, weights); default: the "
                                   "one recorded by hs-dataset export")
    m.add_argument("--layers", help="the files' layers in hs_dataset's convention (output of decoder layer k), e.g. "
                                    "1,29,57 (ending with L-1 where the last entry is before the final norm); "
                                    "default: recorded by the export / data_config.json, else the format's default")
    m.add_argument("--pad-id", default="0", help="SpecForge: strip trailing tokens with this id outside the loss "
                                                 "mask (its batch padding; 'none' keeps them)")
    m.add_argument("--final-prenorm", action="store_true",
                   help="ModelOpt: hidden_states is before the final norm (its vLLM dumps do not say so)")
    m.add_argument("--skip-model-check", action="store_true",
                   help="do not recompute a few samples with --model on the CPU to check that it made the files "
                        "(for a model too large to run there; only the cheap checks run)")
    add_reject_rate_arg(m, "files are rejected", "the import is kept, as hs-dataset build")
    m.add_argument("--storage-dtype", default="bfloat16", choices=STORAGE_DTYPES)
    m.add_argument("--file-format", default="arrow", choices=FILE_FORMATS)
    m.add_argument("--trust-remote-code", action="store_true",
                   help="the model's tokenizer is its own Python code (Kimi-K2.5's tiktoken tokenizer)")
    add_progress_arg(m)
    m.set_defaults(fn=cmd_import)
