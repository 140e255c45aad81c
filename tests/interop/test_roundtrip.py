"""Interop, our side: export and import for SpecForge, speculators and ModelOpt, round trips, labels,
per-sample rejects, layer ids. The peers' own readers and writers: tests/interop/test_peers.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hs_dataset.cli import main as cli
from hs_dataset.errors import InteropError
from hs_dataset.interop import (EXPORT_SIDECAR, LAYER_IDS_FILE, default_layers, export_dataset, export_specforge,
                                import_dataset, specforge_file)
from hs_dataset.capture.layer_ids import sglang_ids, vllm_ids
from tests.fixtures.interop import LAYERS, PRE_LAYERS, assert_same_rows, bits, build_tiny, rows

COLS = [f"hidden_layer_{k}" for k in LAYERS] + ["hidden_final"]
FP8_BOUND = 2.0**-4 + 2.0**-8  # e4m3 rounding (<= 2^-4 of the value) + the bf16 rounding of the decoded value


def test_export_writes_specforges_offline_layout(interop_ds, tmp_path):
    out = tmp_path / "sf"
    s = export_specforge(interop_ds, out, group_size=5)
    src = rows(interop_ds)
    assert s.samples == len(src) == 12
    assert sorted(p.name for p in out.iterdir()) == [LAYER_IDS_FILE, EXPORT_SIDECAR, "rows_0-5", "rows_10-15",
                                                     "rows_5-10"]
    assert sorted(p.name for p in (out / "rows_5-10").iterdir()) == [f"data_{i}.ckpt" for i in range(5, 10)]
    for i, r in enumerate(src):
        d = torch.load(specforge_file(out, i, 5), weights_only=False, mmap=True)
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        T, H = r["hidden_final"].shape
        assert d["input_ids"].dtype == d["loss_mask"].dtype == torch.int64
        assert d["hidden_state"].shape == (1, T, H) and d["aux_hidden_state"].shape == (1, T, 3 * H)
        assert torch.equal(d["input_ids"], r["input_ids"].long())
        assert torch.equal(d["loss_mask"], r["loss_mask"].long())
        assert torch.equal(bits(d["hidden_state"][0]), bits(r["hidden_final"]))
        for j, k in enumerate(LAYERS):
            assert torch.equal(bits(d["aux_hidden_state"][0, :, j * H:(j + 1) * H]), bits(r[f"hidden_layer_{k}"]))
    side = json.loads((out / EXPORT_SIDECAR).read_text())
    assert side["layers"] == list(LAYERS) and side["ids"] == [r["id"] for r in src]
    ids = json.loads((out / LAYER_IDS_FILE).read_text())
    assert ids == s.layer_ids and ids["hs_dataset_layers"] == [0, 1, 2]
    assert ids["vllm"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: the input of layer k + 1
    assert ids["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # llama.py adds 1
    with pytest.raises(InteropError, match="not empty"):
        export_specforge(interop_ds, out)


def test_layer_ids_per_engine_and_model_class():
    assert vllm_ids([1, 29, 57]) == [2, 30, 58]
    assert sglang_ids("LlamaForCausalLM", 32, [1, 15, 28])[0] == [1, 15, 28]
    assert sglang_ids("Qwen3MoeForCausalLM", 48, [0, 23, 44])[0] == [0, 23, 44]
    # deepseek_v2.py: +1 only when the first id is 1
    assert sglang_ids("DeepseekV3ForCausalLM", 61, [1, 29, 57])[0] == [1, 29, 57]
    assert sglang_ids("DeepseekV3ForCausalLM", 61, [2, 29, 57])[0] == [3, 30, 58]
    assert sglang_ids("KimiK25ForConditionalGeneration", 61, [2, 29, 57])[0] == [3, 30, 58]
    ids, why = sglang_ids("DeepseekV3ForCausalLM", 61, [0, 29, 57])
    assert ids is None and "cannot be expressed" in why
    ids, why = sglang_ids("LlamaForCausalLM", 32, [1, 15, 31])  # L-1: SGLang never captures it
    assert ids is None and "no SGLang id" in why
    assert default_layers(61) == (1, 29, 57)


def test_exports_refuse_what_the_peer_cannot_take(interop_ds, interop_pre_ds, tmp_path):
    with pytest.raises(InteropError, match="exactly 3 aux layers.*--layers"):
        export_specforge(interop_ds, tmp_path / "a", layers=(0, 1))
    with pytest.raises(InteropError, match=r"hs_dataset layer 3.*build with layers=\[0, 1, 2, 3\]"):
        export_dataset(interop_ds, "speculators", tmp_path / "b")
    with pytest.raises(InteropError, match="stored layers"):
        export_dataset(interop_ds, "modelopt", tmp_path / "c", layers=(0, 3))
    s = export_specforge(interop_pre_ds, tmp_path / "d", layers=PRE_LAYERS)  # L-1 as an aux layer: no SGLang ids
    assert s.warnings and "no SGLang layer ids" in s.warnings[0]
    assert s.layer_ids["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] is None


@pytest.mark.parametrize("fmt", ["specforge", "speculators", "modelopt"])
def test_round_trip_is_bit_identical(fmt, interop_ds, interop_pre_ds, tmp_path):
    src = interop_pre_ds if fmt == "speculators" else interop_ds
    export_dataset(src, fmt, tmp_path / "x")
    s = import_dataset(tmp_path / "x", fmt, tmp_path / "back")
    assert s.written == s.samples == 12 and s.rejected == 0
    assert_same_rows(rows(src), rows(tmp_path / "back"))  # ids, tokens, every layer and hidden_final
    meta = json.loads((tmp_path / "back" / "hs_dataset.json").read_text())
    old = json.loads((src / "hs_dataset.json").read_text())
    assert meta["layers"] == old["layers"] and meta["model"] == old["model"]
    assert meta["backend"]["name"] == f"import-{fmt}" and meta["counts"]["written"] == 12
    if fmt == "speculators":  # hidden_final was computed: the metadata says so
        assert "RMSNorm(hidden_layer_3)" in meta["backend"]["options"]["final"]
    # resumable like a build: running it again redoes nothing and changes nothing
    again = import_dataset(tmp_path / "x", fmt, tmp_path / "back")
    assert again.written == 12
    assert_same_rows(rows(src), rows(tmp_path / "back"))


def test_round_trip_through_modelopt_with_the_prenorm_layer(interop_pre_ds, tmp_path):
    export_dataset(interop_pre_ds, "modelopt", tmp_path / "mo", layers=PRE_LAYERS)
    import_dataset(tmp_path / "mo", "modelopt", tmp_path / "back")
    back = rows(tmp_path / "back")
    assert_same_rows(rows(interop_pre_ds), back)
    ds = datasets.load_dataset(str(tmp_path / "back"), split="train")  # a real build directory
    assert len(ds) == 12 and ds.features["hidden_final"].shape == (None, 64)


def _pad_specforge_file(p: Path, n: int, pad_id: int = 0) -> None:
    """As SpecForge 0.2.0 saves a row of a padded batch: pad id 0 with mask 0, and states for them."""
    d = torch.load(p, weights_only=True)
    g = torch.Generator().manual_seed(n)
    d["input_ids"] = torch.cat([d["input_ids"], torch.full((n,), pad_id, dtype=torch.long)])
    d["loss_mask"] = torch.cat([d["loss_mask"], torch.zeros(n, dtype=torch.long)])
    for k in ("hidden_state", "aux_hidden_state"):
        tail = torch.randn((1, n, d[k].shape[-1]), generator=g).to(torch.bfloat16)
        d[k] = torch.cat([d[k], tail], dim=1)
    torch.save(d, p)


def test_import_specforge_strips_pad_tails(interop_ds, tiny_model, tmp_path):
    sf = tmp_path / "sf"
    export_specforge(interop_ds, sf)
    (sf / EXPORT_SIDECAR).unlink()  # as SpecForge itself writes them: no ids, no layer record
    _pad_specforge_file(specforge_file(sf, 3), 137)
    _pad_specforge_file(specforge_file(sf, 7), 5)
    # an older writer: input_ids/loss_mask longer than the states
    p = specforge_file(sf, 4)
    d = torch.load(p, weights_only=True)
    d["input_ids"], d["loss_mask"] = (torch.cat([d[k], torch.zeros(7, dtype=torch.long)]) for k in ("input_ids",
                                                                                                    "loss_mask"))
    torch.save(d, p)
    with pytest.raises(InteropError, match="--model"):
        import_dataset(sf, "specforge", tmp_path / "x")
    with pytest.raises(InteropError, match="--layers"):
        import_dataset(sf, "specforge", tmp_path / "x", model=tiny_model)  # the default layers need 8+ layers
    s = import_dataset(sf, "specforge", tmp_path / "back", model=tiny_model, layers=LAYERS)
    got = rows(tmp_path / "back")
    assert [r["id"] for r in got] == [f"specforge:{i}" for i in range(12)]
    assert_same_rows(rows(interop_ds), got, ids=False)
    assert any("142 tokens" in n and "from 2 samples" in n for n in s.notes)
    opts = json.loads((tmp_path / "back" / "hs_dataset.json").read_text())["backend"]["options"]
    assert opts["pad_tail_tokens"] == 142 and opts["pad_tail_samples"] == 2 and opts["pad_id"] == 0
    # pad_id=None keeps the tails: they are then real tokens of the sample (and no longer match)
    import_dataset(sf, "specforge", tmp_path / "kept", model=tiny_model, layers=LAYERS, pad_id=None)
    kept = rows(tmp_path / "kept")
    assert kept[3]["input_ids"].shape[0] == got[3]["input_ids"].shape[0] + 137


def test_import_checks_hidden_size_and_layers(interop_ds, tmp_path):
    export_specforge(interop_ds, tmp_path / "sf")
    other = tmp_path / "other"
    shutil.copytree(json.loads((interop_ds / "hs_dataset.json").read_text())["model"]["path"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_size"] = 128
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InteropError, match="no usable specforge sample.*hidden size 64, but"):
        import_dataset(tmp_path / "sf", "specforge", tmp_path / "a", model=str(other))
    with pytest.raises(InteropError, match="holds 3 layers.*pass --layers with 3 ids"):
        import_dataset(tmp_path / "sf", "specforge", tmp_path / "b", layers=(0, 1))


def test_bad_files_are_rejects_with_the_ids_their_rows_would_have_had(interop_ds, tiny_model, tmp_path):
    sf = tmp_path / "sf"
    export_specforge(interop_ds, sf)
    (sf / EXPORT_SIDECAR).unlink()
    specforge_file(sf, 2).write_bytes(b"not a torch file")
    d = torch.load(specforge_file(sf, 5), weights_only=True)
    d["input_ids"][3] = 10**6  # outside the vocabulary
    torch.save(d, specforge_file(sf, 5))
    d = torch.load(specforge_file(sf, 9), weights_only=True)
    d["aux_hidden_state"] = d["aux_hidden_state"][..., :-64]  # two layers instead of three
    torch.save(d, specforge_file(sf, 9))
    d = torch.load(specforge_file(sf, 10), weights_only=True)
    d["hidden_state"][0, 2, 5] = float("nan")
    torch.save(d, specforge_file(sf, 10))
    s = import_dataset(sf, "specforge", tmp_path / "back", model=tiny_model, layers=LAYERS)
    bad = (2, 5, 9, 10)
    assert (s.samples, s.written, s.rejected) == (12, 8, 4)
    rejects = [json.loads(line) for line in (tmp_path / "back" / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["sample_id"], r["field"], r["stage"]) for r in rejects) == [
        ("specforge:10", "hidden_final", "encode"), ("specforge:2", "file", "import"),
        ("specforge:5", "input_ids[3]", "import"), ("specforge:9", "hidden_states", "import")]
    reasons = {r["sample_id"]: r["reason"] for r in rejects}
    assert "unreadable" in reasons["specforge:2"] and "outside the vocabulary" in reasons["specforge:5"]
    got = rows(tmp_path / "back")
    assert [r["id"] for r in got] == [f"specforge:{i}" for i in range(12) if i not in bad]
    assert_same_rows([r for i, r in enumerate(rows(interop_ds)) if i not in bad], got, ids=False)


def fp8_rel_error(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    x = ref.float()
    e = (got.float() - x).abs() / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return float(e.max()), float(e.mean())


def test_fp8_import_and_export_stay_within_the_fp8_error(interop_ds, tmp_path):
    export_specforge(interop_ds, tmp_path / "sf")
    import_dataset(tmp_path / "sf", "specforge", tmp_path / "fp8", storage_dtype="fp8_e4m3")
    assert json.loads((tmp_path / "fp8" / "hs_dataset.json").read_text())["storage_dtype"] == "fp8_e4m3"
    ref, got = rows(interop_ds), rows(tmp_path / "fp8")
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


def test_fp8_build_within_error_of_a_bf16_build(interop_ds, tiny_model, tmp_path):
    fp8 = build_tiny(tiny_model, tmp_path / "fp8", storage_dtype="fp8_e4m3")
    for x, y in zip(rows(interop_ds), rows(fp8)):
        for c in COLS:
            assert fp8_rel_error(x[c], y[c])[0] <= FP8_BOUND


def test_speculators_export_layout(interop_pre_ds, tmp_path):
    s = export_dataset(interop_pre_ds, "speculators", tmp_path / "data")
    src = rows(interop_pre_ds)
    ds = datasets.load_from_disk(str(tmp_path / "data"))
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"] and len(ds) == 12
    assert ds.format["type"] == "torch"  # as speculators prepare-data saves it
    for i, r in enumerate(src):
        t = load_file(str(tmp_path / "data" / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(t) == {"hidden_states", "token_ids"}
        assert t["hidden_states"].shape == (r["input_ids"].shape[0], 3, 64) and t["token_ids"].dtype == torch.int64
        for j, k in enumerate(PRE_LAYERS):  # aux layers, then layer L-1 (before the norm): never hidden_final
            assert torch.equal(bits(t["hidden_states"][:, j]), bits(r[f"hidden_layer_{k}"]))
        assert torch.equal(ds[i]["input_ids"], t["token_ids"]) and torch.equal(ds[i]["loss_mask"],
                                                                                r["loss_mask"].long())
    freq = torch.load(tmp_path / "data" / "token_freq.pt", weights_only=True)
    assert sum(freq.values()) == sum(int(r["loss_mask"].sum()) for r in src)
    assert s.layer_ids["vllm"]["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # --target-layer-ids
    assert json.loads((tmp_path / "data" / EXPORT_SIDECAR).read_text())["vllm_target_layer_ids"] == [1, 2, 4]


def write_speculators(ds_rows: list[dict], data: Path, columns: list[str]) -> None:
    """speculators' layout as vLLM's ExampleHiddenStatesConnector saves it (entries = ``columns``)."""
    datasets.Dataset.from_dict({
        "input_ids": [r["input_ids"].long().tolist() for r in ds_rows],
        "loss_mask": [r["loss_mask"].long().tolist() for r in ds_rows],
        "seq_len": [int(r["input_ids"].shape[0]) for r in ds_rows],
    }).save_to_disk(str(data))
    (data / "hidden_states").mkdir()
    for i, r in enumerate(ds_rows):
        save_file({"hidden_states": torch.stack([r[c] for c in columns], dim=1).contiguous(),
                   "token_ids": torch.tensor(r["input_ids"].tolist())},
                  str(data / "hidden_states" / f"hs_{i}.safetensors"))


def test_import_speculators_labels_the_last_entry_as_layer_l_minus_1(interop_pre_ds, tiny_norm_model, tmp_path):
    src = rows(interop_pre_ds)
    write_speculators(src, tmp_path / "data", [f"hidden_layer_{k}" for k in PRE_LAYERS])
    s = import_dataset(tmp_path / "data", "speculators", tmp_path / "back", model=tiny_norm_model,
                       layers=PRE_LAYERS)
    assert s.written == 12 and "RMSNorm" in s.notes[0]
    got = rows(tmp_path / "back")
    assert [r["id"] for r in got] == [f"speculators:{i}" for i in range(12)]
    assert_same_rows(src, got, ids=False)  # hidden_final recomputed == the transformers backend's, bit for bit
    # pointing at the hidden_states folder itself finds the dataset one level up
    import_dataset(tmp_path / "data" / "hidden_states", "speculators", tmp_path / "back2", model=tiny_norm_model,
                   layers=PRE_LAYERS)
    assert_same_rows(got, rows(tmp_path / "back2"))
    with pytest.raises(InteropError, match="last layer before the final norm.*end with 2"):
        import_dataset(tmp_path / "data", "speculators", tmp_path / "x", model=tiny_norm_model, layers=(0, 1, 2))


def test_import_speculators_needs_the_norm_weights(interop_pre_ds, tiny_norm_model, tmp_path):
    write_speculators(rows(interop_pre_ds), tmp_path / "data", [f"hidden_layer_{k}" for k in PRE_LAYERS])
    no_weights = tmp_path / "config_only"
    shutil.copytree(tiny_norm_model, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(InteropError, match="before the final norm.*pass --model with the model's weights"):
        import_dataset(tmp_path / "data", "speculators", tmp_path / "x", model=str(no_weights), layers=PRE_LAYERS)


def test_import_speculators_per_sample_rejects(interop_pre_ds, tiny_norm_model, tmp_path):
    src = rows(interop_pre_ds)
    data = tmp_path / "data"
    write_speculators(src, data, [f"hidden_layer_{k}" for k in PRE_LAYERS])
    hs = data / "hidden_states"
    (hs / "hs_1.safetensors").write_bytes(b"\0" * 100)  # truncated by an interrupted copy
    t = load_file(str(hs / "hs_4.safetensors"))
    t["token_ids"] = t["token_ids"] + 1
    save_file(t, str(hs / "hs_4.safetensors"))
    (hs / "hs_6.safetensors").unlink()  # never generated
    s = import_dataset(data, "speculators", tmp_path / "back", model=tiny_norm_model, layers=PRE_LAYERS)
    assert (s.samples, s.written, s.rejected) == (12, 9, 3)
    rejects = [json.loads(line) for line in (tmp_path / "back" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["sample_id"], r["field"]) for r in rejects] == [("speculators:1", "file"),
                                                               ("speculators:4", "token_ids"),
                                                               ("speculators:6", "file")]
    assert "no hidden-states file" in rejects[2]["reason"]
    assert [r["id"] for r in rows(tmp_path / "back")] == [f"speculators:{i}" for i in range(12) if i not in (1, 4, 6)]
    shutil.move(str(hs), str(tmp_path / "alone"))
    with pytest.raises(InteropError, match="preprocessed dataset"):
        import_dataset(tmp_path / "alone", "speculators", tmp_path / "y", model=tiny_norm_model, layers=PRE_LAYERS)
    with pytest.raises(InteropError, match="no speculators data"):
        import_dataset(tmp_path / "alone" / "..", "speculators", tmp_path / "z", model=tiny_norm_model)


@pytest.mark.parametrize("with_config", [True, False])
def test_import_speculators_legacy_files_read_their_data_config(with_config, tiny_norm_model, tmp_path_factory,
                                                                 tmp_path):
    # the legacy default layers [2, L//2, L-3, L-1] are (2, 2, 1, 3) on 4 layers: duplicates; an 8-layer
    # model gives [2, 4, 5, 7]. data_config.json records the ids actually used.
    layers = (0, 1, 3) if with_config else (2, 4, 5, 7)
    model = tiny_norm_model
    if not with_config:
        from hs_dataset.demo.tiny import make_tiny_llama, make_tiny_tokenizer

        model = str(tmp_path_factory.mktemp("m8"))
        tok = make_tiny_tokenizer(model)
        make_tiny_llama(model, vocab_size=len(tok), num_layers=8, random_norms=True)
    ds = build_tiny(model, tmp_path / "ds", layers=layers)
    src = rows(ds)
    (tmp_path / "pt").mkdir()
    for i, r in enumerate(src):  # scripts/data_generation_offline.py of speculators <= 0.4
        torch.save({"input_ids": r["input_ids"].long(), "hidden_states": [r[f"hidden_layer_{k}"].clone()
                                                                          for k in layers],
                    "loss_mask": r["loss_mask"].long()}, tmp_path / "pt" / f"data_{i}.pt")
    if with_config:
        (tmp_path / "pt" / "data_config.json").write_text(json.dumps({"version": "2.0", "hidden_states": {
            "layer_ids": list(layers), "description": "Layers selected for EAGLE3 fusion and target logits"}}))
    import_dataset(tmp_path / "pt", "speculators", tmp_path / "back", model=model)  # no --layers
    meta = json.loads((tmp_path / "back" / "hs_dataset.json").read_text())
    assert meta["layers"] == list(layers)
    assert ("data_config.json" in meta["backend"]["options"]["layers_from"]) == with_config
    assert_same_rows(src, rows(tmp_path / "back"), ids=False)


def test_import_modelopt_post_and_pre_norm(interop_ds, interop_pre_ds, tiny_model, tiny_norm_model, tmp_path):
    def dump(ds_rows, out, final_col, aux, prenorm=None):
        out.mkdir()
        for r in ds_rows:  # compute_hidden_states_hf.py's dict
            d = {"input_ids": r["input_ids"].long(), "hidden_states": r[final_col].clone(),
                 "aux_hidden_states": torch.cat([r[f"hidden_layer_{k}"] for k in aux], dim=-1),
                 "loss_mask": r["loss_mask"].long(), "conversation_id": r["id"]}
            if prenorm is not None:
                d["hidden_states_prenorm"] = prenorm
            torch.save(d, out / f"{r['id']}.pt")

    a = rows(interop_ds)
    dump(a, tmp_path / "post", "hidden_final", LAYERS)
    import_dataset(tmp_path / "post", "modelopt", tmp_path / "b1", model=tiny_model, layers=LAYERS)
    got = rows(tmp_path / "b1")
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in a)  # conversation_id is the sample id
    assert_same_rows(sorted(a, key=lambda r: r["id"]), sorted(got, key=lambda r: r["id"]))
    b = rows(interop_pre_ds)
    dump(b, tmp_path / "pre", "hidden_layer_3", (0, 1), prenorm=True)
    import_dataset(tmp_path / "pre", "modelopt", tmp_path / "b2", model=tiny_norm_model, layers=PRE_LAYERS)
    assert_same_rows(sorted(b, key=lambda r: r["id"]), sorted(rows(tmp_path / "b2"), key=lambda r: r["id"]))
    # its vLLM dump stores the pre-norm state without the flag: --final-prenorm says so
    dump(b, tmp_path / "vllm", "hidden_layer_3", (0, 1))
    import_dataset(tmp_path / "vllm", "modelopt", tmp_path / "b3", model=tiny_norm_model, layers=PRE_LAYERS,
                   final_prenorm=True)
    assert_same_rows(rows(tmp_path / "b2"), rows(tmp_path / "b3"))


def test_cli_export_and_import(interop_ds, interop_pre_ds, tmp_path, capsys):
    assert cli(["export", str(interop_ds), "--to", "specforge", str(tmp_path / "sf"), "--group-size", "4"]) == 0
    assert (tmp_path / "sf" / "rows_8-12" / "data_11.ckpt").exists()
    assert cli(["import", str(tmp_path / "sf"), "--from", "specforge", str(tmp_path / "back"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "exported 12 samples" in out and "imported 12 samples" in out and "vLLM [1, 2, 3]" in out
    assert_same_rows(rows(interop_ds), rows(tmp_path / "back"))
    meta = json.loads((tmp_path / "back" / "hs_dataset.json").read_text())
    assert meta["build_command"].startswith("hs-dataset import")
    assert cli(["import", str(tmp_path / "sf"), "--from", "specforge", str(tmp_path / "fp8"), "--no-progress",
                "--layers", "0,1,2", "--storage-dtype", "fp8_e4m3", "--pad-id", "none"]) == 0
    assert json.loads((tmp_path / "fp8" / "hs_dataset.json").read_text())["storage_dtype"] == "fp8_e4m3"
    np.testing.assert_array_equal([r["num_tokens"] for r in datasets.load_dataset(str(tmp_path / "fp8"),
                                                                                    split="train")],
                                  [int(r["input_ids"].shape[0]) for r in rows(interop_ds)])
    assert cli(["export", str(interop_pre_ds), "--to", "speculators", str(tmp_path / "sp")]) == 0
    assert cli(["import", str(tmp_path / "sp"), "--from", "speculators", str(tmp_path / "sp_back"),
                "--no-progress"]) == 0
    assert "RMSNorm" in capsys.readouterr().out
    assert_same_rows(rows(interop_pre_ds), rows(tmp_path / "sp_back"))
    capsys.readouterr()
    assert cli(["export", str(interop_ds), "--to", "specforge", str(tmp_path / "x"), "--layers", "0,1"]) == 2
    err = capsys.readouterr().err  # one line naming the problem (exit 2), no traceback
    assert err.startswith("hs-dataset export: error: ") and "exactly 3 aux layers" in err and err.count("\n") == 1
