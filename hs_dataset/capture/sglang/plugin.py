"""The SGLang plugin's hooks (entry point ``sglang.srt.plugins: hs_dataset_capture`` =
``hs_dataset.capture.sglang.plugin:register``), SGLang >= 0.5.14.

SGLang runs :func:`register` in the engine process and in every scheduler / TP worker process.
It does nothing unless ``HS_DATASET_CAPTURE`` is set (JSON: ``layers``, ``dir``, ``rid_prefix``,
optionally ``ring``), which :class:`hs_dataset.capture.sglang.backend.SGLangBackend` does (or the user,
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
  states of every token and the aux states, which TP rank 0 hands to
  :func:`hs_dataset.capture.sglang.ring_copy.copy_pass` (split by request, copied into the
  builders' rings). After TP's all-reduce the states are replicated: other ranks write nothing. With the
  output embedding split over the TP ranks, every rank first takes its part of the teacher's top-k of the
  requests that ask for it (:func:`hs_dataset.capture.sglang.teacher_ranks.pass_teachers`, one all-gather).

TP rank 0 also keeps running totals in ``plugin-stats.json`` in ``dir`` (passes and rows captured,
seconds spent in the hook on the scheduler thread, waiting for copies), so a slow build can tell the
engine's cost from its own.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import traceback
from pathlib import Path

import torch

from hs_dataset.capture.selfcheck import ReferenceHooks, residual_sum, selfcheck_file
from hs_dataset.capture.sglang.ring_copy import Completer, S, atomic_json, copy_pass, ring_of
from hs_dataset.capture.sglang.teacher_ranks import pass_teachers, vocab_shard
from hs_dataset.capture.sglang.versions import (SUPPORTED_SGLANG, chunked_prefill_size, dp_attention_size,
                                               prefill_cuda_graph, sglang_version_tuple)
from hs_dataset.capture.transport import ENV, MANIFEST, PLUGIN_ERROR, SCHEDULER_ERROR, parse_rid, request_spans
from hs_dataset.codec.state_scan import warm_up as scan_warm_up
from hs_dataset.codec.teacher import warm_up as teacher_warm_up

__all__ = ["register"]

logger = logging.getLogger(__name__)

MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
LOGITS_PROCESSOR = "sglang.srt.layers.logits_processor.LogitsProcessor"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
HOOK_TARGETS = (MODEL_RUNNER + ".load_model", MODEL_RUNNER + ".forward", LOGITS_PROCESSOR + ".forward")
# Read, not hooked: which TP rank this process is (ModelRunner's own attributes moved between versions).
PARALLEL_TARGETS = (PARALLEL_STATE + ".get_tensor_model_parallel_rank",
                    PARALLEL_STATE + ".get_tensor_model_parallel_world_size",
                    PARALLEL_STATE + ".get_pipeline_model_parallel_world_size")
TP_GROUP = PARALLEL_STATE + ".get_tp_group"  # its all_gather, for the teacher of a split output embedding
PLUGIN_FRAMEWORK = (0, 5, 11)  # entry points + HookRegistry (the audited range is checked by the builder)
WRAPPER_ATTRS = ("language_model",)  # where ...ForConditionalGeneration wrappers keep their text model


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
        import sglang  # optional: pip install 'hs-dataset[sglang]'
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: pip install 'hs-dataset[sglang]'

        if sglang_version_tuple(sglang.__version__) < PLUGIN_FRAMEWORK:
            raise ImportError(f"sglang {sglang.__version__} has no plugin framework (needs {SUPPORTED_SGLANG})")
        for t in HOOK_TARGETS + PARALLEL_TARGETS + (TP_GROUP,):
            _resolve(t)
        S.config = cfg
        _watch_scheduler_errors(cfg["dir"])
        HookRegistry.register(MODEL_RUNNER + ".load_model", _after_load_model, HookType.AFTER)
        HookRegistry.register(MODEL_RUNNER + ".forward", _around_forward, HookType.AROUND)
        HookRegistry.register(LOGITS_PROCESSOR + ".forward", _around_logits, HookType.AROUND)
    except BaseException:
        _plugin_error(cfg, traceback.format_exc())
        raise


class _SchedulerErrors(logging.Handler):
    """Keeps the last line of an exception SGLang's scheduler logs ("Scheduler hit an exception: ...") in
    ``dir``, where the builder reads it: a failed start or a dead scheduler is then named by its cause
    (not enough memory, an unloadable model...) instead of "see the messages above"."""

    def __init__(self, directory: str):
        super().__init__(level=logging.ERROR)
        self.path = Path(directory, SCHEDULER_ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if "Scheduler hit an exception" not in text:
                return
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            atomic_json(self.path, {"pid": os.getpid(), "line": lines[-1] if lines else text[:500]})
        except Exception:  # a log handler never raises into SGLang
            pass


def _watch_scheduler_errors(directory: str) -> None:
    logging.getLogger("sglang.srt.managers.scheduler").addHandler(_SchedulerErrors(directory))


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
    """Refuse what the capture cannot serve, from the settings SGLang resolved (0.5.19+ keeps them out of the
    fields: :mod:`hs_dataset.capture.sglang.versions`)."""
    args = getattr(runner, "server_args", None)
    dp = dp_attention_size(args)
    if dp > 1:
        # Each DP rank schedules its own requests, but only TP rank 0 writes: the other ranks'
        # samples would never arrive. Refused rather than left to time out.
        raise RuntimeError(f"DP attention ({dp} ranks: --attn-dp-size / --enable-dp-attention) is not supported by "
                           "the hs_dataset capture: start the engine without it")
    prefill = prefill_cuda_graph(args)
    if prefill is not None:
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
        S.text, S.tp_rank, S.tp_size = text, tp_rank, tp_size
        S.vocab_size = int(getattr(text.config, "vocab_size", 0) or 0)
        S.aux_ids = [k + 1 for k in cfg["layers"] if k < num_layers - 1]
        S.prenorm = num_layers - 1 in cfg["layers"]
        _capture_on(False)  # off until a pass holds requests of ours
        if S.prenorm:
            inner.norm.register_forward_hook(_after_final_norm)
        dtype = getattr(runner, "dtype", torch.bfloat16)
        # the teacher's rows on this rank: the whole vocabulary, or this rank's part of a split output embedding
        shard = vocab_shard(getattr(text, "lm_head", None), S.vocab_size)
        teacher_rows = shard[1] if shard else S.vocab_size or int(text.config.vocab_size)
        if S.tp_rank != 0:  # replicated states: rank 0 writes them; the others only say they are here
            no_lse = teacher_warm_up(teacher_rows, dtype) if shard and teacher_rows else None  # their teacher part
            part = ("pytorch: " + no_lse if no_lse else "triton") if shard else None
            atomic_json(Path(cfg["dir"], f"plugin-rank-{tp_rank}.json"), {"pid": os.getpid(), "tp_rank": tp_rank,
                                                                       "teacher_lse": part})
            return None
        S.side_stream = torch.cuda.Stream()
        # Triton compiles the state scan's and the teacher's kernels on first use (seconds): now, not in a build's
        # first pass
        no_kernel = scan_warm_up(int(text.config.hidden_size), dtype)
        if no_kernel:
            logger.warning("hs_dataset capture: the state scan's Triton kernel is not used (%s): "
                           "the PyTorch operations count instead, slower", no_kernel)
        no_lse = teacher_warm_up(teacher_rows, dtype) if teacher_rows else None
        if no_lse:
            logger.warning("hs_dataset capture: the teacher's Triton logsumexp is not used (%s): "
                           "PyTorch takes it of a float32 copy of the logits instead, slower", no_lse)
        S.completer = Completer(cfg["dir"])
        if cfg.get("ring"):
            ring_of(cfg["ring"])  # the in-process builder's ring: mapped now, before the first request
        import sglang  # optional: pip install 'hs-dataset[sglang]'

        manifest = {"pid": os.getpid(), "sglang_version": sglang.__version__, "layers": cfg["layers"],
                    "layers_to_capture": S.aux_ids,
                    "prenorm_last_layer": S.prenorm, "model_class": type(runner.model).__name__,
                    "text_model_class": type(text).__name__, "num_layers": num_layers, "tp_rank": tp_rank,
                    "tp_size": tp_size, "hidden_size": int(text.config.hidden_size),
                    "chunked_prefill_size": _chunked_prefill_size(runner),
                    "state_scan": "pytorch: " + no_kernel if no_kernel else "triton",
                    "teacher_lse": "pytorch: " + no_lse if no_lse else "triton",
                    "teacher_vocab_shard": list(shard) if shard else None}
        atomic_json(Path(cfg["dir"], MANIFEST), manifest)
    except BaseException:
        _plugin_error(cfg, traceback.format_exc())
        raise
    return None


def _chunked_prefill_size(runner) -> int | None:
    """The most positions of one request a prefill pass computes (None: chunked prefill is off)."""
    return chunked_prefill_size(getattr(runner, "server_args", None))


def _tp_all_gather(t: torch.Tensor) -> torch.Tensor:
    """The TP ranks' ``t`` concatenated along the first dimension, in rank order (SGLang's TP group, as the
    LogitsProcessor gathers the logits)."""
    return _resolve(TP_GROUP)().all_gather(t, dim=0)  # type: ignore[operator]


def _capture_on(on: bool) -> None:
    S.text.capture_aux_hidden_states = bool(on and S.aux_ids)
    S.text.model.layers_to_capture = list(S.aux_ids) if on else []


_SEEN_RINGS: set[str] = set()  # ring tokens whose first pass was looked at for a self-check request


def _self_check_hooks(fb) -> tuple[str, ReferenceHooks] | None:
    """For the first pass holding requests of a ring whose builder asked for the start-up self-check (it wrote
    ``selfcheck-<token>.want`` before its first request, the warm-up prompt): forward hooks on every decoder layer
    and the final norm, keeping that request's rows (:mod:`hs_dataset.capture.selfcheck`). One file check per ring."""
    if S.tp_rank != 0:
        return None
    prefix, found = S.config["rid_prefix"], None
    for rid, off, _start, n in request_spans(list(fb.rids), list(fb.extend_seq_lens_cpu),
                                             list(fb.extend_prefix_lens_cpu), prefix):
        parsed = parse_rid(rid, prefix)
        if parsed is None or parsed[0] in _SEEN_RINGS:
            continue
        _SEEN_RINGS.add(parsed[0])
        if found is None and selfcheck_file(S.config["dir"], parsed[0], "want").exists():
            found = (parsed[0], off, n)
    if found is None:
        return None
    token, off, n = found
    inner = S.text.model
    return token, ReferenceHooks(list(inner.layers), getattr(inner, "norm", None), read=_layer_output,
                                 rows=(off, off + n))


def _layer_output(output):
    """An SGLang decoder layer's output (hs_dataset's layer k), from what its forward returned: ``(hidden,
    residual, ...)`` up to 0.5.20 (llama: 0.5.21); from 0.5.21 (deepseek_v2: ``(hidden, topk_indices)``) / 0.5.22
    (llama) the layer returns its contribution and the residual waits in ``forward_batch.residual_stream``, which
    SGLang's own ``residual_batch.snapshot`` adds (a copy; nothing consumed). TP rank 0 only runs this: with TP > 1
    a snapshot of an unreduced output would be a collective on one rank, so the builder checks at tp_size=1 only."""
    fb = S.batch
    if getattr(fb, "residual_stream", None) is None:
        return residual_sum(output)
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch  # optional: SGLang >= 0.5.21

    return residual_batch.snapshot(output[0] if isinstance(output, (tuple, list)) else output, fb)


def _save_self_check(token: str, hooks: ReferenceHooks) -> None:
    hooks.remove()
    path = selfcheck_file(S.config["dir"], token, "pt")
    tmp = path.with_suffix(".tmp")
    torch.save(hooks.cpu(), tmp)
    os.replace(tmp, path)


def _around_forward(original, runner, forward_batch, *args, **kwargs):
    prefix = S.config["rid_prefix"]
    ours = forward_batch.forward_mode.is_extend() and any(r.startswith(prefix) for r in (forward_batch.rids or []))
    if not ours:
        return original(runner, forward_batch, *args, **kwargs)
    check = _self_check_hooks(forward_batch)
    S.batch = forward_batch
    _capture_on(True)
    try:
        return original(runner, forward_batch, *args, **kwargs)
    finally:
        _capture_on(False)
        S.batch = None
        S.prenorm_state = None
        if check is not None:
            _save_self_check(*check)


def _after_final_norm(_module, _inputs, output):
    if S.batch is not None:
        # fused add-RMSNorm returns (normed, residual + x): the last decoder layer's output, pre-norm. A copy: SGLang
        # lends that residual buffer (0.5.22+: "the capture callback owns retention"), the ring's copy runs later
        S.prenorm_state = (output[1] if isinstance(output, tuple) else _inputs[0]).clone()


def _around_logits(original, lp, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                   *args, **kwargs):
    fb = S.batch
    if fb is not None and lp is getattr(S.text, "logits_processor", lp):
        S.batch = None  # once per forward pass
        teachers = None
        if S.tp_size > 1:  # every rank: its part of the teacher, when the output embedding is split (a collective)
            teachers = pass_teachers(fb, hidden_states, lm_head, S.config["rid_prefix"], S.vocab_size, S.tp_size,
                                     S.tp_rank, _tp_all_gather)
        if S.tp_rank == 0:
            copy_pass(fb, hidden_states, aux_hidden_states, S.prenorm_state, lm_head, teachers)
        mode = getattr(fb, "capture_hidden_mode", None)
        if mode is not None and not mode.need_capture():
            aux_hidden_states = None  # nobody else asked for them: spare the LogitsProcessor their pruning
    return original(lp, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)
