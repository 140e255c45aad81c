"""SGLang capture backend: prefill-only requests to a patched SGLang engine, states through a
shared-memory ring (:mod:`hs_dataset.transport`).

Two ways to reach SGLang:

* in-process (default): starts ``sglang.Engine`` with ``HS_DATASET_CAPTURE`` set, so the
  hs_dataset plugin (:mod:`hs_dataset.sglang_plugin`) loads in every scheduler / TP process; the
  ring lives in a private folder ``<ring_dir>/hs_dataset-<id>`` (``ring_dir`` default /dev/shm);
* attach (``sglang_url=...``): a server already started with the plugin, e.g.::

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
import dataclasses
import gc
import json
import os
import queue
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..compat_sglang import MIN_SGLANG, SUPPORTED_SGLANG, sglang_version_tuple
from ..records import CaptureResult, Reject, TokenizedSample
from ..regenerate import Generation, Prompt
from ..redact import split_url_auth
from ..transport import (ENV, MANIFEST, MEMORY_FS, PLUGIN_ERROR, PLUGIN_STATS, Lease, RequestError, Ring,
                         TransportError, file_system_type, private_dir, remove_stale)
from .base import BackendError, BackendItem, ModelInfo, check_layers, read_model_info

__all__ = ["SGLangBackend", "check_sglang_version"]

RID_PREFIX = "hsds-"
DEFAULT_RING_BYTES = 4 << 30


def _default_ring_parent() -> str:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else os.environ.get("TMPDIR", "/tmp")


def _engine_processes() -> list:
    """SGLang's long-lived children (scheduler / TP workers, detokenizer): they name themselves
    ``sglang::...``. Short-lived helpers (kernel compilers, resource trackers) are left out: their
    normal exit is no engine death."""
    try:
        import psutil
    except ImportError:  # no liveness check; request timeouts still bound a hang
        return []
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "sglang::" in " ".join(p.cmdline()) or p.name().startswith("sglang"):
                procs.append(p)
        except psutil.Error:
            continue
    return procs


def check_sglang_version() -> str:
    """Return the installed SGLang version; raise a clear error when it has no plugin framework."""
    need = ".".join(map(str, MIN_SGLANG))
    try:
        import sglang
    except ImportError as e:
        raise BackendError(f"the sglang backend needs SGLang >= {need}: pip install 'hs-dataset[sglang]' ({e})") from None
    if sglang_version_tuple(sglang.__version__) < MIN_SGLANG:
        raise BackendError(f"SGLang {sglang.__version__} is older than {need}, which added the plugin framework "
                           f"hs_dataset patches through: upgrade SGLang (tested: {SUPPORTED_SGLANG})")
    return sglang.__version__


class SGLangBackend:
    """Captures hidden states through SGLang (see the module docstring).

    Args:
        model: local model directory. layers: see :mod:`hs_dataset.backends.base`.
        tp_size: tensor parallel size (in-process engine).
        sglang_url: attach to a running patched server instead of starting one (``user:password@``
            in it is sent as HTTP basic auth).
        ring_dir: in-process: where the private ring folder is made (default /dev/shm); attach:
            the folder named ``dir`` in the server's ``HS_DATASET_CAPTURE`` (required).
        ring_bytes: size of the shared-memory ring (default 4 GiB): the states in flight at once.
        max_inflight: requests outstanding at once.
        prefetch: results read from the ring ahead of the consumer.
        chunked_prefill_size: passed to SGLang (None: SGLang's default).
        request_timeout: seconds without progress before the build stops with an error.
        engine_args: more ``sglang.Engine`` arguments (e.g. attention_backend, mem_fraction_static).
        trust_remote_code: the engine's ``trust_remote_code`` (Kimi-K2.5's tokenizer and processor need
            it), unless ``engine_args`` set it.
    """

    name = "sglang"
    continuous = True  # the engine batches continuously: the build feeds it one stream across parts
    encodings = ("bfloat16", "fp8_e4m3")  # fp8 is quantized on the GPU by the plugin

    def __init__(self, model: str, layers: Iterable[int], *, revision: str | None = None, tp_size: int = 1,
                 sglang_url: str | None = None, ring_dir: str | None = None, ring_bytes: int = DEFAULT_RING_BYTES,
                 max_inflight: int = 32, chunked_prefill_size: int | None = None, request_timeout: float = 600.0,
                 prefetch: int = 4, engine_args: dict[str, Any] | None = None, trust_remote_code: bool = False):
        self.info: ModelInfo = read_model_info(model, revision)
        self.layers = check_layers(layers, self.info)
        self.max_inflight = int(max_inflight)
        self.prefetch = max(1, int(prefetch))
        self.request_timeout = float(request_timeout)
        # user:password@ in the URL: sent as HTTP basic auth, kept out of the URL (and of any error message)
        self.url, self._auth = split_url_auth(sglang_url.rstrip("/")) if sglang_url else (None, None)
        self.engine = None
        self._seq = 0
        self.ring: Ring | None = None
        self._dir_lock = -1
        self._loop_thread: threading.Thread | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._children: list = []
        self.sglang_version = "attached" if self.url else check_sglang_version()
        try:
            if self.url:
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
            self.ring = self._make_ring(int(ring_bytes))
            if self.url:
                self._pool = cf.ThreadPoolExecutor(max_workers=self.max_inflight, thread_name_prefix="hs_dataset-http")
            else:
                self._start_engine(model, tp_size, chunked_prefill_size,
                                   {"trust_remote_code": bool(trust_remote_code), **(engine_args or {})})
            self._check_manifest()
            if self.ring.attached_pid:
                self.ring.unlink()  # both sides have it mapped: from now on a crash leaves no file behind
        except BaseException:
            self.close()
            raise

    def _make_ring(self, nbytes: int) -> Ring:
        kind = file_system_type(self.dir)
        if kind is not None and kind not in MEMORY_FS:
            raise BackendError(f"backend_options.ring_dir {self.dir} is on {kind}: the shared-memory ring must be on a "
                               "memory file system (tmpfs, e.g. /dev/shm), which the GPU can write to directly")
        try:
            return Ring.create(self.dir, nbytes)
        except TransportError as e:
            raise BackendError(str(e)) from None

    # -- engine -----------------------------------------------------------------------------------
    def _start_engine(self, model: str, tp_size: int, chunked: int | None, extra: dict[str, Any]) -> None:
        import asyncio

        import sglang as sgl
        from sglang.srt.server_args import ServerArgs

        assert self.ring is not None
        os.environ[ENV] = json.dumps({"layers": list(self.layers), "dir": str(self.dir), "rid_prefix": RID_PREFIX,
                                      "ring": self.ring.token})
        allowed = os.environ.get("SGLANG_PLUGINS")
        if allowed and "hs_dataset_capture" not in allowed.split(","):
            os.environ["SGLANG_PLUGINS"] = allowed + ",hs_dataset_capture"
        args: dict[str, Any] = dict(model_path=model, tp_size=tp_size, skip_tokenizer_init=True,
                                    disable_radix_cache=True, log_level="warning")
        if "cuda_graph_backend_prefill" in {f.name for f in dataclasses.fields(ServerArgs)}:
            args["cuda_graph_backend_prefill"] = "disabled"  # replayed passes would skip the capture hooks
        if chunked is not None:
            args["chunked_prefill_size"] = int(chunked)
        args.update(extra)
        if not args.get("disable_radix_cache", True):
            raise BackendError("disable_radix_cache=False: a radix-cache prefix hit skips computing those positions, "
                               "so their hidden states would not exist; leave the cache disabled")
        self.engine = sgl.Engine(**args)
        self._children = _engine_processes()
        loop: asyncio.AbstractEventLoop = self.engine.loop
        self._loop_thread = threading.Thread(target=loop.run_forever, name="hs_dataset-sglang-loop", daemon=True)
        self._loop_thread.start()

    def _check_manifest(self) -> None:
        err = Path(self.dir, PLUGIN_ERROR)
        deadline = time.monotonic() + (60 if self.url else 5)
        man = Path(self.dir, MANIFEST)
        while not man.exists():
            if err.exists():
                raise BackendError("the hs_dataset SGLang plugin failed in the scheduler:\n" + err.read_text())
            if time.monotonic() > deadline:
                raise BackendError(
                    f"the hs_dataset SGLang plugin did not report ready in {self.dir}: is hs_dataset pip-installed "
                    "in SGLang's environment (entry point sglang.srt.plugins: hs_dataset_capture), SGLANG_PLUGINS "
                    "allowing it, and (attach mode) the server started with HS_DATASET_CAPTURE naming this ring_dir?")
            time.sleep(0.1)
        m = json.loads(man.read_text())
        if list(m["layers"]) != list(self.layers):
            raise BackendError(f"the SGLang server captures layers {m['layers']}, this build wants {list(self.layers)}: "
                               "restart the server with matching HS_DATASET_CAPTURE")
        if int(m["hidden_size"]) != self.info.hidden_size:
            raise BackendError(f"the SGLang server's model has hidden size {m['hidden_size']}, this build's model "
                               f"{self.info.hidden_size}: attach to a server of the same model")
        self.manifest = m

    def _alive(self) -> None:
        dead = [p for p in self._children if not p.is_running() or p.status() == "zombie"]
        if dead:
            raise BackendError(f"SGLang engine process(es) {[p.pid for p in dead]} died; the build stopped. "
                               "See the SGLang log above; rerun the same command to resume.")

    def plugin_stats(self) -> dict[str, float] | None:
        """The plugin's running totals (see :mod:`hs_dataset.sglang_plugin`), up to 0.5 s old; None before any."""
        try:
            return json.loads(Path(self.dir, PLUGIN_STATS).read_text())
        except (OSError, ValueError):
            return None

    def versions(self) -> dict[str, str]:
        import torch

        return {"sglang": self.sglang_version, "torch": torch.__version__}

    # -- requests ---------------------------------------------------------------------------------
    def _submit(self, rid: str, ids: list[int], params: dict | None = None) -> cf.Future:
        params = params or {"max_new_tokens": 1, "temperature": 0.0}
        if self.url:
            body = json.dumps({"input_ids": ids, "sampling_params": params, "rid": rid}).encode()

            def post() -> dict:
                req = urllib.request.Request(self.url + "/generate", data=body, headers={
                    "Content-Type": "application/json", **({"Authorization": self._auth} if self._auth else {})})
                with urllib.request.urlopen(req, timeout=self.request_timeout) as r:
                    return json.loads(r.read())

            assert self._pool is not None
            return self._pool.submit(post)
        import asyncio

        return asyncio.run_coroutine_threadsafe(
            self.engine.async_generate(input_ids=ids, sampling_params=params, rid=rid), self.engine.loop)

    def _wait(self, fut: cf.Future) -> dict:
        deadline = time.monotonic() + self.request_timeout
        while True:
            try:
                return fut.result(timeout=1.0)
            except cf.TimeoutError:
                if not self.url:
                    self._alive()
                if time.monotonic() > deadline:
                    raise BackendError(f"an SGLang request made no progress for {self.request_timeout:.0f}s; "
                                       "the engine hangs. Rerun the same command to resume.") from None

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        """Regenerate replies (:mod:`hs_dataset.regenerate`) on the same engine: ordinary requests with
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

    def capture(self, samples: Iterable[TokenizedSample], *, encoding: str = "bfloat16") -> Iterator[BackendItem]:
        """Submit samples and yield results in input order, states as views of the ring.

        ``encoding``: ``bfloat16`` or ``fp8_e4m3`` (quantized on the GPU; ``CaptureResult.scales``
        holds the per-token scales). A sample is submitted once its region of the ring is
        reserved: at most ``max_inflight`` samples and ``ring_bytes`` of states are in flight. A
        reader thread waits for each request while this generator's consumer (the builder) encodes
        and writes the previous rows, so the GPU's prefill and the shard writing overlap.
        """
        if encoding not in self.encodings:
            raise ValueError(f"encoding {encoding!r}: the sglang backend delivers {', '.join(self.encodings)}")
        ring = self.ring
        assert ring is not None
        n_states, hidden = len(self.layers) + 1, self.info.hidden_size
        it = iter(samples)
        submitted: queue.Queue = queue.Queue()
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        reader = threading.Thread(target=self._read_loop, args=(submitted, ready, stop, encoding),
                                  name="hs_dataset-ring-reader", daemon=True)
        reader.start()
        inflight = 0
        waiting: TokenizedSample | None = None  # the next sample, whose region did not fit yet
        exhausted = False
        try:
            while True:
                while not exhausted and inflight < self.max_inflight:
                    s = waiting if waiting is not None else next(it, None)
                    waiting = None
                    if s is None:
                        exhausted = True
                        break
                    if s.num_tokens == 0:
                        submitted.put((s, None, Reject(s.sample_id, "input_ids", "no tokens to run", "capture")))
                    elif not ring.fits(s.num_tokens, n_states, hidden, encoding):
                        submitted.put((s, None, Reject(
                            s.sample_id, "input_ids", f"{s.num_tokens} tokens of {n_states} states need more than the "
                            f"ring's {ring.capacity / 2**30:.2f} GiB: raise backend_options.ring_bytes", "capture")))
                    else:
                        lease = ring.reserve(s.num_tokens, n_states, hidden, encoding)
                        if lease is None:
                            waiting = s  # the ring is full: hand out results first
                            break
                        submitted.put((s, lease, self._submit(ring.rid(lease, RID_PREFIX), s.input_ids.tolist())))
                    inflight += 1
                if inflight == 0:
                    if waiting is None:
                        return
                    gc.collect()  # results kept only by reference cycles
                    if ring.reclaim() == 0:
                        raise BackendError(
                            f"the shared-memory ring ({ring.capacity / 2**30:.2f} GiB) is full of results the "
                            "consumer still references: drop them (or copy what you keep) before asking for more, "
                            "or raise backend_options.ring_bytes")
                    continue
                item = ready.get()
                inflight -= 1
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            submitted.put(None)
            while reader.is_alive():  # unblock a reader waiting to put a result
                try:
                    ready.get(timeout=0.1)
                except queue.Empty:
                    pass

    def _read_loop(self, submitted: queue.Queue, ready: queue.Queue, stop: threading.Event, encoding: str) -> None:
        while True:
            job = submitted.get()
            if job is None or stop.is_set():
                while job is not None:  # cancel what was submitted but will not be read
                    if isinstance(job[2], cf.Future):
                        job[2].cancel()
                    if job[1] is not None:
                        self.ring.abandon(job[1])
                    job = submitted.get()
                return
            try:
                s, lease, fut = job
                item: BackendItem | BaseException = fut if lease is None else self._finish(s, lease, fut)
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            ready.put(item)
            if isinstance(item, BaseException):
                return

    def _finish(self, s: TokenizedSample, lease: Lease, fut: cf.Future) -> BackendItem:
        """Wait for one request and return views of its states in the ring (or say why it is rejected)."""
        ring = self.ring
        assert ring is not None
        try:
            out = self._wait(fut)
        except BackendError:
            ring.abandon(lease)
            raise
        except urllib.error.HTTPError as e:
            ring.abandon(lease)
            return Reject(s.sample_id, "input_ids", f"SGLang refused the request: {e.read()[:500]!r}", "capture")
        except (ValueError, RuntimeError) as e:  # request-level errors (e.g. too long for the context)
            ring.abandon(lease)
            if not self.url:
                self._alive()
            return Reject(s.sample_id, "input_ids", f"SGLang refused the request: {e}", "capture")
        except Exception as e:
            ring.abandon(lease)
            raise BackendError(f"SGLang request failed: {type(e).__name__}: {e}") from e
        out = out[0] if isinstance(out, list) else out
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            ring.abandon(lease)
            return Reject(s.sample_id, "input_ids", f"SGLang aborted the request: {finish.get('message')}", "capture")
        try:
            ring.wait(lease, self.request_timeout, None if self.url else self._alive)
        except RequestError as e:
            return Reject(s.sample_id, "input_ids", str(e), "capture")
        except TransportError as e:
            ring.abandon(lease)
            raise BackendError(f"{e}. The build stopped; rerun the same command to resume.") from None
        if ring.attached_pid:
            ring.unlink()  # attach mode: the server mapped the ring on this first request
        states, scales = ring.views(lease)
        return CaptureResult(sample=s, layers=self.layers, states=states, scales=scales,
                             nonfinite=ring.nonfinite(lease))

    def close(self) -> None:
        """Stop the engine (in-process), then remove the ring and its folder."""
        if self.engine is not None:
            loop = self.engine.loop
            if self._loop_thread is not None:
                loop.call_soon_threadsafe(loop.stop)
                self._loop_thread.join(timeout=30)
                self._loop_thread = None
            try:
                self.engine.shutdown()
            finally:
                self.engine = None
                os.environ.pop(ENV, None)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self._dir_lock >= 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            os.close(self._dir_lock)
            self._dir_lock = -1
