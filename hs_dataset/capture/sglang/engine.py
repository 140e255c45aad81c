"""The SGLang backend's own engine: ``sglang.Engine`` started in this process with the plugin's settings.

The engine's event loop runs on a thread of ours; requests are its ``async_generate`` coroutines.
The radix cache stays disabled (a prefix hit skips computing those positions, so their hidden
states would not exist) and prefill CUDA graphs off (they would replay passes without the
plugin's hooks); decode graphs are unaffected. SGLang's own processes (schedulers, TP workers, the
detokenizer) are watched: one that dies ends the build with a :class:`~hs_dataset.errors.BackendError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import json
import os
import threading
from typing import Any

from hs_dataset.capture.sglang.versions import engine_processes
from hs_dataset.capture.transport import ENV
from hs_dataset.errors import BackendError

__all__ = ["OwnEngine"]


class OwnEngine:
    """An in-process ``sglang.Engine`` whose plugin captures ``layers`` into the ring ``ring_token`` in ``ring_dir``.

    Args:
        model: the model directory. layers: the captured layers (hs_dataset's convention).
        ring_dir: the private ring folder. ring_token: the ring's name. rid_prefix: our request ids' prefix.
        tp_size: tensor parallel size. chunked_prefill_size: passed to SGLang (None: its default).
        engine_args: more ``sglang.Engine`` arguments (they win over the defaults).

    Raises:
        BackendError: ``disable_radix_cache=False`` was asked for.
    """

    remote = False
    manifest_wait_s = 5.0  # the plugin writes its manifest while the engine loads the model

    def __init__(self, model: str, layers: tuple[int, ...], *, ring_dir: str, ring_token: str, rid_prefix: str,
                 tp_size: int = 1, chunked_prefill_size: int | None = None, engine_args: dict[str, Any] | None = None):

        import sglang as sgl  # deferred: SGLang is optional (pip install 'hs-dataset[sglang]')
        from sglang.srt.server_args import ServerArgs  # optional: pip install 'hs-dataset[sglang]'

        os.environ[ENV] = json.dumps({"layers": list(layers), "dir": ring_dir, "rid_prefix": rid_prefix,
                                      "ring": ring_token})
        allowed = os.environ.get("SGLANG_PLUGINS")
        if allowed and "hs_dataset_capture" not in allowed.split(","):
            os.environ["SGLANG_PLUGINS"] = allowed + ",hs_dataset_capture"
        args: dict[str, Any] = dict(model_path=model, tp_size=tp_size, skip_tokenizer_init=True,
                                    disable_radix_cache=True, log_level="warning")
        if "cuda_graph_backend_prefill" in {f.name for f in dataclasses.fields(ServerArgs)}:
            args["cuda_graph_backend_prefill"] = "disabled"  # replayed passes would skip the capture hooks
        if chunked_prefill_size is not None:
            args["chunked_prefill_size"] = int(chunked_prefill_size)
        args.update(engine_args or {})
        if not args.get("disable_radix_cache", True):
            raise BackendError("disable_radix_cache=False: a radix-cache prefix hit skips computing those positions, "
                               "so their hidden states would not exist; leave the cache disabled")
        self.engine = sgl.Engine(**args)
        self._children = engine_processes()
        self.loop: asyncio.AbstractEventLoop = self.engine.loop
        self._loop_thread: threading.Thread | None = threading.Thread(
            target=self.loop.run_forever, name="hs_dataset-sglang-loop", daemon=True)
        self._loop_thread.start()

    def submit(self, rid: str, ids: list[int], params: dict[str, Any]) -> cf.Future:
        """Send one request; its future gives SGLang's output dict."""

        return asyncio.run_coroutine_threadsafe(
            self.engine.async_generate(input_ids=ids, sampling_params=params, rid=rid), self.loop)

    def alive(self) -> None:
        """Raise :class:`BackendError` when one of SGLang's processes has died."""
        dead = [p for p in self._children if not p.is_running() or p.status() == "zombie"]
        if dead:
            raise BackendError(f"SGLang engine process(es) {[p.pid for p in dead]} died; the build stopped. "
                               "See the SGLang log above; rerun the same command to resume.")

    def close(self) -> None:
        """Stop the event loop, then the engine."""
        if self._loop_thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._loop_thread.join(timeout=30)
            self._loop_thread = None
        try:
            self.engine.shutdown()
        finally:
            os.environ.pop(ENV, None)
