"""Interop: export to SpecForge's offline layout, import from SpecForge and vLLM speculators."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from hs_dataset.shard_writer import build
from hs_dataset.dataset_builder import HiddenStatesConfig
from hs_dataset.cli import main as cli
from hs_dataset.interop import (EXPORT_SIDECAR, InteropError, default_layers, export_specforge, import_dataset,
                                specforge_file)
from hs_dataset.reader import iter_torch, open_dataset

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "builder_scripts" / "data" / "demo_conversations.jsonl"
LAYERS = (0, 1, 2)
COLS = [f"hidden_layer_{k}" for k in LAYERS] + ["hidden_final"]
FP8_BOUND = 2.0**-4 + 2.0**-8  # e4m3 rounding (<= 2^-4 of the value) + the bf16 rounding of the decoded value


def _build(model: str, out: Path, **kw) -> Path:
    cfg = dict(model=model, layers=LAYERS, source=str(DEMO), max_length=256, part_size=8, max_samples=12,
               backend_options={"device": "cpu", "batch_tokens": 4096})
    cfg.update(kw)
    build(HiddenStatesConfig(**cfg), out, progress=False)
    return out


@pytest.fixture(scope="module")
def bf16_ds(tiny_model, tmp_path_factory) -> Path:
    return _build(tiny_model, tmp_path_factory.mktemp("bf16") / "ds")


def rows(d: Path) -> list[dict]:
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in r.items()}
            for r in iter_torch(open_dataset(d))]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def assert_same_rows(a: list[dict], b: list[dict], *, ids: bool = True) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert set(x) == set(y)
        if ids:
            assert x["id"] == y["id"]
        for k in x:
            if k != "id":
                assert x[k].dtype == y[k].dtype, k
                assert torch.equal(bits(x[k]), bits(y[k])), (x["id"], k)


def test_export_writes_specforges_offline_layout(bf16_ds, tmp_path):
    out = tmp_path / "sf"
    s = export_specforge(bf16_ds, out, group_size=5)
    src = rows(bf16_ds)
    assert s.samples == len(src) == 12
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_SIDECAR, "rows_0-5", "rows_10-15", "rows_5-10"]
    assert sorted(p.name for p in (out / "rows_5-10").iterdir()) == [f"data_{i}.ckpt" for i in range(5, 10)]
    for i, r in enumerate(src):
        # as SpecForge's OfflineEagle3Dataset opens them
        d = torch.load(specforge_file(out, i, 5), weights_only=False, mmap=True)
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        T, H = r["hidden_final"].shape
        assert d["input_ids"].dtype == d["loss_mask"].dtype == torch.int64
        assert d["input_ids"].shape == d["loss_mask"].shape == (T,)
        assert d["hidden_state"].dtype == d["aux_hidden_state"].dtype == torch.bfloat16
        assert d["hidden_state"].shape == (1, T, H)
        assert d["aux_hidden_state"].shape == (1, T, len(LAYERS) * H)
        assert torch.equal(d["input_ids"], r["input_ids"].long())
        assert torch.equal(d["loss_mask"], r["loss_mask"].long())
        assert torch.equal(bits(d["hidden_state"][0]), bits(r["hidden_final"]))
        aux = d["aux_hidden_state"].squeeze(0)  # process_data: squeeze(0) -> [T, n*H], layers ascending
        for j, k in enumerate(LAYERS):
            assert torch.equal(bits(aux[:, j * H:(j + 1) * H]), bits(r[f"hidden_layer_{k}"]))
    side = json.loads((out / EXPORT_SIDECAR).read_text())
    assert side["layers"] == list(LAYERS) and side["ids"] == [r["id"] for r in src]
    with pytest.raises(InteropError, match="not empty"):
        export_specforge(bf16_ds, out)


def test_export_then_import_gives_identical_rows(bf16_ds, tmp_path):
    export_specforge(bf16_ds, tmp_path / "sf")
    s = import_dataset(tmp_path / "sf", "specforge", tmp_path / "back")
    assert s.written == s.samples == 12 and s.rejected == 0
    assert_same_rows(rows(bf16_ds), rows(tmp_path / "back"))
    meta = json.loads((tmp_path / "back" / "hs_dataset.json").read_text())
    old = json.loads((bf16_ds / "hs_dataset.json").read_text())
    assert meta["layers"] == old["layers"] and meta["model"] == old["model"]
    assert meta["backend"]["name"] == "import-specforge"
    assert meta["counts"]["written"] == 12
    # a real build directory: plain load_dataset reads it, with the README's schema
    ds = datasets.load_dataset(str(tmp_path / "back"), split="train")
    assert len(ds) == 12 and ds.features["hidden_final"].shape == (None, 64)
    # resumable like a build: running it again redoes nothing and changes nothing
    again = import_dataset(tmp_path / "sf", "specforge", tmp_path / "back")
    assert again.written == 12
    assert_same_rows(rows(bf16_ds), rows(tmp_path / "back"))


def test_import_specforge_without_our_sidecar(bf16_ds, tiny_model, tmp_path):
    """Files as SpecForge itself writes them: no ids, no layer record, input_ids padded by its batching."""
    sf = tmp_path / "sf"
    export_specforge(bf16_ds, sf)
    (sf / EXPORT_SIDECAR).unlink()
    # SpecForge saves input_ids/loss_mask from its padded batch: a longer tail than the states
    p = specforge_file(sf, 3)
    d = torch.load(p, weights_only=True)
    d["input_ids"] = torch.cat([d["input_ids"], torch.zeros(7, dtype=torch.long)])
    d["loss_mask"] = torch.cat([d["loss_mask"], torch.zeros(7, dtype=torch.long)])
    torch.save(d, p)
    with pytest.raises(InteropError, match="--model"):
        import_dataset(sf, "specforge", tmp_path / "x")
    with pytest.raises(InteropError, match="--layers"):
        import_dataset(sf, "specforge", tmp_path / "x", model=tiny_model)  # the default layers need 8+ layers
    import_dataset(sf, "specforge", tmp_path / "back", model=tiny_model, layers=LAYERS)
    got = rows(tmp_path / "back")
    assert [r["id"] for r in got] == [f"specforge:{i}" for i in range(12)]
    assert_same_rows(rows(bf16_ds), got, ids=False)


def test_import_checks_hidden_size_and_layers(bf16_ds, tmp_path):
    export_specforge(bf16_ds, tmp_path / "sf")
    other = tmp_path / "other"
    shutil.copytree(json.loads((bf16_ds / "hs_dataset.json").read_text())["model"]["path"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_size"] = 128
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InteropError, match="hidden size 64"):
        import_dataset(tmp_path / "sf", "specforge", tmp_path / "a", model=str(other))
    with pytest.raises(InteropError, match="2 ids|names 2"):
        import_dataset(tmp_path / "sf", "specforge", tmp_path / "b", layers=(0, 1))
    assert default_layers(61) == (1, 29, 57)


def fp8_rel_error(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    x = ref.float()
    e = (got.float() - x).abs() / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return float(e.max()), float(e.mean())


def test_fp8_import_and_export_stay_within_the_fp8_error(bf16_ds, tmp_path):
    export_specforge(bf16_ds, tmp_path / "sf")
    import_dataset(tmp_path / "sf", "specforge", tmp_path / "fp8", storage_dtype="fp8_e4m3")
    meta = json.loads((tmp_path / "fp8" / "hs_dataset.json").read_text())
    assert meta["storage_dtype"] == "fp8_e4m3"
    ref, got = rows(bf16_ds), rows(tmp_path / "fp8")
    worst = 0.0
    for x, y in zip(ref, got):
        assert x["id"] == y["id"] and torch.equal(x["input_ids"], y["input_ids"])
        for c in COLS:
            mx, mean = fp8_rel_error(x[c], y[c])
            assert mx <= FP8_BOUND and mean <= 2.0**-6, (c, mx, mean)
            worst = max(worst, mx)
    assert worst > 0  # it is lossy
    # exporting the fp8 dataset writes its decoded bf16 values, which import back unchanged into bf16
    export_specforge(tmp_path / "fp8", tmp_path / "sf8")
    import_dataset(tmp_path / "sf8", "specforge", tmp_path / "back")
    assert_same_rows(got, rows(tmp_path / "back"))


def test_fp8_build_within_error_of_a_bf16_build(bf16_ds, tiny_model, tmp_path):
    fp8 = _build(tiny_model, tmp_path / "fp8", storage_dtype="fp8_e4m3")
    for x, y in zip(rows(bf16_ds), rows(fp8)):
        for c in COLS:
            assert fp8_rel_error(x[c], y[c])[0] <= FP8_BOUND


def write_speculators(ds_rows: list[dict], data: Path, *, fp8: bool = False) -> None:
    """vLLM speculators' offline layout: the preprocessed dataset + hidden_states/hs_<i>.safetensors."""
    from safetensors.torch import save_file

    datasets.Dataset.from_dict({
        "input_ids": [r["input_ids"].long().tolist() for r in ds_rows],
        "loss_mask": [r["loss_mask"].long().tolist() for r in ds_rows],
        "seq_len": [int(r["input_ids"].shape[0]) for r in ds_rows],
    }).save_to_disk(str(data))
    (data / "hidden_states").mkdir()
    for i, r in enumerate(ds_rows):
        hs = torch.stack([r[c] for c in COLS], dim=1)  # [T, n + 1, H]: aux layers, then the final state
        t = {"hidden_states": hs.contiguous(), "token_ids": r["input_ids"].long()}
        if fp8:
            flat = hs.reshape(hs.shape[0], -1).float()
            scale = (flat.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
            t = {"hidden_states": (flat / scale).to(torch.float8_e4m3fn).reshape(hs.shape),
                 "hidden_states_scales": scale, "token_ids": r["input_ids"].long()}
        save_file(t, str(data / "hidden_states" / f"hs_{i}.safetensors"))


def test_import_speculators(bf16_ds, tiny_model, tmp_path):
    src = rows(bf16_ds)
    write_speculators(src, tmp_path / "data")
    s = import_dataset(tmp_path / "data", "speculators", tmp_path / "back", model=tiny_model, layers=LAYERS)
    assert s.written == 12
    got = rows(tmp_path / "back")
    assert [r["id"] for r in got] == [f"speculators:{i}" for i in range(12)]
    assert_same_rows(src, got, ids=False)
    # pointing at the hidden_states folder itself finds the dataset one level up
    import_dataset(tmp_path / "data" / "hidden_states", "speculators", tmp_path / "back2", model=tiny_model,
                   layers=LAYERS)
    assert_same_rows(got, rows(tmp_path / "back2"))


def test_import_speculators_fp8_files(bf16_ds, tiny_model, tmp_path):
    src = rows(bf16_ds)
    write_speculators(src, tmp_path / "data", fp8=True)
    import_dataset(tmp_path / "data", "speculators", tmp_path / "back", model=tiny_model, layers=LAYERS)
    for x, y in zip(src, rows(tmp_path / "back")):
        for c in COLS:  # one scale per token over all layers: the error is relative to the row's overall amax
            e = (y[c].float() - x[c].float()).abs().max() / max(float(x[cc].float().abs().max()) for cc in COLS)
            assert e <= FP8_BOUND


def test_import_speculators_legacy_sample_files(bf16_ds, tiny_model, tmp_path):
    src = rows(bf16_ds)
    (tmp_path / "pt").mkdir()
    for i, r in enumerate(src):
        torch.save({"input_ids": r["input_ids"].long(), "loss_mask": r["loss_mask"].long(),
                    "hidden_states": [r[c].clone() for c in COLS]}, tmp_path / "pt" / f"data_{i}.pt")
    import_dataset(tmp_path / "pt", "speculators", tmp_path / "back", model=tiny_model, layers=LAYERS)
    assert_same_rows(src, rows(tmp_path / "back"), ids=False)


def test_import_speculators_errors(bf16_ds, tiny_model, tmp_path):
    src = rows(bf16_ds)
    write_speculators(src, tmp_path / "data")
    shutil.move(str(tmp_path / "data" / "hidden_states"), str(tmp_path / "alone"))
    with pytest.raises(InteropError, match="preprocessed dataset"):
        import_dataset(tmp_path / "alone", "speculators", tmp_path / "x", model=tiny_model, layers=LAYERS)
    write_speculators(src[::-1], tmp_path / "data2")  # the files no longer match the dataset's rows
    from safetensors.torch import load_file, save_file

    f = tmp_path / "data2" / "hidden_states" / "hs_0.safetensors"
    t = load_file(str(f))
    t["token_ids"] = t["token_ids"] + 1
    save_file(t, str(f))
    with pytest.raises(InteropError, match="token_ids do not match"):
        import_dataset(tmp_path / "data2", "speculators", tmp_path / "y", model=tiny_model, layers=LAYERS)
    with pytest.raises(InteropError, match="no speculators data"):
        import_dataset(tmp_path / "alone" / "..", "speculators", tmp_path / "z", model=tiny_model)


def test_cli_export_and_import(bf16_ds, tmp_path, capsys):
    assert cli(["export", str(bf16_ds), "--to", "specforge", str(tmp_path / "sf"), "--group-size", "4"]) == 0
    assert (tmp_path / "sf" / "rows_8-12" / "data_11.ckpt").exists()
    assert cli(["import", str(tmp_path / "sf"), "--from", "specforge", str(tmp_path / "back"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "exported 12 samples" in out and "imported 12 samples" in out
    assert_same_rows(rows(bf16_ds), rows(tmp_path / "back"))
    meta = json.loads((tmp_path / "back" / "hs_dataset.json").read_text())
    assert meta["build_command"].startswith("hs-dataset import")
    assert cli(["import", str(tmp_path / "sf"), "--from", "specforge", str(tmp_path / "fp8"), "--no-progress",
                "--layers", "0,1,2", "--storage-dtype", "fp8_e4m3"]) == 0
    assert json.loads((tmp_path / "fp8" / "hs_dataset.json").read_text())["storage_dtype"] == "fp8_e4m3"
    np.testing.assert_array_equal([r["num_tokens"] for r in datasets.load_dataset(str(tmp_path / "fp8"),
                                                                                    split="train")],
                                  [int(r["input_ids"].shape[0]) for r in rows(bf16_ds)])
