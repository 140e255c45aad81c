"""The start-up self-check of the capture convention against real SGLang (issue 47, item 4), on a CUDA GPU with
SGLang installed (the device runs SGLang 0.5.17). What it shows:

* the plugin's capture of every layer (the aux capture at ``layers_to_capture = k + 1``, the last layer from the
  final norm's residual) and of ``hidden_final`` equals, bit for bit, what PyTorch forward hooks on SGLang's own
  decoder layers and final norm saw in the same pass, for Llama, DeepSeek-V3 and Kimi-K2.5's wrapper, in-process
  and attached to ``python -m sglang.launch_server``;
* a capture deliberately shifted by one layer (the plugin told to capture layers 2, 4, 7, the states labelled as
  1, 3, 6) is caught with one line naming the layer really captured;
* a build records the SGLang version, the capture convention and the self-check's result in hs_dataset.json and
  the dataset card.

Run on the device, from the repository root (figures in $OUT/gpu_selfcheck.json):

    source .gpu/device-setup.sh && python3 -m pip install --no-deps --no-build-isolation --no-index -e . \\
        && python -m pytest -m gpu -v -rs tests/gpu/test_selfcheck.py

or ``bash tests/gpu/device.sh selfcheck 570 tests/gpu/test_selfcheck.py``. About 3-4 minutes (five engine starts).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.models import GPU_MARKS
from tests.gpu.test_sglang import ENGINE_ARGS, RING, launched_server, shm_dir, wait_for_gpu_memory

pytestmark = GPU_MARKS

REPORT = Path(os.environ.get("OUT", "/tmp")) / "gpu_selfcheck.json"
_report: dict = {}
LAYERS = {"llama": (0, 1, 3, 7), "dsv3": (0, 1, 2, 3), "kimi": (0, 2, 3)}  # each with L-1: the pre-norm last layer


def _dump() -> None:
    REPORT.write_text(json.dumps(_report, indent=1))


@pytest.mark.parametrize("arch", ["llama", "dsv3", "kimi"])
def test_the_selfcheck_passes_in_process(models, arch):
    """SGLangBackend runs the self-check at start; every captured state equals its decoder layer's output."""
    import sglang

    from hs_dataset.capture.sglang.backend import CONVENTION, SGLangBackend

    be = SGLangBackend(models[arch], LAYERS[arch], ring_bytes=RING, engine_args=ENGINE_ARGS,
                       trust_remote_code=arch == "kimi")
    try:
        line, versions = be.selfcheck, be.versions()
    finally:
        be.close()
        wait_for_gpu_memory()
    _report[f"in-process/{arch}"] = {"sglang": sglang.__version__, "selfcheck": line}
    _dump()
    names = ", ".join(f"layer {k}" for k in LAYERS[arch])
    assert line.startswith(f"passed: {names}, final equal"), line
    assert versions["sglang"] == sglang.__version__ and versions["sglang self-check"] == line
    assert versions["sglang capture convention"] == CONVENTION


def test_a_shifted_capture_is_caught_on_real_sglang(models):
    """The plugin captures layers 2, 4, 7 of the tiny Llama through a ring, with the self-check's hooks on; labelled
    as they are, the states pass; labelled as layers 1, 3, 6 (a capture shifted by one), the check stops with one
    line naming layer 2."""
    import sglang
    import sglang as sgl

    from hs_dataset.capture.selfcheck import (FINAL, SelfCheckError, check_capture, selfcheck_file,
                                              warmup_ids)
    from hs_dataset.capture.transport import ENV, Ring

    ring = Ring.create(shm_dir(), 64 << 20)
    os.environ[ENV] = json.dumps({"layers": [2, 4, 7], "dir": str(ring.path.parent), "ring": ring.token})
    try:
        eng = sgl.Engine(model_path=models["llama"], skip_tokenizer_init=True, **ENGINE_ARGS)
        try:
            ids = warmup_ids(32000)
            selfcheck_file(ring.path.parent, ring.token, "want").write_text("")
            lease = ring.reserve(len(ids), 4, 512, "bfloat16")
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                         rid=ring.rid(lease, "hsds-"))
            ring.wait(lease, timeout=60)
            deadline = time.time() + 60
            ref_file = selfcheck_file(ring.path.parent, ring.token, "pt")
            while not ref_file.exists() and time.time() < deadline:
                time.sleep(0.1)
        finally:
            eng.shutdown()
            wait_for_gpu_memory()
    finally:
        os.environ.pop(ENV, None)
    states, _ = ring.views(lease)
    states = states.clone()
    ring.close()
    reference = torch.load(ref_file, weights_only=True)
    engine = f"SGLang {sglang.__version__}"
    right = check_capture(engine, {2: states[0], 4: states[1], 7: states[2], FINAL: states[3]}, reference)
    with pytest.raises(SelfCheckError) as e:
        check_capture(engine, {1: states[0], 3: states[1], 6: states[2], FINAL: states[3]}, reference)
    _report["shifted"] = {"sglang": sglang.__version__, "as_captured": right, "shifted": str(e.value)}
    _dump()
    assert right.startswith("passed: layer 2, layer 4, layer 7, final equal")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"{engine} captured the output of layer 2 where hs_dataset records layer 1: ")


def test_the_selfcheck_runs_when_attached_to_a_launched_server(models):
    """Attach mode: the builder's first request on its ring is the warm-up prompt; the server's plugin keeps the
    reference states in the shared ring folder; the server's SGLang version comes from its manifest."""
    import sglang

    from hs_dataset.capture.sglang.backend import SGLangBackend

    ring_dir = shm_dir()
    with launched_server(models["llama"], [1, 3, 7], ring_dir) as url:
        be = SGLangBackend(models["llama"], (1, 3, 7), sglang_url=url, ring_dir=str(ring_dir), ring_bytes=RING)
        line, version = be.selfcheck, be.sglang_version
        be.close()
        assert not list(ring_dir.glob("selfcheck-*"))  # the builder removed the self-check's files
    _report["attach"] = {"sglang": version, "selfcheck": line}
    _dump()
    assert version == sglang.__version__
    assert line.startswith("passed: layer 1, layer 3, layer 7, final equal"), line


def test_a_build_records_the_version_convention_and_selfcheck(models, tmp_path):
    import sglang

    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.demo.tiny import make_tiny_tokenizer
    from hs_dataset.write.driver import build

    make_tiny_tokenizer(models["llama"], template="chatml")
    src = Path(__file__).resolve().parents[2] / "builder_scripts" / "data" / "demo_conversations.jsonl"
    cfg = HiddenStatesConfig(model=models["llama"], layers=(1, 3, 7), source=str(src), max_length=512,
                             backend="sglang", part_size=16, max_samples=8,
                             backend_options={"ring_bytes": RING, "engine_args": ENGINE_ARGS})
    build(cfg, tmp_path / "out", progress=False)
    wait_for_gpu_memory()
    versions = json.loads((tmp_path / "out" / "hs_dataset.json").read_text())["backend"]["versions"]
    card = (tmp_path / "out" / "README.md").read_text()
    _report["build"] = {k: v for k, v in versions.items() if k.startswith("sglang")}
    _dump()
    assert versions["sglang"] == sglang.__version__
    assert versions["sglang self-check"].startswith("passed: layer 1, layer 3, layer 7, final equal")
    assert "layers_to_capture = k + 1" in versions["sglang capture convention"]
    assert "sglang self-check" in card and "passed: layer 1, layer 3, layer 7" in card
