"""Imports under attack (issue 27, finding 10): a ModelOpt folder mixing pre- and post-norm dumps, a
folder of another tool's files, most files rejected, a wrong --model of the same shapes, and what
ModelOpt does with the exported loss_mask. Each test failed before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hs_dataset.cli import main as cli
from hs_dataset.errors import InteropError
from hs_dataset.interop import export_dataset, export_modelopt, import_dataset, specforge_file
from tests.fixtures.interop import LAYERS, PRE_LAYERS, rows


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
