"""A changed model is never mixed into one build: the model's fingerprint (hs_dataset.model_info's of the weight files'
sizes, safetensors headers, sampled bytes; hs_dataset.capture.fingerprint's of the probe prompt's captured states,
both checked by hs_dataset.write.build_key) refuses a resume, a worker share
and a merge of other weights with the same shapes, and weights overwritten while a build runs stop it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hs_dataset.capture.transformers import TransformersBackend
from hs_dataset.demo.tiny import make_tiny_model_dir
from hs_dataset.errors import ConfigMismatchError, ShareError
from hs_dataset.layout import META_FILE, STATE_DIR
from hs_dataset.capture.fingerprint import probe_fingerprint, same_probe
from hs_dataset.model_info import weights_fingerprint
from hs_dataset.scale.merge import merge_shares
from hs_dataset.scale.worker import build_share
from hs_dataset.write.driver import build
from hs_dataset.write.shares import WorkerShare, share_dir
from tests.fixtures.builds import LAYERS, config

FP = r"w:[0-9a-f]{24}/p:[0-9a-f]{24}"


def _model(tmp_path: Path, name: str, seed: int) -> Path:
    return make_tiny_model_dir(tmp_path / name, template="chatml", seed=seed)


def test_resume_with_other_weights_of_the_same_shapes_is_refused_naming_both(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(_model(tmp_path, "a", 0), model)
    other = _model(tmp_path, "b", 1)
    out = tmp_path / "out"
    build(config(str(model), max_samples=8), out, progress=False)
    meta = json.loads((out / META_FILE).read_text())
    assert re.fullmatch(r"w:[0-9a-f]{24}", meta["model_fingerprint"]["weights"])
    assert re.fullmatch(r"p:[0-9a-f]{24}", meta["model_fingerprint"]["probe"])
    before = weights_fingerprint(model)
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")  # same shapes, other weights
    assert weights_fingerprint(model) != before
    with pytest.raises(ConfigMismatchError, match=f"holds rows of another model: fingerprint {FP} there, "
                                                  r"w:[0-9a-f]{24}/p:none now"):
        build(config(str(model), max_samples=12), out, progress=False)  # a larger max_samples: a resume
    assert json.loads((out / META_FILE).read_text()) == meta  # nothing touched


def test_the_probe_tells_weights_the_samples_miss(tmp_path):
    a, b = _model(tmp_path, "a", 0), _model(tmp_path, "b", 1)
    pa, pb = (probe_fingerprint(TransformersBackend(str(m), LAYERS, device="cpu")) for m in (a, b))
    again = probe_fingerprint(TransformersBackend(str(a), LAYERS, device="cpu"))
    assert pa is not None and pb is not None and again is not None
    assert pa["digest"] == again["digest"] and same_probe(pa, again)
    assert pa["digest"] != pb["digest"] and not same_probe(pa, pb)
    # the probe is compared on resume even where the weight files' fingerprint matches (a build before it existed)
    out = tmp_path / "out"
    build(config(str(a), max_samples=8), out, progress=False)
    key = json.loads((out / STATE_DIR / "build.json").read_text())
    key["model_probe"] = pb
    (out / STATE_DIR / "build.json").write_text(json.dumps(key))
    with pytest.raises(ConfigMismatchError, match=f"holds rows of another model: fingerprint {FP} there, {FP} now"):
        build(config(str(a), max_samples=12), out, progress=False)


def test_a_share_of_other_weights_is_refused_by_the_merge(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(_model(tmp_path, "a", 0), model)
    out = tmp_path / "out"
    cfg = config(str(model), max_samples=8)
    build_share(cfg, out, WorkerShare(0, 2), progress=False, merge=False)
    shutil.copyfile(_model(tmp_path, "b", 1) / "model.safetensors", model / "model.safetensors")
    build_share(cfg, out, WorkerShare(1, 2), progress=False, merge=False)
    with pytest.raises(ShareError, match=r"another configuration .*model_weights: 'w:[0-9a-f]{24}' instead of "
                                         r"'w:[0-9a-f]{24}'"):
        merge_shares(out)
    assert not (out / META_FILE).exists()
    # the share itself refuses to resume on the other weights
    shutil.copyfile(_model(tmp_path, "a", 0) / "model.safetensors", model / "model.safetensors")
    with pytest.raises(ConfigMismatchError, match="holds rows of another model"):
        build_share(cfg, out, WorkerShare(1, 2), progress=False, merge=False)
    assert share_dir(out, WorkerShare(1, 2)).is_dir()


class _Overwriting:
    """The transformers backend, and the model's weights overwritten in place once it has captured ``after``
    samples (what ``cp other/model.safetensors model/`` does while a build runs)."""

    def __init__(self, inner: TransformersBackend, target: Path, source: Path, after: int):
        self.inner, self.target, self.source, self.after = inner, target, source, after
        self.name, self.info, self.layers, self.continuous = inner.name, inner.info, inner.layers, False
        self.encodings = ("bfloat16",)
        self.seen = 0

    def capture(self, samples, **kw):
        for item in self.inner.capture(samples, **kw):
            self.seen += 1
            if self.seen == self.after:
                with open(self.target, "r+b") as f:  # in place: the same inode, as cp does
                    f.write(self.source.read_bytes())
            yield item

    def versions(self):
        return self.inner.versions()

    def close(self):
        self.inner.close()


def test_weights_overwritten_while_a_build_runs_stop_it(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(_model(tmp_path, "a", 0), model)
    other = _model(tmp_path, "b", 1) / "model.safetensors"
    out = tmp_path / "out"
    inner = TransformersBackend(str(model), LAYERS, device="cpu", batch_tokens=2048)
    backend = _Overwriting(inner, model / "model.safetensors", other, after=1 + 6)  # the probe, then part 1's 2nd
    with pytest.raises(ConfigMismatchError, match=r"the weights in .* changed while the build ran .*part [0-9]+ is "
                                                  "discarded"):
        build(config(str(model), max_samples=12), out, backend=backend, progress=False)
    assert sorted(p.name for p in (out / STATE_DIR / "parts").glob("part-*.json")) == ["part-00000.json"]
    with pytest.raises(ConfigMismatchError, match="holds rows of another model"):
        build(config(str(model), max_samples=12), out, progress=False)
