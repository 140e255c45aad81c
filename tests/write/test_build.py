"""The CPU pipeline end to end: builder + transformers backend -> Arrow shards -> load_dataset -> reader."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch

from hs_dataset.write.builder import writer_batch_rows
from hs_dataset.write.resolve import ResolvedBuild
from hs_dataset.write.driver import build
from hs_dataset.capture.transformers import TransformersBackend
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ConfigMismatchError
from hs_dataset.model_info import read_model_info
from hs_dataset.read.collate import DrafterCollator
from hs_dataset.read.decode import decode_row
from hs_dataset.read.iterate import iter_torch
from hs_dataset.records import CaptureResult
from tests.fixtures import builds as buildtools
from tests.fixtures.builds import DEMO, LAYERS, ROOT, content_hash


def config(model: str, **kw) -> HiddenStatesConfig:
    """The shared small build, in parts of 8 over the first 20 demo conversations."""
    return buildtools.config(model, **{"part_size": 8, "max_samples": 20, **kw})


class Tap:
    """Passes a real backend's results through unchanged and keeps a copy of each (the ground truth)."""

    def __init__(self, backend):
        self.backend, self.seen = backend, {}
        self.name, self.info, self.layers = backend.name, backend.info, backend.layers

    def capture(self, samples):
        for item in self.backend.capture(samples):
            if isinstance(item, CaptureResult):
                self.seen[item.sample.sample_id] = item.states.clone()
            yield item

    def versions(self):
        return self.backend.versions()

    def close(self):
        self.backend.close()


def test_states_read_back_are_bit_identical_to_the_backend(tiny_model, tmp_path):
    tap = Tap(TransformersBackend(tiny_model, LAYERS, device="cpu", batch_tokens=2048))
    cfg = config(tiny_model)
    summary = build(cfg, tmp_path / "out", backend=tap, progress=False)
    assert tap.seen.pop("hs_dataset-model-probe") is not None  # the model fingerprint's probe, captured first
    assert summary.counts.written == len(tap.seen) > 0
    for streaming in (False, True):
        ds = datasets.load_dataset(str(tmp_path / "out"), split="train", streaming=streaming)
        n = 0
        for row in iter_torch(ds, batch_size=3):
            ref = tap.seen[row["id"]]
            for j, col in enumerate([f"hidden_layer_{k}" for k in LAYERS] + ["hidden_final"]):
                assert row[col].dtype == torch.bfloat16
                assert torch.equal(row[col].view(torch.int16), ref[j].view(torch.int16)), (row["id"], col)
            n += 1
        assert n == summary.counts.written
    meta = json.loads((tmp_path / "out" / "hs_dataset.json").read_text())
    assert meta["storage_dtype"] == "bfloat16" and meta["layers"] == list(LAYERS)
    assert "output of decoder layer k" in meta["layer_convention"]
    assert meta["model"]["hidden_size"] == 64


def test_map_style_row_access_decodes_the_stored_bits(tiny_model, tmp_path):
    build(config(tiny_model, max_samples=4), tmp_path / "out", progress=False)
    ds = datasets.load_dataset(str(tmp_path / "out"), split="train")
    table = ds.with_format("arrow")[2]
    row = decode_row(table)
    stored = torch.tensor(table.column("hidden_final").to_pylist()[0], dtype=torch.int32)  # the uint16 bits
    # the stored bf16 bits, not upcast; a small state is a copy (a large one a private mapping of the
    # shard bytes: tests/read/test_reader.py), so writing to it leaves the table as it was
    t = row["hidden_final"]
    assert t.dtype == torch.bfloat16 and t.shape == (ds[2]["num_tokens"], 64)
    assert torch.equal(t.view(torch.uint16).to(torch.int32), stored)
    t.mul_(2)
    assert torch.equal(decode_row(table)["hidden_final"].view(torch.uint16).to(torch.int32), stored)


def test_batched_capture_equals_one_sample_at_a_time(tiny_model):
    """Right padding never reaches a real token under the causal mask, so batched and single runs
    compute the same function; they differ only where a bf16 kernel (masked vs unmasked SDPA,
    GEMMs blocked by batch size) rounds an intermediate the other way. Tolerance: >= 99% of the
    values bit-identical, and every difference within 2^-5 of the token's largest magnitude
    (a flipped bf16 rounding step, 2^-8 relative, amplified through at most 4 layers; measured
    max 0.016)."""
    from hs_dataset.prepare.conversations import parse_row
    from hs_dataset.prepare.loss_mask import tokenize_sample
    from hs_dataset.prepare.sources import iter_source
    from hs_dataset.prepare.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model)
    samples = [tokenize_sample(parse_row(r), tok, max_length=256) for r in iter_source(str(DEMO), stop=12)]
    assert len({s.num_tokens for s in samples}) > 3  # mixed lengths, so batches are padded
    batched = list(TransformersBackend(tiny_model, LAYERS, device="cpu", batch_tokens=1 << 20).capture(samples))
    single = list(TransformersBackend(tiny_model, LAYERS, device="cpu", batch_tokens=1).capture(samples))
    for j in range(len(LAYERS) + 1):
        a = torch.cat([x.states[j] for x in batched]).float()
        b = torch.cat([x.states[j] for x in single]).float()
        d = (a - b).abs()
        assert (d == 0).float().mean().item() >= 0.99, j
        assert (d / b.abs().amax(dim=-1, keepdim=True)).max().item() <= 2**-5, j


def test_writer_batches_are_sized_by_bytes_for_kimi_shapes(tmp_path):
    model = tmp_path / "kimi"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
                                                   "num_hidden_layers": 61, "vocab_size": 163840}))

    def rows(**kw):
        cfg = HiddenStatesConfig(model=str(model), layers=(3, 31, 59), source=str(DEMO), max_length=2048, **kw)
        info = read_model_info(str(model))  # no tokenizer: the batch size does not depend on it
        return writer_batch_rows(ResolvedBuild(cfg, info, cfg.layers, tokenizer=None, tokenizer_record={}))

    # 117 MB per 2048-token sample (4 states x 7168 x bf16): by default each sample is its own record
    # batch (no concatenation copy); a larger budget groups rows, never past the budget or the
    # 32-bit Array2D offsets, and never datasets' default of 1000 rows (117 GB).
    assert rows() == 1
    assert rows(writer_batch_bytes=256 * 2**20) == 2
    big = rows(writer_batch_bytes=2**40)
    assert big * 2048 * 7168 < 2**31 and big == (2**31 - 1) // (2048 * 7168)


def test_rejects_are_counted_and_named(tiny_model, tmp_path):
    src = tmp_path / "mixed.jsonl"
    lines = DEMO.read_text().splitlines()[:5]
    lines += ['{"conversations": []}', '{"messages": [{"role": "wizard", "content": "hi"}]}', "not json",
              '{"input_ids": [1, 2, 99999999]}']
    src.write_bytes(("\n".join(lines) + "\n").encode() + b'{"messages": "\xff\xfe"}\n')
    s = build(config(tiny_model, source=str(src), max_samples=None), tmp_path / "out", progress=False)
    assert (s.counts.samples_in, s.counts.written, s.counts.rejected) == (10, 5, 5)
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 5
    assert all(r["sample_id"].startswith("mixed:") and r["field"] and r["reason"] for r in rejects)
    assert any(r["field"].startswith("input_ids[2]") for r in rejects)
    meta = json.loads((tmp_path / "out" / "hs_dataset.json").read_text())
    assert meta["counts"]["rejected"] == 5 and meta["counts"]["written"] == 5


def test_parts_commit_side_by_side_in_any_order_and_the_sink_hears_them_in_order(tiny_model, tmp_path,
                                                                                     monkeypatch):
    """Several parts commit at once (their shard writes overlap the next parts'); a later part may be recorded
    first; the recorded hashes, computed by the shards' writers, are the files' own; the rows are the same."""
    import threading
    import time

    from hs_dataset.integrity.checksums import file_digest
    from hs_dataset.integrity.verify import verify_build
    from hs_dataset.write import parts

    active, most, order, lock = [0], [0], [], threading.Lock()
    fsync = parts.fsync_file

    def slow_fsync(path):  # the first part's commit is the slowest: later ones are recorded before it
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.6 if "part-00000" in str(path) else 0.2)
        fsync(path)
        with lock:
            active[0] -= 1

    record = parts.atomic_write

    def noting_record(path, text):
        record(path, text)
        if path.parent.name == "parts":
            order.append(path.name)

    class Sink:
        def __init__(self):
            self.parts = []

        def start(self, out, parts_, done): ...

        def row(self, part, index, sample_id, table): ...

        def generated(self, part, rows): ...

        def committed(self, part):
            self.parts.append(part)

        def end(self, finished): ...

    monkeypatch.setattr(parts, "fsync_file", slow_fsync)
    monkeypatch.setattr(parts, "atomic_write", noting_record)
    sink = Sink()
    out = tmp_path / "out"
    s = build(config(tiny_model, part_size=4), out, progress=False, sink=sink)
    assert s.parts_built == 5 and most[0] >= 2, most
    assert order != sorted(order), order  # a later part recorded before the first
    assert sink.parts == [0, 1, 2, 3, 4]
    meta = json.loads((out / "hs_dataset.json").read_text())
    assert all(f["xxh3_128"] == file_digest(out / "data" / f["name"]) for f in meta["shards"])
    assert verify_build(out).ok
    monkeypatch.undo()
    ref = tmp_path / "ref"
    build(config(tiny_model, part_size=4), ref, progress=False)
    assert content_hash(out) == content_hash(ref)


def test_a_build_shortens_the_gil_switch_interval_and_restores_it(tiny_model, tmp_path):
    """The statistics threads take the GIL back after every numpy call: during a build the switch interval
    is SWITCH_INTERVAL_S (benchmarks/stats_overhead.py --threads), and the caller's value comes back after it,
    also after a failed build."""
    import sys

    from hs_dataset.write.driver import SWITCH_INTERVAL_S

    seen = []

    class Watch(Tap):
        def capture(self, samples):
            seen.append(sys.getswitchinterval())
            yield from super().capture(samples)

    before = sys.getswitchinterval()
    backend = Watch(TransformersBackend(tiny_model, LAYERS))
    try:
        build(config(tiny_model, max_samples=4), tmp_path / "out", backend=backend, progress=False)
        assert seen and all(x == SWITCH_INTERVAL_S for x in seen) and SWITCH_INTERVAL_S < before
        assert sys.getswitchinterval() == before
        with pytest.raises(ConfigMismatchError):
            build(config(tiny_model, max_samples=4, layers=(0, 2)), tmp_path / "out", backend=backend, progress=False)
        assert sys.getswitchinterval() == before
    finally:
        backend.close()


def test_resume_skips_done_parts_and_refuses_a_changed_config(tiny_model, tmp_path):
    out = tmp_path / "out"
    first = build(config(tiny_model), out, progress=False)
    again = build(config(tiny_model), out, progress=False)
    assert again.parts_built == 0 and again.parts_skipped == first.parts_built
    more = build(config(tiny_model, max_samples=30), out, progress=False)  # grows: the last, short part is redone
    assert more.counts.samples_in == 30 and more.parts_built == 2
    ref = tmp_path / "ref"
    build(config(tiny_model, max_samples=30), ref, progress=False)
    assert content_hash(out) == content_hash(ref)
    with pytest.raises(ConfigMismatchError, match="layers"):
        build(config(tiny_model, layers=(0, 2)), out, progress=False)


def test_collator_pads_and_concatenates_aux_layers(tiny_model, tmp_path):
    build(config(tiny_model, max_samples=4), tmp_path / "out", progress=False)
    samples = list(iter_torch(datasets.load_dataset(str(tmp_path / "out"), split="train")))
    batch = DrafterCollator()(samples)
    T = max(int(s["input_ids"].shape[0]) for s in samples)
    assert batch["aux_hidden_states"].shape == (4, T, 3 * 64) and batch["hidden_states"].shape == (4, T, 64)
    s1 = samples[1]
    n = int(s1["input_ids"].shape[0])
    assert torch.equal(batch["aux_hidden_states"][1, :n, 64:128], s1["hidden_layer_1"])
    assert batch["attention_mask"][1].sum() == n and batch["hidden_states"][1, n:].abs().sum() == 0
    assert torch.equal(batch["loss_mask"][1, :n], s1["loss_mask"].long())


def test_cli_demo_build_inspect_and_datasets_cli_test(tiny_model, tmp_path):
    out = tmp_path / "demo"
    env_model = f"model={tiny_model}"
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "build", str(ROOT / "builder_scripts" / "tiny_demo.py"),
                        "--output", str(out), "--set", env_model, "--set", "max_samples=12", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "12 samples written" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "inspect", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "bfloat16" in r.stdout and "12 written" in r.stdout
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".hs_build"))
    r = subprocess.run(["datasets-cli", "test", str(copy), "--save_info", "--all_configs",
                        "--cache_dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert datasets.load_dataset(str(copy), split="train").num_rows == 12


def test_fp8_storage_decodes_to_bf16_within_its_error(tiny_model, tmp_path):
    build(config(tiny_model, max_samples=6, storage_dtype="fp8_e4m3"), tmp_path / "fp8", progress=False)
    build(config(tiny_model, max_samples=6), tmp_path / "bf16", progress=False)
    a = list(iter_torch(datasets.load_dataset(str(tmp_path / "fp8"), split="train")))
    b = list(iter_torch(datasets.load_dataset(str(tmp_path / "bf16"), split="train")))
    for x, y in zip(a, b):
        for c in ("hidden_layer_1", "hidden_final"):
            assert x[c].dtype == torch.bfloat16
            rel = (x[c].float() - y[c].float()).abs() / y[c].float().abs().amax(dim=-1, keepdim=True)
            assert rel.max().item() <= 2**-3  # e4m3: 3 mantissa bits, per-token scale
    assert np.isclose(sum(f.stat().st_size for f in (tmp_path / "fp8" / "data").iterdir())
                      / sum(f.stat().st_size for f in (tmp_path / "bf16" / "data").iterdir()), 0.5, atol=0.1)


def test_one_capture_stream_across_parts_gives_the_same_rows_and_rejects(tiny_model, tmp_path):
    """A continuously batching backend (SGLang) is fed one capture call across all parts; each part
    must still get exactly its own rows and rejects. Checked with the transformers backend run one
    sample at a time (so batching cannot change a bit) switched into that mode."""
    src = tmp_path / "mixed.jsonl"
    lines = DEMO.read_text().splitlines()[:14]
    for k in (1, 6, 7, 13):  # bad rows at a part's start, middle and end (parts of 4 rows)
        lines[k] = '{"messages": [{"role": "wizard", "content": "hi"}]}'
    src.write_text("\n".join(lines) + "\n")
    per_part = build(config(tiny_model, source=str(src), part_size=4, max_samples=None,
                            backend_options={"device": "cpu", "batch_tokens": 1}), tmp_path / "a", progress=False)
    be = TransformersBackend(tiny_model, LAYERS, device="cpu", batch_tokens=1)
    be.continuous = True
    streamed = build(config(tiny_model, source=str(src), part_size=4, max_samples=None), tmp_path / "b",
                     backend=be, progress=False)
    assert (streamed.counts.written, streamed.counts.rejected) == (per_part.counts.written, per_part.counts.rejected)
    assert streamed.counts.rejected == 4
    assert (tmp_path / "a" / "rejects.jsonl").read_text() == (tmp_path / "b" / "rejects.jsonl").read_text()
    assert content_hash(tmp_path / "a") == content_hash(tmp_path / "b")
    parts = sorted((tmp_path / "b" / ".hs_build" / "parts").glob("part-*.json"))
    assert [json.loads(p.read_text())["counts"]["samples_in"] for p in parts] == [4, 4, 4, 2]


def test_ids_the_model_cannot_embed_are_rejected_not_crashing_the_batch(tiny_model, tmp_path):
    """A tokenizer larger than the model's embedding table (a mismatched pair): ids past the
    model's vocab_size are rejects naming the position, the other samples are written."""
    from hs_dataset.prepare.tokenizer import load_tokenizer

    model = tmp_path / "bigger-tokenizer"
    shutil.copytree(tiny_model, model)
    tok = load_tokenizer(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    assert len(tok) == vocab
    tok.add_tokens(["<|extra|>"])  # the tokenizer now knows id `vocab`, the model has no row for it
    tok.save_pretrained(model)
    src = tmp_path / "raw.jsonl"
    src.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n" + json.dumps({"input_ids": [5, vocab, 7]}) + "\n")
    s = build(config(str(model), source=str(src), max_samples=None), tmp_path / "out", progress=False)
    assert (s.counts.written, s.counts.rejected) == (1, 1)
    (r,) = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert r["field"] == "input_ids[1]" and f"vocabulary of size {vocab}" in r["reason"]
