"""versions.py and the in-process engine's configuration against the real ``ServerArgs`` of SGLang 0.5.17 (a
dataclass) and 0.5.23 (a msgspec.Struct whose resolved settings live in SGLang's declarations), each imported in a
child process from the unpacked wheel (``bash .ci/sglang_site.sh`` makes $HS_SGLANG_SITE, default
~/.cache/hs_dataset/sglang-site); and the refusal of an SGLang outside the audited range."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from hs_dataset.capture.sglang.versions import ALLOW_UNTESTED, AUDITED_SGLANG, outside_audited_range
from hs_dataset.capture.transport import MANIFEST
from hs_dataset.errors import BackendError

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("HS_SGLANG_SITE", Path.home() / ".cache" / "hs_dataset" / "sglang-site"))


def run_against(version: str, model: str) -> dict:
    site = SITE / version
    if not (site / "sglang").is_dir():
        pytest.skip(f"SGLang {version} is not unpacked at {site}: bash .ci/sglang_site.sh")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(site), str(SITE / "deps")]))
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_server_args_run.py")), model],
                       env=env, capture_output=True, text=True, timeout=300)
    if r.returncode and "No module named 'torchvision'" in r.stderr:
        pytest.skip(f"SGLang {version}'s package imports torchvision, whose PyPI wheel needs a CUDA torch (0.5.22 and "
                    "0.5.23 import without it): its ServerArgs runs on the GPU device (tests/gpu)")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version, kind", [("0.5.17", "type"), ("0.5.23", "StructMeta")])
def test_the_engine_configuration_runs_against_the_real_server_args(version, kind, tiny_model):
    got = run_against(version, tiny_model)
    assert got["version"] == got["check"] == version and got["kind"] == kind and got["fields"] > 300
    assert got["passed"] == {"cuda_graph_backend_prefill": "disabled", "sigquit": True, "chunked": 64,
                             "radix_off": True}
    assert got["unknown"] == (f"backend_options.engine_args: SGLang {version} has no setting 'no_such_setting' "
                              "(see python -m sglang.launch_server --help)")
    raw = got["raw"]
    assert (raw["dp_old"], raw["dp_off"], raw["prefill"], raw["prefill_off"], raw["chunked"]) == (2, 1, "breakable",
                                                                                                   None, 512)
    assert raw["dp_new"] == (2 if version == "0.5.23" else None)


def test_the_guards_read_what_sglang_0_5_23_resolved(tiny_model):
    """From 0.5.19 the fields keep the caller's None and SGLang's resolution declares the values (what the pipeline
    does on CUDA: prefill graphs on, a chunk size, DP attention from attn_dp_size): the accessors read the
    declarations, after the pickle that takes the record to the scheduler, and the plugin refuses DP attention."""
    got = run_against("0.5.23", tiny_model)
    d = got["declared"]
    assert d["fields"] == [None, None]  # reading the fields, the guards would pass
    assert (d["chunked"], d["prefill"], d["dp"]) == (8192, "breakable", 4)
    assert got["refused"].startswith("DP attention (4 ranks: --attn-dp-size / --enable-dp-attention) is not supported")


@pytest.mark.parametrize("version", ["0.5.13", "0.5.24", "0.6.0"])
def test_an_untested_sglang_is_refused_with_the_range_and_the_opt_in(version):
    line = outside_audited_range(version)
    assert line is not None and "\n" not in line
    assert f"SGLang {version} is outside the releases" in line and AUDITED_SGLANG in line
    assert "--set backend_options.allow_untested_sglang=true" in line and ALLOW_UNTESTED in line
    assert outside_audited_range("0.5.17.post1") is None and outside_audited_range("0.5.23") is None


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_an_attached_server_outside_the_range_is_refused_unless_allowed(tiny_model):
    """Attach mode: the server's SGLang version comes from its plugin's manifest; the builder refuses it in one
    line unless backend_options.allow_untested_sglang (then it goes on to the start-up self-check)."""
    from hs_dataset.capture.sglang.backend import SGLangBackend
    from hs_dataset.model_info import read_model_info

    tmp_path = Path(tempfile.mkdtemp(prefix="hs-test-", dir="/dev/shm"))  # the ring's folder: a memory file system
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    hidden = read_model_info(tiny_model).hidden_size
    (tmp_path / MANIFEST).write_text(json.dumps({"sglang_version": "0.5.24", "layers": [1], "hidden_size": hidden,
                                                 "tp_size": 1}))
    try:
        with pytest.raises(BackendError) as e:
            SGLangBackend(tiny_model, [1], sglang_url=url, ring_dir=str(tmp_path), ring_bytes=1 << 20)
        assert str(e.value).startswith("the attached server's SGLang 0.5.24 is outside the releases hs_dataset's "
                                       f"capture is audited for ({AUDITED_SGLANG})")
        with pytest.raises(BackendError, match="self-check") as e:  # allowed: on to the self-check (no engine here)
            SGLangBackend(tiny_model, [1], sglang_url=url, ring_dir=str(tmp_path), ring_bytes=1 << 20,
                          allow_untested_sglang=True, request_timeout=2)
        assert str(e.value).startswith("SGLang 0.5.24 rejected the start-up self-check's warm-up prompt")
    finally:
        server.shutdown()
        shutil.rmtree(tmp_path, ignore_errors=True)
