"""Interop against the peers' OWN code from PyPI: specforge==0.2.0, speculators==0.9.0 + hs-connectors==0.9.0,
nvidia-modelopt==0.47.0 (installed with --no-deps by .ci/run, plus the `peers` extra: openai, which
speculators.train.data imports).

What runs as the peers ship it: SpecForge's offline dataset, collator and 0.2.0 provider path
(OfflineManifestReader -> LocalFeatureStore -> FeatureDataLoader), its OfflineCaptureLayout and
DataCollatorWithPadding (how 0.2.0 batches and records a sample); speculators' ArrowDataset,
CollateFn and token-frequency counter; hs-connectors' FP8 quantizer and FP8Transfer reader;
ModelOpt's OfflineSupervisedDataset and EagleOfflineDataCollator.

What cannot, and is reproduced line for line instead: vLLM (no CPU wheel) -- the dict its
ExampleHiddenStatesConnector._write_tensors passes to safetensors' save_file, and the body of
hs-connectors' FP8HiddenStatesConnector._write_tensors (its module imports vLLM); SpecForge's
HiddenStatesGenerator._save_tensor_sync (scripts/prepare_hidden_states.py is not in the wheel: it is
``torch.save(record, path)``); ModelOpt's dump dict (examples/, not in the wheel). ModelOpt's package
``__init__`` pulls in its whole quantization stack (pulp, scipy, omegaconf...), so its reader module
is loaded on its own (see ``modelopt_eagle_utils``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hs_dataset.interop import export_dataset, import_dataset, specforge_file
from tests.fixtures.interop import LAYERS, PRE_LAYERS, assert_same_rows, bits, rms_norm_reference, rows

REASON = "the peers' packages are not installed (.ci/run installs them: pip install --no-deps ...)"
H = 64


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- SpecForge ---------------------------------------------------------------------------------------


def test_specforge_reads_our_export(interop_ds, tmp_path):
    pytest.importorskip("specforge", reason=REASON)
    from specforge.algorithms.eagle3.data import (build_offline_collator, build_offline_normalizer,
                                                  build_offline_reader)
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    export_dataset(interop_ds, "specforge", tmp_path / "sf", group_size=5)
    ours = rows(interop_ds)
    by_path = {str(specforge_file(tmp_path / "sf", i, 5).resolve()): r for i, r in enumerate(ours)}

    def check(item: dict, r: dict) -> None:
        T = r["input_ids"].shape[0]
        assert _eq(item["hidden_state"][0], torch.cat([r[f"hidden_layer_{k}"] for k in LAYERS], dim=-1))
        assert _eq(item["target"][0], r["hidden_final"])
        assert torch.equal(item["input_ids"][0], r["input_ids"].long())
        mask = r["loss_mask"].long().clone()
        mask[-1] = 0  # SpecForge's own rule
        assert torch.equal(item["loss_mask"][0], mask) and item["attention_mask"].shape == (1, T)

    ds = build_offline_eagle3_dataset(str(tmp_path / "sf"), max_len=2048)
    assert len(ds) == 12  # the sidecar and layer-id files are not samples
    items = [ds[i] for i in range(len(ds))]
    for path, item in zip(ds.datapaths, items):
        check(item, by_path[str(Path(path).resolve())])
    batch = DataCollatorWithPadding()(items[:4])
    n = max(int(i["input_ids"].shape[1]) for i in items[:4])
    assert batch["hidden_state"].shape == (4, n, 3 * H) and batch["target"].shape == (4, n, H)

    # the 0.2.0 provider path: manifest reader -> LocalFeatureStore -> FeatureDataLoader
    reader = build_offline_reader(str(tmp_path / "sf"), run_id="t", ttt_length=1, max_len=2048)
    refs = {ref.sample_id: ref for ref in reader.read()}
    loader = FeatureDataLoader(LocalFeatureStore(), refs=list(refs.values()), batch_size=1,
                               collate_fn=build_offline_collator(), per_sample_transform=build_offline_normalizer(2048),
                               drop_last=False)
    seen = set()
    for tb in loader:
        (sid,) = tb.sample_ids
        check(tb.tensors, by_path[refs[sid].feature_store_uri[len("file://"):]])
        seen.add(sid)
    assert seen == set(refs) and len(seen) == 12


def test_specforge_020_padded_batches_import_without_their_pad_tails(interop_ds, tiny_model, tmp_path):
    pytest.importorskip("specforge", reason=REASON)
    from specforge.algorithms.common.providers import OfflineCaptureLayout
    from specforge.data.utils import DataCollatorWithPadding

    # HiddenStatesGenerator's default layout (scripts/prepare_hidden_states.py)
    layout = OfflineCaptureLayout(capture_method="eagle3", aux_feature="aux_hidden_state",
                                  last_hidden_feature="hidden_state",
                                  passthrough=(("input_ids", "input_ids"), ("loss_mask", "loss_mask")))
    ours = rows(interop_ds)
    g = torch.Generator().manual_seed(0)
    out = tmp_path / "sf"
    for b0 in range(0, 12, 4):  # --batch-size 4: each padded row is captured whole, pad tail included
        group = ours[b0:b0 + 4]
        feats = [{"input_ids": r["input_ids"].long()[None], "loss_mask": r["loss_mask"].long()[None],
                  "attention_mask": torch.ones((1, r["input_ids"].shape[0]), dtype=torch.long)} for r in group]
        batch = DataCollatorWithPadding()(feats)
        N = batch["input_ids"].shape[1]
        for j, r in enumerate(group):
            T = r["input_ids"].shape[0]
            aux = torch.cat([r[f"hidden_layer_{k}"] for k in LAYERS], dim=-1)
            pad_states = torch.randn((N - T, 4 * H), generator=g).to(torch.bfloat16)  # the engine's, for pads
            record = layout.materialize({
                "input_ids": batch["input_ids"][j].clone(), "loss_mask": batch["loss_mask"][j].clone(),
                "aux_hidden_states": torch.cat([aux, pad_states[:, :3 * H]]).unsqueeze(0),
                "last_hidden_states": torch.cat([r["hidden_final"], pad_states[:, 3 * H:]]).unsqueeze(0)})
            path = specforge_file(out, b0 + j)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(dict(record), str(path))  # _save_tensor_sync (not compressed)
    padded = sum(1 for i, r in enumerate(ours) if torch.load(specforge_file(out, i), weights_only=True)
                 ["input_ids"].shape[0] > r["input_ids"].shape[0])
    assert padded >= 6
    s = import_dataset(out, "specforge", tmp_path / "back", model=tiny_model, layers=LAYERS)
    assert s.written == 12 and any(f"from {padded} samples" in n for n in s.notes)
    got = rows(tmp_path / "back")
    assert [r["id"] for r in got] == [f"specforge:{i}" for i in range(12)]
    assert_same_rows(ours, got, ids=False)  # every sample at its real length, values bit-exact


# -- speculators + hs-connectors ---------------------------------------------------------------------


def test_speculators_reads_our_export(interop_pre_ds, tmp_path):
    pytest.importorskip("speculators", reason=REASON)
    import datasets
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    export_dataset(interop_pre_ds, "speculators", tmp_path / "data")
    ds = ArrowDataset(max_len=2048, datapath=str(tmp_path / "data"), on_missing="raise")
    ours = rows(interop_pre_ds)
    assert len(ds) == 12 and ds.approx_lengths == [int(r["input_ids"].shape[0]) for r in ours]
    items = []
    for i, r in enumerate(ours):
        item = ds[i]
        items.append(item)
        assert _eq(item["hidden_states"], torch.cat([r["hidden_layer_0"], r["hidden_layer_1"]], dim=-1))
        assert _eq(item["verifier_last_hidden_states"], r["hidden_layer_3"])  # before the norm, as vLLM's
        assert torch.equal(item["input_ids"], r["input_ids"].long())
        assert torch.equal(item["loss_mask"], r["loss_mask"].long())
    batch = CollateFn(max_len=512, hidden_size=H, num_target_layers=2)(items[:3])
    assert batch["hidden_states"].shape == (1, 512, 2 * H)
    # the trainer's vocab mapping input: their own counter gives our token_freq.pt
    save_token_frequency_distribution(datasets.load_from_disk(str(tmp_path / "data")), tmp_path / "freq.pt")
    assert torch.load(tmp_path / "freq.pt", weights_only=True) == torch.load(tmp_path / "data" / "token_freq.pt",
                                                                             weights_only=True)


def _vllm_files(ours: list[dict], data: Path, fp8: bool) -> None:
    """The preprocessed dataset, and hs_<i>.safetensors as vLLM (or hs-connectors' FP8 connector) saves them."""
    import datasets
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].long().tolist() for r in ours],
                                     "loss_mask": [r["loss_mask"].long().tolist() for r in ours],
                                     "seq_len": [int(r["input_ids"].shape[0]) for r in ours]})
    ds.set_format("torch")
    ds.save_to_disk(str(data))
    (data / "hidden_states").mkdir()
    for i, r in enumerate(ours):
        # ExampleHiddenStatesConnector._submit_async_write: [T, num_layers, H] from the KV cache, + token ids;
        # eagle_aux_hidden_state_layer_ids = [1, 2, 4] (launch_vllm.py appends L = 4)
        tensors = {"hidden_states": torch.stack([r[f"hidden_layer_{k}"] for k in PRE_LAYERS], dim=1).contiguous(),
                   "token_ids": torch.tensor(r["input_ids"].tolist())}
        if fp8:  # FP8HiddenStatesConnector._write_tensors
            fp8_hs, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
            tensors = {**tensors, "hidden_states": fp8_hs, SCALES_KEY: scales}
        save_file(tensors, str(data / "hidden_states" / f"hs_{i}.safetensors"))


@pytest.mark.parametrize("fp8", [False, True])
def test_vllm_files_import_with_the_right_labels(fp8, interop_pre_ds, tiny_norm_model, tmp_path):
    pytest.importorskip("hs_connectors", reason=REASON)
    from hs_connectors import FP8Transfer
    from safetensors.torch import load_file

    ours = rows(interop_pre_ds)
    _vllm_files(ours, tmp_path / "data", fp8)
    # vLLM's default ids [2, L//2, L-3] + [L] do not fit 4 layers: the ids used were [1, 2, 4] = ours + 1
    import_dataset(tmp_path / "data", "speculators", tmp_path / "back", model=tiny_norm_model, layers=PRE_LAYERS)
    got = rows(tmp_path / "back")
    assert len(got) == len(ours)  # every file imported, none rejected
    weight = load_file(str(Path(tiny_norm_model) / "model.safetensors"))["model.norm.weight"]
    assert not torch.all(weight == 1)  # a model on which the norm is more than a scale
    theirs = FP8Transfer(tmp_path / "data" / "hidden_states")  # speculators' reader of both kinds of files
    for i, (r, g) in enumerate(zip(ours, got)):
        hs = theirs.get_cached(i)["hidden_states"]  # dequantized by hs-connectors for FP8 files
        for j, k in enumerate(PRE_LAYERS):
            assert _eq(g[f"hidden_layer_{k}"], hs[:, j])  # their last entry is layer L-1, never hidden_final
        assert _eq(g["hidden_final"], rms_norm_reference(hs[:, -1], tiny_norm_model))  # the model's own norm
        assert not torch.equal(bits(g["hidden_final"]), bits(g["hidden_layer_3"]))
        if not fp8:
            assert_same_rows([r], [g], ids=False)  # == the transformers backend's own build, bit for bit


# -- ModelOpt ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def modelopt_eagle_utils():
    """``modelopt.torch.speculative.eagle.utils`` loaded without running ModelOpt's package ``__init__``s.

    Its parents are stand-in packages whose ``__path__`` is the installed one, so only the module and
    the one it imports (``modelopt.torch.utils.loss_mask``) run; ``sys.modules`` is restored after.
    """
    spec = importlib.util.find_spec("modelopt")
    if spec is None:
        pytest.skip(REASON)
    root = Path(spec.submodule_search_locations[0])
    saved = {k: v for k, v in sys.modules.items() if k == "modelopt" or k.startswith("modelopt.")}
    for name in ("modelopt", "modelopt.torch", "modelopt.torch.utils", "modelopt.torch.speculative",
                 "modelopt.torch.speculative.eagle"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = pkg
    try:
        yield importlib.import_module("modelopt.torch.speculative.eagle.utils")
    finally:
        for k in [k for k in sys.modules if k == "modelopt" or k.startswith("modelopt.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_modelopt_reads_our_export(interop_ds, tmp_path, modelopt_eagle_utils):
    export_dataset(interop_ds, "modelopt", tmp_path / "mo")
    files = sorted(str(p) for p in (tmp_path / "mo").rglob("*.pt"))  # as eagle_utils.py lists them
    ds = modelopt_eagle_utils.OfflineSupervisedDataset(files, answer_only_loss=True)
    ours = {r["id"]: r for r in rows(interop_ds)}
    assert len(ds) == 12
    items = [ds[i] for i in range(12)]
    for f, item in zip(files, items):
        r = ours[torch.load(f, weights_only=True)["conversation_id"]]
        assert _eq(item["base_model_hidden_states"], r["hidden_final"]) and item["base_hidden_prenorm"] is False
        assert _eq(item["aux_hidden_states"], torch.cat([r[f"hidden_layer_{k}"] for k in LAYERS], dim=-1))
        assert torch.equal(item["input_ids"], r["input_ids"].long())
        assert torch.equal(item["loss_mask"], r["loss_mask"].long())
    batch = modelopt_eagle_utils.EagleOfflineDataCollator(train_len=256)(items[:4])
    assert batch["base_model_outputs"]["aux_hidden_states"].shape == (4, 256, 3 * H)
    # without answer_only_loss=True (its default) ModelOpt ignores the stored mask, as our docs say
    plain = modelopt_eagle_utils.OfflineSupervisedDataset(files)
    assert all(bool((plain[i]["loss_mask"] == 1).all()) for i in range(12))
    assert all(not bool(r["loss_mask"].all()) for r in ours.values())  # while ours leaves the prompts out


def test_modelopt_hf_dump_imports_with_the_right_labels(tiny_model, tmp_path, modelopt_eagle_utils):
    """compute_hidden_states_hf.py's recipe on the tiny model, dumped with its dict."""
    from transformers import AutoModel

    from hs_dataset.prepare.tokenizer import load_tokenizer

    model = AutoModel.from_pretrained(tiny_model, dtype=torch.bfloat16)
    tok = load_tokenizer(tiny_model)
    aux_ids = [0, 1, 2]  # --aux-layers 0,1,2: hidden_states[lid + 1]
    (tmp_path / "mo").mkdir()
    dumps = []
    for n, text in enumerate(["Hello there, how are you?", "The quick brown fox jumps over the lazy dog again."]):
        input_ids = torch.tensor([tok(text)["input_ids"]])
        with torch.inference_mode():
            hidden_states = model(input_ids=input_ids, output_hidden_states=True).hidden_states
        d = {"input_ids": input_ids.squeeze(0), "hidden_states": hidden_states[-1].squeeze(0),
             "aux_hidden_states": torch.cat([hidden_states[lid + 1].squeeze(0) for lid in aux_ids], dim=-1),
             "loss_mask": torch.ones(input_ids.shape[1], dtype=torch.long), "conversation_id": f"conv-{n}"}
        torch.save(d, tmp_path / "mo" / f"conv-{n}.pt")
        dumps.append(d)
    item = modelopt_eagle_utils.OfflineSupervisedDataset([str(tmp_path / "mo" / "conv-0.pt")])[0]
    assert item["base_hidden_prenorm"] is False  # ModelOpt's reading: post-norm
    import_dataset(tmp_path / "mo", "modelopt", tmp_path / "back", model=tiny_model, layers=aux_ids)
    back = rows(tmp_path / "back")
    assert len(back) == len(dumps)  # every dump imported, none rejected
    for d, g in zip(dumps, back):
        assert g["id"] == d["conversation_id"]
        assert _eq(g["hidden_final"], d["hidden_states"])
        for j, k in enumerate(aux_ids):
            assert _eq(g[f"hidden_layer_{k}"], d["aux_hidden_states"][:, j * H:(j + 1) * H])
