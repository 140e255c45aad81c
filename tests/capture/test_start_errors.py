"""An SGLang backend that cannot start says why in one line (issue 29), for what can be provoked without a
GPU: attach mode with no server at the URL, a server that answers but runs no hs_dataset plugin, and an
in-process engine without SGLang installed. Through the real CLI: exit 2, no traceback, the fix named."""

from __future__ import annotations

import http.server
import json
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from tests.fixtures.builds import DEMO
from tests.fixtures.cli import run, user_error


def script(tmp_path: Path, model: str, **options: object) -> Path:
    config = {"model": model, "layers": [0, 1, 2], "source": str(DEMO), "max_length": 256, "backend": "sglang",
              "max_samples": 4, "backend_options": options}
    p = tmp_path / "s.py"
    p.write_text(f"import json\n\nCONFIG = json.loads({json.dumps(json.dumps(config))})\n")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ring_dir():
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="hs-test-ring-", dir=base) as d:
        yield d


def test_attach_with_nothing_at_the_url(tiny_model, tmp_path, ring_dir):
    url = f"http://127.0.0.1:{free_port()}"
    r = run("build", str(script(tmp_path, tiny_model, sglang_url=url, ring_dir=ring_dir)), "-o", str(tmp_path / "o"))
    user_error(r, "cannot reach the SGLang server at " + url, "backend_options.sglang_url")


def test_attach_to_a_server_without_the_plugin(tiny_model, tmp_path, ring_dir):
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = run("build", str(script(tmp_path, tiny_model, sglang_url=url, ring_dir=ring_dir)), "-o",
                str(tmp_path / "o"))
    finally:
        server.shutdown()
    user_error(r, f"the SGLang server at {url} answers, but no hs_dataset plugin reported ready in {ring_dir}",
               "HS_DATASET_CAPTURE")


def test_an_in_process_engine_without_sglang(tiny_model, tmp_path):
    pytest.importorskip("torch")
    try:
        import sglang  # noqa: F401
        pytest.skip("SGLang is installed here: this is the CPU machine's case")
    except ImportError:
        pass
    r = run("build", str(script(tmp_path, tiny_model)), "-o", str(tmp_path / "o"))
    user_error(r, "needs SGLang", "pip install 'hs-dataset[sglang]'")
