"""SGLang capture backend: prefill-only requests to a patched SGLang engine, states via the spool.

Two ways to reach SGLang:

* in-process (default): starts ``sglang.Engine`` with ``HS_DATASET_CAPTURE`` set, so the
  hs_dataset plugin (:mod:`hs_dataset.sglang_plugin`) loads in every scheduler / TP process;
* attach (``sglang_url=...``): a server already started with the plugin, e.g.::

      HS_DATASET_CAPTURE='{"layers": [3, 31, 59], "spool": "/dev/shm/hs"}' \\
          python -m sglang.launch_server --model-path M --tp 8 --disable-radix-cache --skip-tokenizer-init

  plus ``spool_dir`` naming the same directory (both must reach it).

Each sample is one request with ``max_new_tokens=1`` and a request id ``hsds-<run>-<n>``; at
most ``max_inflight`` are outstanding, and a request's spool files are read and deleted before
another is submitted in its place, so the spool holds at most ``max_inflight`` samples.

The radix cache is disabled in-process: a prefix hit skips computing those positions, so their
hidden states would not exist. (In attach mode the plugin reports such a hit as an error.)
Chunked prefill is supported: each chunk arrives as its own file, in order.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..records import CaptureResult, Reject, TokenizedSample
from ..spool import ENV, MANIFEST, PLUGIN_ERROR, PLUGIN_STATS, SpoolTimeout, collect
from .base import BackendError, BackendItem, ModelInfo, check_layers, read_model_info

MIN_SGLANG = "0.5.11"


def _default_spool_parent() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


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
    try:
        import sglang
    except ImportError as e:
        raise BackendError(f"the sglang backend needs SGLang >= {MIN_SGLANG}: pip install 'hs-dataset[sglang]' ({e})") from None
    v = tuple(int(x) for x in sglang.__version__.split(".")[:3] if x.isdigit())
    if v < (0, 5, 11):
        raise BackendError(f"SGLang {sglang.__version__} is older than {MIN_SGLANG}, which added the plugin framework "
                           "hs_dataset patches through: upgrade SGLang")
    return sglang.__version__


class SGLangBackend:
    """Captures hidden states through SGLang (see the module docstring).

    Args:
        model: local model directory. layers: see :mod:`hs_dataset.backends.base`.
        tp_size: tensor parallel size (in-process engine).
        sglang_url: attach to a running patched server instead of starting one.
        spool_dir: where the plugin writes states (default: a fresh folder in /dev/shm).
        max_inflight: requests outstanding at once (bounds the spool).
        prefetch: results read from the spool ahead of the consumer (bounds memory).
        chunked_prefill_size: passed to SGLang (None: SGLang's default).
        request_timeout: seconds without progress before the build stops with an error.
        engine_args: more ``sglang.Engine`` arguments (e.g. attention_backend, mem_fraction_static).
    """

    name = "sglang"
    continuous = True  # the engine batches continuously: the build feeds it one stream across parts

    def __init__(self, model: str, layers: Iterable[int], *, revision: str | None = None, tp_size: int = 1,
                 sglang_url: str | None = None, spool_dir: str | None = None, max_inflight: int = 32,
                 chunked_prefill_size: int | None = None, request_timeout: float = 600.0, prefetch: int = 4,
                 engine_args: dict[str, Any] | None = None):
        self.info: ModelInfo = read_model_info(model, revision)
        self.layers = check_layers(layers, self.info)
        self.max_inflight = int(max_inflight)
        self.prefetch = max(1, int(prefetch))
        self.request_timeout = float(request_timeout)
        self.url = sglang_url.rstrip("/") if sglang_url else None
        self._own_spool = spool_dir is None
        if spool_dir is None:
            if self.url:
                raise BackendError("attaching to a server (sglang_url) needs spool_dir: the directory named in the "
                                   "server's HS_DATASET_CAPTURE")
            spool_dir = tempfile.mkdtemp(prefix="hs_dataset-spool-", dir=_default_spool_parent())
        self.spool = str(spool_dir)
        Path(self.spool).mkdir(parents=True, exist_ok=True)
        self.rid_prefix = f"hsds-{uuid.uuid4().hex[:10]}-"
        self._seq = 0
        self.engine = None
        self._loop_thread: threading.Thread | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._children: list = []
        self.sglang_version = "attached" if self.url else check_sglang_version()
        try:
            if self.url:
                self._pool = cf.ThreadPoolExecutor(max_workers=self.max_inflight, thread_name_prefix="hs_dataset-http")
            else:
                self._start_engine(model, tp_size, chunked_prefill_size, engine_args or {})
            self._check_manifest()
        except BaseException:
            self.close()
            raise

    # -- engine -----------------------------------------------------------------------------------
    def _start_engine(self, model: str, tp_size: int, chunked: int | None, extra: dict[str, Any]) -> None:
        import asyncio

        import sglang as sgl

        os.environ[ENV] = json.dumps({"layers": list(self.layers), "spool": self.spool, "rid_prefix": "hsds-"})
        allowed = os.environ.get("SGLANG_PLUGINS")
        if allowed and "hs_dataset_capture" not in allowed.split(","):
            os.environ["SGLANG_PLUGINS"] = allowed + ",hs_dataset_capture"
        args: dict[str, Any] = dict(model_path=model, tp_size=tp_size, skip_tokenizer_init=True,
                                    disable_radix_cache=True, log_level="warning")
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
        err = Path(self.spool, PLUGIN_ERROR)
        deadline = time.monotonic() + (60 if self.url else 5)
        man = Path(self.spool, MANIFEST)
        while not man.exists():
            if err.exists():
                raise BackendError("the hs_dataset SGLang plugin failed in the scheduler:\n" + err.read_text())
            if time.monotonic() > deadline:
                raise BackendError(
                    f"the hs_dataset SGLang plugin did not report ready in {self.spool}: is hs_dataset pip-installed "
                    "in SGLang's environment (entry point sglang.srt.plugins: hs_dataset_capture), SGLANG_PLUGINS "
                    "allowing it, and (attach mode) the server started with HS_DATASET_CAPTURE naming this spool?")
            time.sleep(0.1)
        m = json.loads(man.read_text())
        if list(m["layers"]) != list(self.layers):
            raise BackendError(f"the SGLang server captures layers {m['layers']}, this build wants {list(self.layers)}: "
                               "restart the server with matching HS_DATASET_CAPTURE")
        self.manifest = m

    def _alive(self) -> None:
        dead = [p for p in self._children if not p.is_running() or p.status() == "zombie"]
        if dead:
            raise BackendError(f"SGLang engine process(es) {[p.pid for p in dead]} died; the build stopped. "
                               "See the SGLang log above; rerun the same command to resume.")

    def plugin_stats(self) -> dict[str, float] | None:
        """The plugin's running totals (see :mod:`hs_dataset.sglang_plugin`), up to 0.5 s old; None before any."""
        try:
            return json.loads(Path(self.spool, PLUGIN_STATS).read_text())
        except (OSError, ValueError):
            return None

    def versions(self) -> dict[str, str]:
        import torch

        return {"sglang": self.sglang_version, "torch": torch.__version__}

    # -- requests ---------------------------------------------------------------------------------
    def _submit(self, rid: str, ids: list[int]) -> cf.Future:
        params = {"max_new_tokens": 1, "temperature": 0.0}
        if self.url:
            body = json.dumps({"input_ids": ids, "sampling_params": params, "rid": rid}).encode()

            def post() -> dict:
                req = urllib.request.Request(self.url + "/generate", data=body,
                                             headers={"Content-Type": "application/json"})
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
                self._alive()
                if time.monotonic() > deadline:
                    raise BackendError(f"an SGLang request made no progress for {self.request_timeout:.0f}s; "
                                       "the engine hangs. Rerun the same command to resume.") from None

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[BackendItem]:
        """Submit samples (at most ``max_inflight`` outstanding) and yield results in input order.

        A reader thread waits for each request and reads its spool files while this generator's
        consumer (the builder) encodes and writes the previous rows: reading (memcpy from
        /dev/shm), writing shards and the GPU's prefill all overlap.
        """
        it = iter(samples)
        submitted: queue.Queue = queue.Queue()
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        reader = threading.Thread(target=self._read_loop, args=(submitted, ready, stop),
                                  name="hs_dataset-spool-reader", daemon=True)
        reader.start()
        inflight = 0
        exhausted = False
        try:
            while True:
                while not exhausted and inflight < self.max_inflight:
                    s = next(it, None)
                    if s is None:
                        exhausted = True
                        break
                    rid = f"{self.rid_prefix}{self._seq}"
                    self._seq += 1
                    submitted.put((s, rid, self._submit(rid, s.input_ids.tolist())))
                    inflight += 1
                if inflight == 0:
                    return
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

    def _read_loop(self, submitted: queue.Queue, ready: queue.Queue, stop: threading.Event) -> None:
        while True:
            job = submitted.get()
            if job is None or stop.is_set():
                while job is not None:  # cancel what was submitted but will not be read
                    job[2].cancel()
                    job = submitted.get()
                return
            try:
                item: BackendItem | BaseException = self._finish(*job)
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            ready.put(item)
            if isinstance(item, BaseException):
                return

    def _finish(self, s: TokenizedSample, rid: str, fut: cf.Future) -> BackendItem:
        """Wait for one request and read its states from the spool (or say why it is rejected)."""
        try:
            out = self._wait(fut)
        except BackendError:
            raise
        except urllib.error.HTTPError as e:
            return Reject(s.sample_id, "input_ids", f"SGLang refused the request: {e.read()[:500]!r}", "capture")
        except (ValueError, RuntimeError) as e:  # request-level errors (e.g. too long for the context)
            self._alive()
            return Reject(s.sample_id, "input_ids", f"SGLang refused the request: {e}", "capture")
        except Exception as e:
            raise BackendError(f"SGLang request failed: {type(e).__name__}: {e}") from e
        out = out[0] if isinstance(out, list) else out
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return Reject(s.sample_id, "input_ids", f"SGLang aborted the request: {finish.get('message')}", "capture")
        try:
            states, nonfinite = collect(self.spool, rid, s.num_tokens, timeout=self.request_timeout, alive=self._alive)
        except SpoolTimeout as e:
            raise BackendError(str(e)) from None
        except RuntimeError as e:
            return Reject(s.sample_id, "input_ids", str(e), "capture")
        return CaptureResult(sample=s, layers=self.layers, states=states, nonfinite=nonfinite)

    def close(self) -> None:
        """Stop the engine (in-process) and remove the spool files of this run."""
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
        if self._own_spool:
            shutil.rmtree(self.spool, ignore_errors=True)
        else:
            for f in Path(self.spool).glob(self.rid_prefix + "*"):
                f.unlink(missing_ok=True)
