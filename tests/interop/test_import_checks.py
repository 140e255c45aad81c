"""Imports under attack (issue 27, finding 10): a ModelOpt folder mixing pre- and post-norm dumps, a
folder of another tool's files, most files rejected, a wrong --model of the same shapes, and what
ModelOpt does with the exported loss_mask. Each test failed before its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hs_dataset.cli import main as cli
from hs_dataset.demo.tiny import make_tiny_tokenizer
from hs_dataset.errors import InteropError
from hs_dataset.interop import export_dataset, export_modelopt, import_dataset, specforge_file
from hs_dataset.model_info import read_model_info
from tests.fixtures.builds import ROOT
from tests.fixtures.interop import LAYERS, PRE_LAYERS, assert_same_rows, rows
from tests.gpu.models import make_dsv3  # the GPU tests' maker, run here on the CPU


def _one_short_line(message: str, most: int = 400) -> None:
    assert "\n" not in message.strip() and len(message) <= most, (len(message), message[:600])


def _modelopt_dump(r: dict, path: Path, final_col: str, aux: tuple[int, ...], prenorm: bool | None) -> None:
    """compute_hidden_states_hf.py's dict (``hidden_states_prenorm`` as its vLLM-aware dumper sets it)."""
    d = {"input_ids": r["input_ids"].long(), "hidden_states": r[final_col].clone(),
         "aux_hidden_states": torch.cat([r[f"hidden_layer_{k}"] for k in aux], dim=-1),
         "loss_mask": r["loss_mask"].long(), "conversation_id": path.stem}
    if prenorm is not None:
        d["hidden_states_prenorm"] = prenorm
    torch.save(d, path)


def test_a_modelopt_folder_mixing_pre_and_post_norm_dumps_is_refused(interop_pre_ds, tiny_norm_model, tmp_path,
                                                                     capsys):
    src = rows(interop_pre_ds)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for i in range(3):  # post-norm, first in sorted order: it used to decide for the whole folder
        _modelopt_dump(src[i], mixed / f"a-{i}.pt", "hidden_final", (0, 1), None)
    for i in range(32):
        _modelopt_dump(src[i % 12], mixed / f"b-{i:02d}.pt", "hidden_layer_3", (0, 1), True)
    # no --layers: ModelOpt's default sorted({1, L//2-1, L-4}) = (0, 1) on 4 layers (+ L-1 when pre-norm) fits both
    with pytest.raises(InteropError) as e:
        import_dataset(mixed, "modelopt", tmp_path / "x", model=tiny_norm_model)
    msg = str(e.value)
    assert "32 pre-norm and 3 post-norm" in msg and "a-0.pt, a-1.pt, a-2.pt" in msg and "own folder" in msg
    _one_short_line(msg)
    assert not (tmp_path / "x").exists()  # refused before anything is written
    assert cli(["import", str(mixed), "--from", "modelopt", str(tmp_path / "y"), "--model", tiny_norm_model,
                "--no-progress"]) == 2
    assert "32 pre-norm and 3 post-norm" in capsys.readouterr().err
    # one kind throughout imports as before
    for i in range(3):
        (mixed / f"a-{i}.pt").unlink()
    s = import_dataset(mixed, "modelopt", tmp_path / "z", model=tiny_norm_model)
    assert (s.written, s.rejected) == (32, 0)
    assert json.loads((tmp_path / "z" / "hs_dataset.json").read_text())["layers"] == list(PRE_LAYERS)


def test_a_modelopt_folder_given_to_speculators_is_named(interop_ds, tiny_model, tmp_path):
    export_modelopt(interop_ds, tmp_path / "mo")
    with pytest.raises(InteropError) as e:
        import_dataset(tmp_path / "mo", "speculators", tmp_path / "x", model=tiny_model, layers=(0, 1, 3))
    assert "looks like a ModelOpt dump" in str(e.value) and "use --from modelopt" in str(e.value)
    _one_short_line(str(e.value))
    # the other way round: speculators' legacy data_<i>.pt given to --from modelopt
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for i, r in enumerate(rows(interop_ds)[:2]):
        torch.save({"input_ids": r["input_ids"].long(), "loss_mask": r["loss_mask"].long(),
                    "hidden_states": [r[f"hidden_layer_{k}"] for k in LAYERS]}, legacy / f"data_{i}.pt")
    with pytest.raises(InteropError, match="use --from speculators"):
        import_dataset(legacy, "modelopt", tmp_path / "y", model=tiny_model, layers=LAYERS)


def test_a_listing_in_an_error_is_capped(tiny_model, tmp_path):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save({"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.long),
                "hidden_states": [torch.zeros(n + 1, 64, dtype=torch.bfloat16) for n in range(300)]},
               legacy / "data_0.pt")
    with pytest.raises(InteropError) as e:
        import_dataset(legacy, "speculators", tmp_path / "x", model=tiny_model, layers=(0, 1, 3))
    msg = str(e.value)
    assert "300 states of shapes (1, 64), (2, 64), (3, 64) and 297 more" in msg
    _one_short_line(msg)


def test_import_fails_when_more_files_are_rejected_than_the_rate(interop_ds, tmp_path, capsys):
    sf = tmp_path / "sf"
    export_dataset(interop_ds, "specforge", sf)
    for i in (2, 5, 9):
        specforge_file(sf, i).write_bytes(b"not a torch file")
    assert cli(["import", str(sf), "--from", "specforge", str(tmp_path / "back"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hs-dataset import: error: 3 of 12 files rejected (25%), more than --max-reject-rate 0.1")
    assert "--max-reject-rate 0.26" in last and "unreadable" in err  # the breakdown, then the one line
    assert len(rows(tmp_path / "back")) == 9  # the import's rows are kept
    assert cli(["import", str(sf), "--from", "specforge", str(tmp_path / "back"), "--no-progress",
                "--max-reject-rate", "0.3"]) == 0
    with pytest.raises(SystemExit) as e:  # argparse's own exit 2
        cli(["import", str(sf), "--from", "specforge", str(tmp_path / "c"), "--max-reject-rate", "2"])
    assert e.value.code == 2
    assert "a fraction of the samples" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_dsv3(tmp_path_factory, tiny_model) -> str:
    """A random DeepSeek-V3 (MLA + MoE) of the tiny Llama's shapes: hidden 64, 4 layers, its tokenizer."""
    out = tmp_path_factory.mktemp("dsv3")
    tok = make_tiny_tokenizer(out)
    make_dsv3(out, hidden=64, vocab=len(tok))
    return str(out)


def test_a_wrong_model_of_the_same_shapes_is_refused(interop_ds, tiny_model, tiny_dsv3, tmp_path, capsys):
    ours, theirs = read_model_info(tiny_model), read_model_info(tiny_dsv3)
    assert (ours.hidden_size, ours.num_layers) == (theirs.hidden_size, theirs.num_layers)  # every shape check passes
    assert theirs.architecture != ours.architecture
    export_modelopt(interop_ds, tmp_path / "mo")
    with pytest.raises(InteropError) as e:
        import_dataset(tmp_path / "mo", "modelopt", tmp_path / "x", model=tiny_dsv3, layers=LAYERS)
    msg = str(e.value)
    assert msg.startswith(f"sample {rows(interop_ds)[0]['id']}: hidden_layer_0 is not what {tiny_dsv3} computes")
    assert "--skip-model-check" in msg
    _one_short_line(msg)
    assert not (tmp_path / "x").exists()  # nothing written
    # the right model passes, and says what it checked
    s = import_dataset(tmp_path / "mo", "modelopt", tmp_path / "ok", model=tiny_model, layers=LAYERS)
    assert s.rejected == 0 and any(n.startswith("model check: 3 samples") for n in s.notes)
    meta = json.loads((tmp_path / "ok" / "hs_dataset.json").read_text())
    assert "every state matches" in meta["backend"]["options"]["model_check"]
    # the right model with the wrong layers: the neighbouring layer is not the same state
    with pytest.raises(InteropError, match="hidden_layer_1 is not what"):
        import_dataset(tmp_path / "mo", "modelopt", tmp_path / "y", model=tiny_model, layers=(1, 2, 3))
    # --skip-model-check: trusted, and said so
    assert cli(["import", str(tmp_path / "mo"), "--from", "modelopt", str(tmp_path / "skip"), "--model", tiny_dsv3,
                "--layers", "0,1,2", "--skip-model-check", "--no-progress"]) == 0
    assert "model check skipped (--skip-model-check)" in capsys.readouterr().out
    assert json.loads((tmp_path / "skip" / "hs_dataset.json").read_text())["build_command"].endswith(
        "--skip-model-check")


def test_a_model_check_needs_the_weights_or_the_skip(interop_ds, tiny_model, tmp_path):
    export_dataset(interop_ds, "specforge", tmp_path / "sf")
    config_only = tmp_path / "config_only"
    shutil.copytree(tiny_model, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(InteropError, match="has no weights.*--skip-model-check"):
        import_dataset(tmp_path / "sf", "specforge", tmp_path / "x", model=str(config_only))
    s = import_dataset(tmp_path / "sf", "specforge", tmp_path / "back", model=str(config_only), check_model=False)
    assert s.written == 12
    assert_same_rows(rows(interop_ds), rows(tmp_path / "back"))


def test_skipping_the_model_check_keeps_the_final_norm_check(interop_pre_ds, tiny_model, tiny_norm_model, tmp_path):
    # a post-norm dump that also carries layer L-1: hidden_final must be the model's norm of it
    export_modelopt(interop_pre_ds, tmp_path / "mo", layers=PRE_LAYERS)
    with pytest.raises(InteropError, match=r"hidden_final is not .*final norm of hidden_layer_3"):
        import_dataset(tmp_path / "mo", "modelopt", tmp_path / "x", model=tiny_model, check_model=False)
    s = import_dataset(tmp_path / "mo", "modelopt", tmp_path / "ok", model=tiny_norm_model, check_model=False)
    assert any("hidden_final matches its final norm of hidden_layer_3 in 3 samples" in n for n in s.notes)
    assert_same_rows(rows(interop_pre_ds), rows(tmp_path / "ok"))


def test_modelopt_export_says_its_loss_mask_needs_answer_only_loss(interop_ds, tmp_path, capsys):
    assert "answer_only_loss=True" in (export_modelopt.__doc__ or "")
    assert cli(["export", str(interop_ds), "--to", "modelopt", str(tmp_path / "mo")]) == 0
    assert "loss_mask only with answer_only_loss=True" in capsys.readouterr().out
    interop = (ROOT / "docs" / "interop.md").read_text(encoding="utf-8")
    assert "`loss_mask` only with `answer_only_loss=True`" in interop


@pytest.mark.parametrize("odd", ["model", "layers"])
def test_a_folder_mixing_two_models_or_two_layer_sets_is_refused_naming_the_odd_files(odd, interop_ds, tiny_model,
                                                                                      tmp_path):
    """Files of another model of the same shapes (or the same model's other layers), sorted last in the folder:
    the model check's spread samples plus every file's fingerprint find them."""
    from hs_dataset.demo.tiny import make_tiny_model_dir
    from tests.fixtures.interop import build_tiny

    layers = LAYERS if odd == "model" else (0, 1)
    export_modelopt(interop_ds if odd == "model" else build_tiny(tiny_model, tmp_path / "base", layers=layers),
                    tmp_path / "mo")
    if odd == "model":
        other = build_tiny(str(make_tiny_model_dir(tmp_path / "other-model", seed=1)), tmp_path / "other")
    else:  # the same model's next layers (L-1 = 3 is stored apart by ModelOpt: not among them)
        other = build_tiny(tiny_model, tmp_path / "other", layers=(1, 2))
    export_modelopt(other, tmp_path / "mo-other")
    moved = sorted((tmp_path / "mo-other").glob("*.pt"))[3:5]
    # named to sort 4th and 6th of 14: neither among the first two, nor among the model check's spread picks
    names = ["demo_conversations:10a.pt", "demo_conversations:11a.pt"]
    for f, name in zip(moved, names):  # ids of their own
        d = torch.load(f, weights_only=False)
        d["conversation_id"] = f"other-{d['conversation_id']}"
        torch.save(d, tmp_path / "mo" / name)
    with pytest.raises(InteropError) as e:
        import_dataset(tmp_path / "mo", "modelopt", tmp_path / "x", model=tiny_model, layers=layers)
    msg = str(e.value)
    assert "mixes files of another model or layer set: 2 of 14 files" in msg, msg
    assert all(name in msg for name in names)
    _one_short_line(msg, most=1200)
    assert not (tmp_path / "x").exists()
    for name in names:
        (tmp_path / "mo" / name).unlink()
    s = import_dataset(tmp_path / "mo", "modelopt", tmp_path / "ok", model=tiny_model, layers=layers)
    assert any(n.startswith("file check: every file (12) matches the 3 files the model check verified")
               for n in s.notes), s.notes
