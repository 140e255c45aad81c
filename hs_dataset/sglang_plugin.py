"""SGLang plugin (entry point ``sglang.srt.plugins: hs_dataset_capture``), SGLang >= 0.5.11.

SGLang runs :func:`register` in the engine process and in every scheduler / TP worker process.
It does nothing unless ``HS_DATASET_CAPTURE`` is set (JSON: ``layers``, ``dir``, ``rid_prefix``,
optionally ``ring``), which :class:`hs_dataset.backends.sglang.SGLangBackend` does (or the user,
for a server the builder attaches to); so installing hs_dataset changes no other SGLang use.

Hooks (through SGLang's ``HookRegistry``; no SGLang file is copied or forked):

* AFTER ``ModelRunner.load_model``: find the text model, the module that owns the EAGLE-3 aux
  capture (the loaded model, or its ``language_model`` in wrappers such as Kimi-K2.5's
  ``KimiK25ForConditionalGeneration``), check the layers, TP rank and parallelism, and write a
  manifest into ``dir`` (TP rank 0). The capture stays **off**: it costs nothing for requests
  that are not ours.
* AROUND ``ModelRunner.forward``: for an EXTEND pass (``forward_mode.is_extend()``) that holds
  requests of ours, turn the aux capture on for that pass only, with the captured positions set
  directly (``layers_to_capture = [k + 1 for k in layers]``: the state entering decoder layer k+1 =
  the output of layer k), bypassing ``set_eagle3_layers_to_capture`` and its model-dependent +1.
  Decode passes and other requests' passes run exactly as without the plugin.
* A forward hook on the text model's final norm, only when the last decoder layer ``L-1`` is
  requested: its output's residual is that layer's output before the norm.
* AROUND ``LogitsProcessor.forward`` (the text model's own): it receives the final post-norm
  states of every token and the aux states. TP rank 0 splits the batch by request
  (``extend_seq_lens_cpu``, start positions ``extend_prefix_lens_cpu``) and, on a side stream,
  counts NaN/Inf per request and state, quantizes to fp8 when the request's ring slot asks for
  it (:func:`hs_dataset.fp8.fp8_quantize`), and copies each request's rows straight into its
  region of the builder's shared-memory ring (:mod:`hs_dataset.transport`), which is registered as
  pinned memory. A completion thread waits for the copies and marks the rows done. After TP's
  all-reduce the states are replicated: other ranks write nothing.

TP rank 0 also keeps running totals in ``plugin-stats.json`` in ``dir`` (passes and rows captured,
seconds spent in the hook on the scheduler thread, waiting for copies), so a slow build can tell the
engine's cost from its own.
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

from .compat_sglang import MIN_SGLANG, SUPPORTED_SGLANG, sglang_version_tuple
from .fp8 import fp8_quantize
from .transport import (ENCODINGS, ENV, MANIFEST, PLUGIN_ERROR, PLUGIN_STATS, RingWriter,
                        TransportError, parse_rid, request_spans)

__all__ = ["register"]

MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
LOGITS_PROCESSOR = "sglang.srt.layers.logits_processor.LogitsProcessor"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
HOOK_TARGETS = (MODEL_RUNNER + ".load_model", MODEL_RUNNER + ".forward", LOGITS_PROCESSOR + ".forward")
# Read, not hooked: which TP rank this process is (ModelRunner's own attributes moved between versions).
PARALLEL_TARGETS = (PARALLEL_STATE + ".get_tensor_model_parallel_rank",
                    PARALLEL_STATE + ".get_tensor_model_parallel_world_size",
                    PARALLEL_STATE + ".get_pipeline_model_parallel_world_size")
WRAPPER_ATTRS = ("language_model",)  # where ...ForConditionalGeneration wrappers keep their text model
OWNER_CHECK_S = 2.0


class _State:
    config: dict | None = None
    tp_rank: int = -1
    batch = None  # the ForwardBatch of the EXTEND pass in progress, when it holds requests of ours
    text = None  # the module owning capture_aux_hidden_states (and .model.layers_to_capture)
    aux_ids: list[int] = []  # layers_to_capture while capturing
    prenorm = False  # layer L-1 requested: captured from the final norm
    prenorm_state = None
    side_stream = None
    completer: "_Completer | None" = None
    rings: "dict[str, RingWriter]" = {}
    lock = threading.Lock()
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
                                  f"exist in this SGLang version (supported: {SUPPORTED_SGLANG})")
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

        if sglang_version_tuple(sglang.__version__) < MIN_SGLANG:
            raise ImportError(f"sglang {sglang.__version__} has no plugin framework (needs {SUPPORTED_SGLANG})")
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
        Path(cfg["dir"], PLUGIN_ERROR).write_text(text)
    except OSError:
        pass


def find_text_model(model):
    """The module owning the EAGLE-3 aux capture: ``model`` itself or a wrapper's text model."""
    for m in [model] + [getattr(model, a, None) for a in WRAPPER_ATTRS]:
        if m is not None and hasattr(m, "capture_aux_hidden_states") and \
                hasattr(getattr(m, "model", None), "layers_to_capture"):
            return m
    raise RuntimeError(f"{type(model).__name__} has no EAGLE-3 aux hidden-state capture in this SGLang version "
                       f"(needs capture_aux_hidden_states and model.layers_to_capture on the model or on its "
                       f"{' / '.join(WRAPPER_ATTRS)})")


def _check_engine(runner) -> None:
    args = getattr(runner, "server_args", None)
    if getattr(args, "enable_dp_attention", False):
        # Each DP rank schedules its own requests, but only TP rank 0 writes: the other ranks'
        # samples would never arrive. Refused rather than left to time out.
        raise RuntimeError("DP attention (--enable-dp-attention) is not supported by the hs_dataset capture: "
                           "start the engine without it")
    prefill = getattr(getattr(getattr(args, "cuda_graph_config", None), "prefill", None), "backend", "disabled")
    if str(getattr(prefill, "value", prefill)).lower() not in ("disabled", "none"):
        raise RuntimeError(f"prefill CUDA graphs (backend {prefill!r}) replay passes without the hs_dataset capture "
                           "hooks: start SGLang with --cuda-graph-backend-prefill disabled (decode graphs may stay on)")


def _after_load_model(result, runner, *args, **kwargs):
    cfg = S.config
    try:
        text = find_text_model(runner.model)
        inner = text.model
        _check_engine(runner)
        tp_rank, tp_size, pp_size = (int(_resolve(t)()) for t in PARALLEL_TARGETS)
        if pp_size != 1:
            raise RuntimeError("pipeline parallelism is not supported by the hs_dataset capture (use pp_size=1)")
        num_layers = len(inner.layers)
        bad = [k for k in cfg["layers"] if not 0 <= k <= num_layers - 1]
        if bad:
            raise RuntimeError(f"layers {bad} out of range 0..{num_layers - 1}")
        S.text, S.tp_rank = text, tp_rank
        S.aux_ids = [k + 1 for k in cfg["layers"] if k < num_layers - 1]
        S.prenorm = num_layers - 1 in cfg["layers"]
        _capture_on(False)  # off until a pass holds requests of ours
        if S.prenorm:
            inner.norm.register_forward_hook(_after_final_norm)
        if S.tp_rank != 0:  # replicated states: rank 0 writes them; the others only say they are here
            _atomic_json(Path(cfg["dir"], f"plugin-rank-{tp_rank}.json"), {"pid": os.getpid(), "tp_rank": tp_rank})
            return None
        import torch

        S.side_stream = torch.cuda.Stream()
        S.completer = _Completer(cfg["dir"])
        if cfg.get("ring"):
            _ring(cfg["ring"])  # the in-process builder's ring: mapped now, before the first request
        manifest = {"pid": os.getpid(), "layers": cfg["layers"], "layers_to_capture": S.aux_ids,
                    "prenorm_last_layer": S.prenorm, "model_class": type(runner.model).__name__,
                    "text_model_class": type(text).__name__, "num_layers": num_layers, "tp_rank": tp_rank,
                    "tp_size": tp_size, "hidden_size": int(text.config.hidden_size)}
        _atomic_json(Path(cfg["dir"], MANIFEST), manifest)
    except BaseException:
        _plugin_error(cfg, traceback.format_exc())
        raise
    return None


def _capture_on(on: bool) -> None:
    S.text.capture_aux_hidden_states = bool(on and S.aux_ids)
    S.text.model.layers_to_capture = list(S.aux_ids) if on else []


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _around_forward(original, runner, forward_batch, *args, **kwargs):
    prefix = S.config["rid_prefix"]
    ours = forward_batch.forward_mode.is_extend() and any(r.startswith(prefix) for r in (forward_batch.rids or []))
    if not ours:
        return original(runner, forward_batch, *args, **kwargs)
    S.batch = forward_batch
    _capture_on(True)
    try:
        return original(runner, forward_batch, *args, **kwargs)
    finally:
        _capture_on(False)
        S.batch = None
        S.prenorm_state = None


def _after_final_norm(_module, _inputs, output):
    if S.batch is not None:
        # fused add-RMSNorm returns (normed, residual + x): the last decoder layer's output, pre-norm
        S.prenorm_state = output[1] if isinstance(output, tuple) else _inputs[0]


def _around_logits(original, lp, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                   *args, **kwargs):
    fb = S.batch
    if fb is not None and lp is getattr(S.text, "logits_processor", lp):
        S.batch = None  # once per forward pass
        if S.tp_rank == 0:
            _capture(fb, hidden_states, aux_hidden_states, S.prenorm_state)
        mode = getattr(fb, "capture_hidden_mode", None)
        if mode is not None and not mode.need_capture():
            aux_hidden_states = None  # nobody else asked for them: spare the LogitsProcessor their pruning
    return original(lp, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)


def _aux_list(aux, n: int, hidden: int) -> list:
    if n == 0:
        return []
    if aux is None:
        raise RuntimeError("no aux hidden states reached the LogitsProcessor: EAGLE-3 capture is off")
    if isinstance(aux, (list, tuple)):
        return list(aux)
    return [aux[:, j * hidden:(j + 1) * hidden] for j in range(n)]  # packed [tokens, n * H]


def _ring(token: str) -> RingWriter:
    with S.lock:
        w = S.rings.get(token)
        if w is not None:
            if w.dead:
                raise TransportError(f"the builder of ring {token} is gone")
            return w
        import torch

        w = RingWriter.open(S.config["dir"], token)
        err = torch.cuda.cudart().cudaHostRegister(w.bytes.data_ptr(), w.bytes.numel(), 0)
        if int(getattr(err, "value", err)) != 0:
            w.close()
            raise TransportError(f"cudaHostRegister of the ring {w.path} failed (CUDA error "
                                 f"{int(getattr(err, 'value', err))}): the ring must be on a memory file system "
                                 "(tmpfs, e.g. /dev/shm)")
        S.rings[token] = w
        return w


def _close_ring(token: str) -> None:
    """Drop a dead builder's ring (no copy into it is pending)."""
    import torch

    w = S.rings.pop(token)
    torch.cuda.cudart().cudaHostUnregister(w.bytes.data_ptr())
    w.close()


def _capture(fb, final, aux, prenorm) -> None:
    import torch

    t0 = time.perf_counter()
    cfg = S.config
    spans = request_spans(list(fb.rids), list(fb.extend_seq_lens_cpu), list(fb.extend_prefix_lens_cpu),
                          cfg["rid_prefix"])
    H = final.shape[-1]
    if S.prenorm and prenorm is None:
        raise RuntimeError("the final norm's hook saw no pre-norm state in this pass")
    states = _aux_list(aux, len(S.aux_ids), H) + ([prenorm] if S.prenorm else []) + [final]
    todo = []
    for rid, off, start, n in spans:
        parsed = parse_rid(rid, cfg["rid_prefix"])
        if parsed is None:
            continue
        token, seq = parsed
        try:
            ring = _ring(token)
            info = ring.slot(seq)
        except TransportError:
            S.completer.stats["lost_requests"] += 1  # no ring to tell: the builder times out or is gone
            continue
        if start > 0 and rid not in S.seen:
            # The first pass of this request starts after a prefix it did not compute: a radix-cache hit.
            ring.fail(seq, f"request {rid}: {start} prompt positions came from SGLang's radix cache and were not "
                           "computed, so their hidden states do not exist; run the server with --disable-radix-cache")
            continue
        if start + n > info.num_tokens or info.hidden != H or info.n_states != len(states):
            ring.fail(seq, f"request {rid}: rows {start}..{start + n} of {len(states)} states x {H} do not fit its "
                           f"ring slot ({info.num_tokens} tokens, {info.n_states} states x {info.hidden})")
            continue
        S.seen[rid] = None
        if len(S.seen) > 1_000_000:
            S.seen.popitem(last=False)
        todo.append((ring, info, off, start, n))
    if not todo:
        return
    main = torch.cuda.current_stream()
    side = S.side_stream
    side.wait_stream(main)
    with torch.cuda.stream(side):
        # NaN/Inf positions per request and state: a cumulative count, read at each request's bounds.
        bad = torch.stack([(~torch.isfinite(st)).any(dim=-1) for st in states]).to(torch.int32)
        cs = torch.nn.functional.pad(bad.cumsum(dim=1, dtype=torch.int32), (1, 0))
        bounds = torch.tensor([off for _, _, off, _, _ in todo] + [off + n for _, _, off, _, n in todo],
                              dtype=torch.int64, pin_memory=True).to(final.device, non_blocking=True)
        k = len(todo)
        counts = torch.empty((len(states), k), dtype=torch.int32, pin_memory=True)
        counts.copy_(cs[:, bounds[k:]] - cs[:, bounds[:k]], non_blocking=True)
        fp8 = [fp8_quantize(st) for st in states] if any(
            info.encoding == ENCODINGS["fp8_e4m3"] for _, info, _, _, _ in todo) else None
        nbytes = 0
        for ring, info, off, start, n in todo:
            for j, st in enumerate(states):
                # Every destination is a contiguous slice of registered memory: a strided one would make
                # PyTorch copy through a temporary and wait for the GPU, stalling the scheduler here.
                dst = ring.state_view(info, j, start, n)
                if info.encoding == ENCODINGS["bfloat16"]:
                    dst.copy_(st[off:off + n].to(torch.bfloat16), non_blocking=True)
                else:
                    dst.copy_(fp8[j][0][off:off + n], non_blocking=True)
                    ring.scale_view(info, j, start, n).copy_(fp8[j][1][off:off + n], non_blocking=True)
                nbytes += dst.numel() * dst.element_size()
        done = torch.cuda.Event()
        done.record(side)
    for t in states:
        t.record_stream(side)  # keep the GPU memory alive until the copies have run
    with S.lock:
        for ring, *_ in todo:
            ring.pending += 1
    S.completer.put((done, counts, [(ring, info.seq, n) for ring, info, _, _, n in todo]))
    st = S.completer.stats
    st["passes"] += 1
    st["rows"] += sum(n for *_, n in todo)
    st["bytes"] += nbytes
    st["hook_s"] += time.perf_counter() - t0


class _Completer:
    """Waits for each pass's copies, then marks the rows done; beats and drops dead builders' rings."""

    def __init__(self, directory: str):
        self.dir = directory
        self.q: queue.Queue = queue.Queue()
        # hook_s: time in the LogitsProcessor hook on the scheduler thread; copy_wait_s: this thread waiting
        # for the device-to-host copies; lost_requests: requests of ours whose ring or slot was not found.
        self.stats = {"passes": 0, "rows": 0, "bytes": 0, "hook_s": 0.0, "copy_wait_s": 0.0, "lost_requests": 0}
        self._saved: dict | None = None
        self._stats_at = self._beat_at = self._owners_at = 0.0
        self.t = threading.Thread(target=self._run, name="hs_dataset-ring-completer", daemon=True)
        self.t.start()

    def put(self, job) -> None:
        self.q.put(job)

    def _run(self) -> None:
        while True:
            try:
                job = self.q.get(timeout=0.2)
            except queue.Empty:
                job = None
            if job is not None:
                self._complete(*job)
            self._housekeeping()

    def _complete(self, done, counts, items) -> None:
        t0 = time.perf_counter()
        try:
            done.synchronize()
            self.stats["copy_wait_s"] += time.perf_counter() - t0
            per_state = counts.tolist()
            for i, (ring, seq, n) in enumerate(items):
                ring.complete(seq, n, [row[i] for row in per_state])
        except BaseException:
            for ring, seq, _ in items:
                ring.fail(seq, "hs_dataset capture failed in the SGLang scheduler:\n" + traceback.format_exc()[-300:])
        finally:
            with S.lock:
                for ring, _, _ in items:
                    ring.pending -= 1

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._beat_at >= 0.5:
            self._beat_at = now
            with S.lock:
                for w in S.rings.values():
                    w.beat()
        if now - self._owners_at >= OWNER_CHECK_S:
            self._owners_at = now
            with S.lock:
                for token, w in list(S.rings.items()):
                    if not w.dead and not w.owner_alive():
                        w.dead = True
                    if w.dead and w.pending == 0:
                        _close_ring(token)
        if now - self._stats_at >= 0.5 and self.stats != self._saved:
            self._stats_at = now
            self._saved = dict(self.stats, rings=len(S.rings))
            try:
                _atomic_json(Path(self.dir, PLUGIN_STATS), {k: round(v, 4) for k, v in self._saved.items()})
            except OSError:
                pass  # statistics only
