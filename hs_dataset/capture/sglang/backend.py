"""SGLang capture backend: prefill-only requests to a patched SGLang engine, states through a
shared-memory ring (:mod:`hs_dataset.capture.transport`), one ring client over either way of reaching
SGLang.

Two ways to reach SGLang:

* in-process (default, :mod:`hs_dataset.capture.sglang.engine`): starts ``sglang.Engine`` with
  ``HS_DATASET_CAPTURE`` set, so the hs_dataset plugin (:mod:`hs_dataset.capture.sglang.plugin`) loads
  in every scheduler / TP process; the ring lives in a private folder ``<ring_dir>/hs_dataset-<id>``
  (``ring_dir`` default /dev/shm);
* attach (``sglang_url=...``, :mod:`hs_dataset.capture.sglang.attach`): a server already started with
  the plugin, e.g.::

      HS_DATASET_CAPTURE='{"layers": [3, 31, 59], "dir": "/dev/shm/hs"}' \\
          python -m sglang.launch_server --model-path M --tp 8 --disable-radix-cache --skip-tokenizer-init

  plus ``ring_dir`` naming the same folder (both must reach it: one machine). Several builders can
  attach to one server at once; each has its own ring file in that folder.

Each sample is one request with ``max_new_tokens=1`` and a request id naming the ring and the
request's slot; before it is submitted, its region of the ring is reserved, so at most
``max_inflight`` requests and at most ``ring_bytes`` of states are in flight. Results are yielded in
input order as views of the ring (no copy); a region is reused once nothing references them.

The radix cache is disabled in-process: a prefix hit skips computing those positions, so their
hidden states would not exist. (In attach mode the plugin reports such a hit; the sample is
rejected.) Chunked prefill is supported: each chunk lands at its rows of the request's region.
Prefill CUDA graphs are turned off in-process (the plugin refuses them: they would replay passes
without its hooks); decode graphs are unaffected.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from hs_dataset.capture.selfcheck import FINAL, SelfCheckError, check_capture, selfcheck_file, warmup_ids
from hs_dataset.capture.sglang.attach import AttachedServer
from hs_dataset.capture.sglang.engine import OwnEngine
from hs_dataset.capture.sglang.ring_client import RID_PREFIX, RingClient
from hs_dataset.capture.sglang.versions import check_sglang_version, outside_audited_range
from hs_dataset.capture.transport import (DEFAULT_RING_BYTES, MANIFEST, MEMORY_FS, PLUGIN_ERROR, PLUGIN_STATS, Ring,
                                          file_system_type,
                                          private_dir, remove_stale)
from hs_dataset.errors import BackendError, TransportError
from hs_dataset.layout import StorageDtype
from hs_dataset.model_info import ModelInfo, target_of
from hs_dataset.prepare.regenerate import Generation, Prompt
from hs_dataset.records import CaptureResult, TokenizedSample

__all__ = ["CONVENTION", "SGLangBackend"]

# What the plugin records, as the self-check verifies it (hs_dataset.json / the card name it)
CONVENTION = ("layer k = output of decoder layer k: SGLang's aux capture at layers_to_capture = k + 1 (set directly, "
              "not through set_eagle3_layers_to_capture), layer L-1 from the final norm's residual input, "
              "hidden_final = the final norm's output")



def _default_ring_parent() -> str:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else os.environ.get("TMPDIR", "/tmp")


class SGLangBackend(RingClient):
    """Captures hidden states through SGLang (see the module docstring).

    Args:
        model: local model directory. layers: see :mod:`hs_dataset.model_info`.
        tp_size, sglang_url, ring_dir, ring_bytes, max_inflight, chunked_prefill_size, request_timeout, prefetch,
        engine_args, trust_remote_code, allow_untested_sglang: the backend's options
            (:class:`~hs_dataset.capture.options.SGLangOptions`, which says what each does; a sample over half
            of ``ring_bytes`` passes through a window of the ring: :mod:`hs_dataset.capture.sglang.ring_client`).

    Raises:
        BackendError: SGLang (installed, or the attached server's) is outside the audited releases, the engine
            could not start, or the start-up self-check found the captured states are not the recorded layers.
    """

    name = "sglang"
    continuous = True  # the engine batches continuously: the build feeds it one stream across parts
    encodings: tuple[StorageDtype, ...] = ("bfloat16", "fp8_e4m3")  # fp8 is quantized on the GPU by the plugin

    def __init__(self, model: str | ModelInfo, layers: Iterable[int], *, revision: str | None = None,
                 tp_size: int = 1, sglang_url: str | None = None, ring_dir: str | None = None,
                 ring_bytes: int | None = None, max_inflight: int = 32, chunked_prefill_size: int | None = None,
                 request_timeout: float = 600.0, prefetch: int = 4, engine_args: dict[str, Any] | None = None,
                 trust_remote_code: bool = False, allow_untested_sglang: bool = False):
        self.info, self.layers = target_of(model, layers, revision)
        self.max_inflight = int(max_inflight)
        self.prefetch = max(1, int(prefetch))
        self.request_timeout = float(request_timeout)
        self.server: OwnEngine | AttachedServer | None = None
        self._seq = 0
        self.ring: Ring | None = None
        self._dir_lock = -1
        self.allow_untested = bool(allow_untested_sglang)
        self.sglang_version = "attached" if sglang_url else check_sglang_version(self.allow_untested)
        try:
            if sglang_url:
                if ring_dir is None:
                    raise BackendError("attaching to a server (sglang_url) needs ring_dir: the folder named \"dir\" "
                                       "in the server's HS_DATASET_CAPTURE")
                self.dir = Path(ring_dir)
                self.dir.mkdir(parents=True, exist_ok=True)
                remove_stale(self.dir)
            else:
                parent = ring_dir or _default_ring_parent()
                remove_stale(parent)
                self.dir, self._dir_lock = private_dir(parent)
            self.ring = self._make_ring(int(ring_bytes) if ring_bytes else
                                        min(DEFAULT_RING_BYTES, shutil.disk_usage(self.dir).free // 2))
            if sglang_url:
                self.server = AttachedServer(sglang_url, max_inflight=self.max_inflight, timeout=self.request_timeout)
            else:
                self.server = OwnEngine(self.info.path, self.layers, ring_dir=str(self.dir), ring_token=self.ring.token,
                                        rid_prefix=RID_PREFIX, tp_size=tp_size, chunked_prefill_size=chunked_prefill_size,
                                        engine_args={"trust_remote_code": bool(trust_remote_code), **(engine_args or {})})
            self._check_manifest()
            if self.ring.attached_pid:
                self.ring.unlink()  # both sides have it mapped: from now on a crash leaves no file behind
            self.selfcheck = self._self_check()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str | None:
        """The attached server's URL (without credentials), None for an in-process engine."""
        return self.server.url if isinstance(self.server, AttachedServer) else None

    def _make_ring(self, nbytes: int) -> Ring:
        kind = file_system_type(self.dir)
        if kind is not None and kind not in MEMORY_FS:
            raise BackendError(f"backend_options.ring_dir {self.dir} is on {kind}: the shared-memory ring must be on a "
                               "memory file system (tmpfs, e.g. /dev/shm), which the GPU can write to directly")
        try:
            return Ring.create(self.dir, nbytes)
        except TransportError as e:
            raise BackendError(str(e)) from None

    def _check_manifest(self) -> None:
        err = Path(self.dir, PLUGIN_ERROR)
        assert self.server is not None
        deadline = time.monotonic() + self.server.manifest_wait_s
        man = Path(self.dir, MANIFEST)
        while not man.exists():
            if err.exists():
                lines = [line for line in err.read_text().splitlines() if line.strip()]
                raise BackendError("the hs_dataset SGLang plugin failed in the scheduler: " + (lines[-1] if lines else
                                                                                              "(no message)"))
            if time.monotonic() > deadline:
                if isinstance(self.server, AttachedServer):
                    raise self.server.not_ready(str(self.dir))
                raise BackendError(
                    f"the hs_dataset SGLang plugin did not report ready in {self.dir}: is hs_dataset pip-installed "
                    "in SGLang's environment (entry point sglang.srt.plugins: hs_dataset_capture) and SGLANG_PLUGINS "
                    "allowing it?")
            time.sleep(0.1)
        m = json.loads(man.read_text())
        if list(m["layers"]) != list(self.layers):
            raise BackendError(f"the SGLang server captures layers {m['layers']}, this build wants {list(self.layers)}: "
                               "restart the server with matching HS_DATASET_CAPTURE")
        if int(m["hidden_size"]) != self.info.hidden_size:
            raise BackendError(f"the SGLang server's model has hidden size {m['hidden_size']}, this build's model "
                               f"{self.info.hidden_size}: attach to a server of the same model")
        self.manifest = m
        if self.sglang_version == "attached":
            self.sglang_version = str(m.get("sglang_version") or "unknown")
            refusal = outside_audited_range(self.sglang_version)
            if refusal and not self.allow_untested:
                raise BackendError(f"the attached server's {refusal}")

    def _self_check(self, wait_s: float = 60.0) -> str:
        """The start-up self-check (:mod:`hs_dataset.capture.selfcheck`): one warm-up prompt captured through the
        ring while the plugin's forward hooks keep the decoder layers' and the final norm's outputs; every state
        must equal its reference exactly. Returns the one-line result; raises :class:`BackendError` on a mismatch."""
        assert self.ring is not None
        if int(self.manifest["tp_size"]) > 1:
            # a layer's output may be a partial sum on each rank until the next layer's all-reduce (SGLang fuses
            # them), and only rank 0 keeps the reference: checked at tp_size=1
            return (f"not run: tp_size={self.manifest['tp_size']} (the self-check runs at tp_size=1; build once at "
                    "tp_size=1 with this SGLang to check its capture convention)")
        want, got = (selfcheck_file(self.dir, self.ring.token, suffix) for suffix in ("want", "pt"))
        want.write_text("")
        ids = warmup_ids(self.info.vocab_size)
        sample = TokenizedSample("hs_dataset-selfcheck", np.array(ids, dtype=np.int32), np.ones(len(ids), np.uint8))
        try:
            (r,) = list(self.capture([sample]))
            if not isinstance(r, CaptureResult):
                raise BackendError(f"SGLang {self.sglang_version} rejected the start-up self-check's warm-up prompt: {r.reason}")
            captured: dict[int | str, torch.Tensor] = {k: r.layer(k).clone() for k in self.layers}
            captured[FINAL] = r.final.clone()
            deadline = time.monotonic() + wait_s
            while not got.exists():  # the plugin saves it after the pass, the ring may be filled first
                if time.monotonic() > deadline:
                    raise BackendError(f"the hs_dataset SGLang plugin wrote no self-check reference in {wait_s:.0f} s "
                                       f"({got}): is the server's hs_dataset the same version as this one?")
                self._alive()
                time.sleep(0.05)
            reference = torch.load(got, map_location="cpu", weights_only=True)
            try:
                return check_capture(f"SGLang {self.sglang_version}", captured, reference)
            except SelfCheckError as e:
                raise BackendError(str(e)) from None
        finally:
            want.unlink(missing_ok=True)
            got.unlink(missing_ok=True)

    def _alive(self) -> None:
        if self.server is not None:
            self.server.alive()

    def plugin_stats(self) -> dict[str, float] | None:
        """The plugin's running totals (see :mod:`hs_dataset.capture.sglang.plugin`), up to 0.5 s old; None before any."""
        try:
            return json.loads(Path(self.dir, PLUGIN_STATS).read_text())
        except (OSError, ValueError):
            return None

    def versions(self) -> dict[str, str]:
        """SGLang's and torch's versions, with the capture convention and the start-up self-check's result (recorded
        in ``hs_dataset.json`` and the card's software table)."""
        return {"sglang": self.sglang_version, "torch": torch.__version__, "sglang capture convention": CONVENTION,
                "sglang self-check": getattr(self, "selfcheck", "not run")}

    # -- requests ---------------------------------------------------------------------------------
    def _submit(self, rid: str, ids: list[int], params: dict | None = None) -> cf.Future:
        assert self.server is not None
        return self.server.submit(rid, ids, params or {"max_new_tokens": 1, "temperature": 0.0})

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        """Regenerate replies (:mod:`hs_dataset.prepare.regenerate`) on the same engine: ordinary requests with
        ids that are not capture ids (their passes are never captured), at most ``max_inflight`` at once,
        seeded per prompt (``sampling_seed``)."""
        results: list[Generation | None] = [None] * len(prompts)
        inflight: dict[int, cf.Future] = {}
        pending = list(enumerate(prompts))[::-1]
        while pending or inflight:
            while pending and len(inflight) < self.max_inflight:
                k, p = pending.pop()
                o = p.options
                params = {"max_new_tokens": p.max_new_tokens, "temperature": o.temperature, "top_p": o.top_p,
                          "top_k": o.top_k, "stop_token_ids": list(p.stop_ids), "sampling_seed": p.seed,
                          "skip_special_tokens": False}
                self._seq += 1
                assert self.ring is not None
                inflight[k] = self._submit(f"hsgen-{self.ring.token}-{self._seq}", p.ids, params)
            k = next(iter(inflight))
            out = self._wait(inflight.pop(k))
            out = out[0] if isinstance(out, list) else out
            ids = list(out.get("output_ids") or [])
            finish = (out.get("meta_info") or {}).get("finish_reason") or {}
            kind = finish.get("type") if isinstance(finish, dict) else None
            if kind == "abort":
                raise BackendError(f"SGLang aborted a generation request: {finish.get('message')}")
            stopped = kind == "stop"
            if stopped and ids and ids[-1] in prompts[k].stop_ids:
                ids = ids[:-1]
            results[k] = Generation(ids, stopped)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the engine (in-process) or let go of the server, then remove the ring and its folder."""
        if self.server is not None:
            try:
                self.server.close()
            finally:
                self.server = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self._dir_lock >= 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            os.close(self._dir_lock)
            self._dir_lock = -1
