"""SGLang plugin (entry point ``sglang.srt.plugins: hs_dataset_capture``), SGLang >= 0.5.11.

SGLang runs :func:`register` in the engine process and in every scheduler / TP worker process.
It does nothing unless ``HS_DATASET_CAPTURE`` is set (JSON: ``layers``, ``spool``,
``rid_prefix``), which :class:`hs_dataset.backends.sglang.SGLangBackend` does; so installing
hs_dataset changes no other SGLang use.

Hooks (through SGLang's ``HookRegistry``, no SGLang file is copied or forked):

* AFTER ``ModelRunner.load_model``: turn on the model's EAGLE-3 aux capture with the positions
  set directly (``model.model.layers_to_capture = [k + 1 for k in layers]``: the state entering
  decoder layer k+1 = the output of layer k), bypassing ``set_eagle3_layers_to_capture`` and its
  model-dependent +1. Writes a manifest into the spool (TP rank 0).
* AROUND ``ModelRunner.forward``: remembers the batch when ``forward_mode.is_extend()`` and it
  holds requests of ours; decode passes are never captured.
* AROUND ``LogitsProcessor.forward``: it receives the final post-norm hidden states of every
  token and the aux states (the LogitsProcessor itself keeps neither for all tokens). TP rank 0
  starts an asynchronous device-to-host copy of our rows into pinned memory on a side stream and
  hands it to a writer thread, so the GPU goes on with the next pass while files are written.
  After TP's all-reduce the states are replicated: other ranks write nothing.

TP rank 0 also keeps running totals in ``plugin-stats.json`` in the spool (passes and rows
captured, seconds spent in the hook on the scheduler thread, blocked on a full writer queue, and
writing), so a slow build can tell the engine's cost from its own.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import threading
import time
import traceback
from collections import OrderedDict
from pathlib import Path

from .spool import ENV, MANIFEST, PLUGIN_ERROR, PLUGIN_STATS, error_path, request_spans, write_chunk

MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
LOGITS_PROCESSOR = "sglang.srt.layers.logits_processor.LogitsProcessor"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
HOOK_TARGETS = (MODEL_RUNNER + ".load_model", MODEL_RUNNER + ".forward", LOGITS_PROCESSOR + ".forward")
# Read, not hooked: which TP rank this process is (ModelRunner's own attributes moved between versions).
PARALLEL_TARGETS = (PARALLEL_STATE + ".get_tensor_model_parallel_rank",
                    PARALLEL_STATE + ".get_tensor_model_parallel_world_size",
                    PARALLEL_STATE + ".get_pipeline_model_parallel_world_size")
MIN_SGLANG = (0, 5, 11)


class _State:
    config: dict | None = None
    tp_rank: int = -1
    batch = None  # the ForwardBatch of the EXTEND pass in progress, when it holds requests of ours
    writer: "_Writer | None" = None
    side_stream = None
    seen: "OrderedDict[str, None]" = OrderedDict()  # requests already captured (radix-hit check), LRU


S = _State()


def _resolve(target: str) -> object:
    """Import ``a.b.C.meth``; raise ImportError naming the missing piece."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, name in enumerate(parts[i:]):
            if not hasattr(obj, name):
                raise ImportError(f"hs_dataset SGLang plugin: hook target {'.'.join(parts[:i + j + 1])} does not "
                                  "exist in this SGLang version (supported: 0.5.11 - 0.5.17)")
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"hs_dataset SGLang plugin: cannot import any module of {target}")


def _config() -> dict | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    cfg = json.loads(raw)
    cfg["layers"] = [int(k) for k in cfg["layers"]]
    cfg.setdefault("rid_prefix", "hsds-")
    return cfg


def register() -> None:
    """Entry point: register the hooks when ``HS_DATASET_CAPTURE`` is set."""
    cfg = _config()
    if cfg is None:
        return
    try:
        import sglang
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        version = tuple(int(x) for x in sglang.__version__.split(".")[:3] if x.isdigit())
        if version < MIN_SGLANG:
            raise ImportError(f"sglang {sglang.__version__} is older than 0.5.11 (no plugin framework)")
        for t in HOOK_TARGETS + PARALLEL_TARGETS:
            _resolve(t)
        S.config = cfg
        HookRegistry.register(MODEL_RUNNER + ".load_model", _after_load_model, HookType.AFTER)
        HookRegistry.register(MODEL_RUNNER + ".forward", _around_forward, HookType.AROUND)
        HookRegistry.register(LOGITS_PROCESSOR + ".forward", _around_logits, HookType.AROUND)
    except BaseException:
        _plugin_error(cfg, traceback.format_exc())
        raise


def _plugin_error(cfg: dict, text: str) -> None:
    try:
        Path(cfg["spool"], PLUGIN_ERROR).write_text(text)
    except OSError:
        pass


def _after_load_model(result, runner, *args, **kwargs):
    cfg = S.config
    try:
        model = runner.model
        inner = getattr(model, "model", None)
        if not hasattr(model, "capture_aux_hidden_states") or not hasattr(inner, "layers_to_capture"):
            raise RuntimeError(f"{type(model).__name__} has no EAGLE-3 aux hidden-state capture in this SGLang "
                               "version (needs capture_aux_hidden_states and model.layers_to_capture)")
        if getattr(getattr(runner, "server_args", None), "enable_dp_attention", False):
            # Each DP rank schedules its own requests, but only TP rank 0 writes: the other ranks'
            # samples would never arrive. Refused rather than left to time out.
            raise RuntimeError("DP attention (--enable-dp-attention) is not supported by the hs_dataset capture: "
                               "start the engine without it")
        tp_rank, tp_size, pp_size = (int(_resolve(t)()) for t in PARALLEL_TARGETS)
        if pp_size != 1:
            raise RuntimeError("pipeline parallelism is not supported by the hs_dataset capture (use pp_size=1)")
        num_layers = len(inner.layers)
        bad = [k for k in cfg["layers"] if not 0 <= k <= num_layers - 2]
        if bad:
            raise RuntimeError(f"layers {bad} out of range 0..{num_layers - 2}")
        model.capture_aux_hidden_states = True
        inner.layers_to_capture = [k + 1 for k in cfg["layers"]]
        S.tp_rank = tp_rank
        if S.tp_rank != 0:  # replicated states: rank 0 writes them; the others only say they are here
            _atomic_json(Path(cfg["spool"], f"plugin-rank-{tp_rank}.json"), {"pid": os.getpid(), "tp_rank": tp_rank})
        else:
            import torch

            S.side_stream = torch.cuda.Stream()
            S.writer = _Writer(cfg["spool"], cfg.get("writer_queue", 8))
            manifest = {"pid": os.getpid(), "layers": cfg["layers"], "layers_to_capture": inner.layers_to_capture,
                        "model_class": type(model).__name__, "num_layers": num_layers,
                        "tp_rank": tp_rank, "tp_size": tp_size, "hidden_size": int(model.config.hidden_size)}
            _atomic_json(Path(cfg["spool"], MANIFEST), manifest)
    except BaseException:
        _plugin_error(cfg, traceback.format_exc())
        raise
    return None


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _around_forward(original, runner, forward_batch, *args, **kwargs):
    cfg = S.config
    mode = forward_batch.forward_mode
    rids = getattr(forward_batch, "rids", None) or []
    ours = mode.is_extend() and any(r.startswith(cfg["rid_prefix"]) for r in rids)
    S.batch = forward_batch if ours else None
    try:
        return original(runner, forward_batch, *args, **kwargs)
    finally:
        S.batch = None


def _around_logits(original, lp, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                   *args, **kwargs):
    fb = S.batch
    if fb is not None:
        S.batch = None  # once per forward pass
        if S.tp_rank == 0:
            _capture(fb, hidden_states, aux_hidden_states)
    return original(lp, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)


def _aux_list(aux, n: int, hidden: int):
    if aux is None:
        raise RuntimeError("no aux hidden states reached the LogitsProcessor: EAGLE-3 capture is off")
    if isinstance(aux, (list, tuple)):
        return list(aux)
    # packed [tokens, n * H]
    return [aux[:, j * hidden:(j + 1) * hidden] for j in range(n)]


def _capture(fb, final, aux) -> None:
    import torch

    cfg = S.config
    spans = request_spans(list(fb.rids), list(fb.extend_seq_lens_cpu), list(fb.extend_prefix_lens_cpu),
                          cfg["rid_prefix"])
    if not spans:
        return
    H = final.shape[-1]
    states = _aux_list(aux, len(cfg["layers"]), H) + [final]
    todo = []
    for rid, off, start, n in spans:
        if start > 0 and rid not in S.seen:
            # The first pass of this request starts after a prefix it did not compute: a radix-cache hit.
            error_path(cfg["spool"], rid).write_text(
                f"request {rid}: {start} prompt positions came from SGLang's radix cache and were not computed, "
                "so their hidden states do not exist; run the server with --disable-radix-cache")
            continue
        S.seen[rid] = None
        if len(S.seen) > 1_000_000:
            S.seen.popitem(last=False)
        todo.append((rid, off, start, n))
    if not todo:
        return
    t0 = time.perf_counter()
    rows = sum(n for _, _, _, n in todo)
    main = torch.cuda.current_stream()
    # NaN/Inf per position and state, found on the GPU (a few cheap kernels, no sync), so the
    # builder need not scan every byte again on the CPU.
    bad = torch.stack([(~torch.isfinite(st)).any(dim=-1) for st in states])  # [n_states, tokens]
    side = S.side_stream
    side.wait_stream(main)
    ta = time.perf_counter()
    buf = torch.empty((len(states), rows, H), dtype=torch.bfloat16, pin_memory=True)
    flags = torch.empty((len(states), rows), dtype=torch.bool, pin_memory=True)
    S.writer.stats["alloc_s"] += time.perf_counter() - ta
    with torch.cuda.stream(side):
        r = 0
        for rid, off, start, n in todo:
            for j, st in enumerate(states):
                # Every destination is a contiguous slice of pinned memory: a strided one would make
                # PyTorch copy through a temporary and wait for the GPU, stalling the scheduler here.
                buf[j, r:r + n].copy_(st[off:off + n], non_blocking=True)
                flags[j, r:r + n].copy_(bad[j, off:off + n], non_blocking=True)
            r += n
        done = torch.cuda.Event()
        done.record(side)
    for t in (*states, bad):
        t.record_stream(side)  # keep the GPU memory alive until the copy has run
    t1 = time.perf_counter()
    S.writer.put((done, buf, flags, todo))
    st = S.writer.stats
    st["passes"] += 1
    st["rows"] += rows
    st["hook_s"] += time.perf_counter() - t0
    st["queue_full_s"] += time.perf_counter() - t1


class _Writer:
    """One thread writing captured chunks into the spool; a bounded queue applies backpressure."""

    def __init__(self, spool: str, depth: int):
        self.spool = spool
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        # hook_s: time in the LogitsProcessor hook on the scheduler thread (of it: alloc_s allocating pinned
        # buffers, queue_full_s blocked on this queue); copy_wait_s: the writer waiting for the device-to-host
        # copy; write_s: writing spool files.
        self.stats = {"passes": 0, "rows": 0, "bytes": 0, "hook_s": 0.0, "queue_full_s": 0.0, "alloc_s": 0.0,
                      "copy_wait_s": 0.0, "write_s": 0.0}
        self._stats_at = 0.0
        self._saved: dict | None = None
        self.t = threading.Thread(target=self._run, name="hs_dataset-spool-writer", daemon=True)
        self.t.start()

    def put(self, job) -> None:
        self.q.put(job)

    def _run(self) -> None:
        while True:
            try:
                done, buf, flags, todo = self.q.get(timeout=0.5)
            except queue.Empty:
                self._save_stats(force=True)
                continue
            try:
                t0 = time.perf_counter()
                done.synchronize()
                t1 = time.perf_counter()
                r = 0
                for rid, _off, start, n in todo:
                    nonfinite = ",".join(str(int(x)) for x in flags[:, r:r + n].sum(dim=1).tolist())
                    self.stats["bytes"] += write_chunk(self.spool, rid, start,
                                                       [buf[j, r:r + n] for j in range(buf.shape[0])],
                                                       {"rid": rid, "nonfinite": nonfinite})
                    r += n
                self.stats["copy_wait_s"] += t1 - t0
                self.stats["write_s"] += time.perf_counter() - t1
            except BaseException:
                for rid, _off, _start, _n in todo:
                    try:
                        error_path(self.spool, rid).write_text("spool writer failed:\n" + traceback.format_exc())
                    except OSError:
                        pass
            self._save_stats()

    def _save_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if (not force and now - self._stats_at < 0.5) or self.stats == self._saved:
            return
        self._stats_at = now
        self._saved = dict(self.stats)
        try:
            _atomic_json(Path(self.spool, PLUGIN_STATS), {k: round(v, 4) for k, v in self._saved.items()})
        except OSError:
            pass  # statistics only
