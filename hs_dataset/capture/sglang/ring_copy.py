"""The copy half of the SGLang plugin: one EXTEND pass's states, split by request, into the builders' rings.

For a pass that holds requests of ours (:mod:`hs_dataset.capture.sglang.plugin` wires the hooks), TP
rank 0 splits the batch by request (``extend_seq_lens_cpu``, start positions
``extend_prefix_lens_cpu``) and, on a side stream, reads each state once
(:func:`hs_dataset.codec.state_scan.scan_state`: a Triton kernel) for its NaN/Inf tokens, its fp8 codes
when a request's ring slot asks for fp8 and the statistics of the values each request stores
(:mod:`hs_dataset.codec.state_stats`), counts NaN/Inf per request and state, and copies each request's
rows straight into its region of the builder's shared-memory ring (:mod:`hs_dataset.capture.transport`),
registered as pinned memory. A completion thread (:class:`Completer`) waits for the copies, adds each
pass's statistics to its requests' and marks the rows done, beats the rings' heartbeats, drops the rings
of builders that are gone, and keeps running totals in ``plugin-stats.json``.

Imports torch and the transport only (it runs in SGLang's scheduler process).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from hs_dataset.capture.transport import ENCODINGS, PLUGIN_STATS, RingWriter, parse_rid, request_spans
from hs_dataset.codec.state_scan import scan_state
from hs_dataset.codec.state_stats import span_stats
from hs_dataset.codec.teacher import teacher_topk_spans
from hs_dataset.errors import RequestError, TransportError

__all__ = ["Completer", "PluginState", "S", "atomic_json", "aux_states", "copy_pass", "ring_of"]

# Seconds between checks that each ring's builder still holds its lock.
OWNER_CHECK_S = 2.0


class PluginState:
    """What the plugin's hooks share within one SGLang process (one instance, :data:`S`)."""

    config: Any = None  # HS_DATASET_CAPTURE, parsed (set by register())
    tp_rank: int = -1
    tp_size: int = 1
    vocab_size: int = 0  # the text model's vocabulary: the output embedding's rows beyond it are padding
    batch: Any = None  # the ForwardBatch of the EXTEND pass in progress, when it holds requests of ours
    text: Any = None  # the module owning capture_aux_hidden_states (and .model.layers_to_capture)
    aux_ids: list[int] = []  # layers_to_capture while capturing
    prenorm = False  # layer L-1 requested: captured from the final norm
    prenorm_state: Any = None
    side_stream: Any = None  # a torch.cuda.Stream (TP rank 0)
    completer: Any = None  # the Completer (TP rank 0)
    rings: "dict[str, RingWriter]" = {}
    lock = threading.Lock()
    seen: "OrderedDict[str, None]" = OrderedDict()  # requests already captured (radix-hit check), LRU


S = PluginState()


def atomic_json(path: Path, obj: dict) -> None:
    """Replace ``path`` with ``obj`` as JSON in one rename (the builder polls these files)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def aux_states(aux: Any, n: int, hidden: int) -> list:
    """The ``n`` aux states the LogitsProcessor got (a list, or SGLang's packed ``[tokens, n * H]``)."""
    if n == 0:
        return []
    if aux is None:
        raise RuntimeError("no aux hidden states reached the LogitsProcessor: EAGLE-3 capture is off")
    if isinstance(aux, (list, tuple)):
        return list(aux)
    return [aux[:, j * hidden:(j + 1) * hidden] for j in range(n)]  # packed [tokens, n * H]


def ring_of(token: str) -> RingWriter:
    """The builder's ring named ``token``, mapped and registered as pinned memory on first use."""
    with S.lock:
        w = S.rings.get(token)
        if w is not None:
            if w.dead:
                raise TransportError(f"the builder of ring {token} is gone")
            return w
        w = RingWriter.open(S.config["dir"], token)
        err = torch.cuda.cudart().cudaHostRegister(w.bytes.data_ptr(), w.bytes.numel(), 0)
        if int(getattr(err, "value", err)) != 0:
            w.close()
            raise TransportError(f"cudaHostRegister of the ring {w.path} failed (CUDA error "
                                 f"{int(getattr(err, 'value', err))}): the ring must be on a memory file system "
                                 "(tmpfs, e.g. /dev/shm)")
        S.rings[token] = w
        return w


def close_ring(token: str) -> None:
    """Drop a dead builder's ring (no copy into it is pending)."""
    w = S.rings.pop(token)
    torch.cuda.cudart().cudaHostUnregister(w.bytes.data_ptr())
    w.close()


def copy_pass(fb: Any, final: Any, aux: Any, prenorm: Any, lm_head: Any = None, teachers: Any = None) -> None:
    """Split one EXTEND pass by request and copy each request's rows into its ring slot (side stream);
    for a slot that asks for the teacher's top-k, compute it from ``final`` and ``lm_head`` first, or take it from
    ``teachers`` (``{rid: (ids, logprobs, lse)}``: computed across the TP ranks,
    :func:`hs_dataset.capture.sglang.teacher_ranks.pass_teachers`; None: this rank holds the whole vocabulary)."""
    t0 = time.perf_counter()
    cfg = S.config
    spans = request_spans(list(fb.rids), list(fb.extend_seq_lens_cpu), list(fb.extend_prefix_lens_cpu),
                          cfg["rid_prefix"])
    H = final.shape[-1]
    if S.prenorm and prenorm is None:
        raise RuntimeError("the final norm's hook saw no pre-norm state in this pass")
    states = aux_states(aux, len(S.aux_ids), H) + ([prenorm] if S.prenorm else []) + [final]
    todo = []
    given = {}  # (ring, seq) -> the teacher computed across the TP ranks
    for rid, off, start, n in spans:
        parsed = parse_rid(rid, cfg["rid_prefix"])
        if parsed is None:
            continue
        token, seq = parsed
        try:
            ring = ring_of(token)
            info = ring.slot(seq)
        except TransportError:
            S.completer.stats["lost_requests"] += 1  # no ring to tell: the builder times out or is gone
            continue
        if start > 0 and rid not in S.seen:
            # The first pass of this request starts after a prefix it did not compute: a radix-cache hit.
            ring.fail(seq, f"request {rid}: {start} prompt positions came from SGLang's radix cache and were not "
                           "computed, so their hidden states do not exist; run the server with --disable-radix-cache")
            continue
        top = teachers.get(rid) if info.teacher_k and teachers is not None else None
        if info.teacher_k and teachers is not None:
            if top is None or top[0].shape[1] != info.teacher_k:
                ring.fail(seq, f"request {rid}: no top-{info.teacher_k} teacher was computed across the {S.tp_size} TP "
                               "ranks for it (its id does not ask for that k, or the output embedding is not split "
                               "over the TP group): build without teacher, or run the engine with tp_size=1")
                continue
        elif info.teacher_k and (lm_head is None or not hasattr(lm_head, "weight")):
            ring.fail(seq, f"request {rid}: the LogitsProcessor got no output embedding with weights, which the "
                           "teacher's top-k needs: build without teacher")
            continue
        # a slot of len(states) - 1 states is one without the final state (a build that stores the teacher instead)
        if start + n > info.num_tokens or info.hidden != H or info.n_states not in (len(states), len(states) - 1):
            ring.fail(seq, f"request {rid}: rows {start}..{start + n} of {len(states)} states x {H} do not fit its "
                           f"ring slot ({info.num_tokens} tokens, {info.n_states} states x {info.hidden})")
            continue
        S.seen[rid] = None
        if len(S.seen) > 1_000_000:
            S.seen.popitem(last=False)
        if top is not None:
            given[(id(ring), seq)] = top
        todo.append((ring, info, off, start, n))
    todo = [job for job in todo if _room_for(*job)]
    if not todo:
        return
    main = torch.cuda.current_stream()
    side = S.side_stream
    side.wait_stream(main)
    # The states some request of the pass stores: without the final one when none keeps it (it is still the
    # teacher's input)
    stored = states[:max(info.n_states for _, info, _, _, _ in todo)]
    with torch.cuda.stream(side):
        # NaN/Inf positions per request and state: a cumulative count, read at each request's bounds.
        want_fp8 = any(info.encoding == ENCODINGS["fp8_e4m3"] for _, info, _, _, _ in todo)
        scans = [scan_state(st, fp8=want_fp8) for st in stored]  # one read of each
        bad = torch.stack([sc.nonfinite for sc in scans]).to(torch.int32)
        cs = torch.nn.functional.pad(bad.cumsum(dim=1, dtype=torch.int32), (1, 0))
        bounds = torch.tensor([off for _, _, off, _, _ in todo] + [off + n for _, _, off, _, n in todo],
                              dtype=torch.int64, pin_memory=True).to(final.device, non_blocking=True)
        k = len(todo)
        counts = torch.empty((len(stored), k), dtype=torch.int32, pin_memory=True)
        counts.copy_(cs[:, bounds[k:]] - cs[:, bounds[:k]], non_blocking=True)
        fp8: Any = [sc.fp8 for sc in scans] if want_fp8 else None
        # The statistics of the values each request stores (hs_dataset.codec.state_stats): per token here, added
        # up per request on the completion thread
        per_token = {}
        for enc in {info.encoding for _, info, _, _, _ in todo}:
            pt = torch.stack([sc.stats(fp8=enc == ENCODINGS["fp8_e4m3"]) for sc in scans])
            per_token[enc] = torch.empty(pt.shape, dtype=torch.float64, pin_memory=True)
            per_token[enc].copy_(pt, non_blocking=True)
        asks = [(ring, info, off, n) for ring, info, off, _, n in todo
                if info.teacher_k and (id(ring), info.seq) not in given]
        tops_of = dict(given)
        if asks:  # the pass's requests that ask for it, in as few matrix products as their rows allow
            weight = lm_head.weight[:S.vocab_size] if S.vocab_size else lm_head.weight
            tops = teacher_topk_spans(final, weight, [(off, n, info.teacher_k) for _, info, off, n in asks])
            tops_of.update({(id(ring), info.seq): t for (ring, info, _, _), t in zip(asks, tops)})
        nbytes = 0
        for ring, info, off, start, n in todo:
            for pos, k in info.pieces(start, n):  # a windowed region wraps: positions modulo its rows
                a = off + pos - start
                for j, st in enumerate(stored[:info.n_states]):
                    # Every destination is a contiguous slice of registered memory: a strided one would make
                    # PyTorch copy through a temporary and wait for the GPU, stalling the scheduler here.
                    dst = ring.state_view(info, j, pos, k)
                    if info.encoding == ENCODINGS["bfloat16"]:
                        dst.copy_(st[a:a + k].to(torch.bfloat16), non_blocking=True)
                    else:
                        dst.copy_(fp8[j][0][a:a + k], non_blocking=True)
                        ring.scale_view(info, j, pos, k).copy_(fp8[j][1][a:a + k], non_blocking=True)
                    nbytes += dst.numel() * dst.element_size()
                t = tops_of.get((id(ring), info.seq))
                if t is not None:
                    for dst_t, src_t in zip(ring.teacher_views(info, pos, k), t):
                        dst_t.copy_(src_t[a - off:a - off + k], non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    for t in states + [x for top in given.values() for x in top]:
        t.record_stream(side)  # keep the GPU memory alive until the copies have run
    with S.lock:
        for ring, *_ in todo:
            ring.pending += 1
    S.completer.put((done, counts, per_token,
                     [(ring, info.seq, n, info.encoding, off, info.n_states) for ring, info, off, _, n in todo]))
    st = S.completer.stats
    st["passes"] += 1
    st["rows"] += sum(n for *_, n in todo)
    st["bytes"] += nbytes
    st["hook_s"] += time.perf_counter() - t0


def _room_for(ring: RingWriter, info: Any, off: int, start: int, n: int) -> bool:
    """A windowed region (a sample larger than the ring): wait until the builder has written out the rows
    that positions ``[start, start + n)`` replace. This stalls the engine, which is the point: the
    states never pile up in memory. False when the request can no longer be delivered."""
    if not info.windowed:
        return True
    t0 = time.perf_counter()
    try:
        ring.wait_room(info, start + n, timeout=float(S.config.get("room_timeout_s", 600.0)))
    except (TransportError, RequestError) as e:
        ring.fail(info.seq, f"hs_dataset capture: {e}")
        S.completer.stats["lost_requests"] += 1
        return False
    finally:
        S.completer.stats["room_wait_s"] += time.perf_counter() - t0
    return True


class Completer:
    """Waits for each pass's copies, then marks the rows done (one thread); a second thread beats the rings'
    heartbeats, drops dead builders' rings and saves the running totals.

    Marking rows done is on the builder's critical path: once the engine has no more requests (the end of a
    build, or a consumer that fell behind), SGLang's scheduler thread polls for requests in Python and each
    time this thread lets go of the GIL it waits up to the switch interval (5 ms) to take it back. So a pass's
    completion holds it once, at the copies' event, and then runs Python and NumPy only (two reductions for
    all of the pass's requests, :func:`~hs_dataset.codec.state_stats.span_stats`); the file writes and lock
    checks of the housekeeping are on their own thread. (With PyTorch calls here, and the housekeeping on this
    thread, the last pass of a capture completed about a second after its copies: ``benchmarks/compact.py``'s
    capture rows.)"""

    def __init__(self, directory: str):
        self.dir = directory
        self.q: queue.Queue = queue.Queue()
        # hook_s: time in the LogitsProcessor hook on the scheduler thread; copy_wait_s: this thread waiting
        # for the device-to-host copies; lost_requests: requests of ours whose ring or slot was not found.
        # room_wait_s: the scheduler thread waiting for the builder to free a windowed region's rows
        self.stats = {"passes": 0, "rows": 0, "bytes": 0, "hook_s": 0.0, "copy_wait_s": 0.0, "room_wait_s": 0.0,
                      "lost_requests": 0}
        self._saved: dict | None = None
        self._stats_at = self._beat_at = self._owners_at = 0.0
        self.t = threading.Thread(target=self._run, name="hs_dataset-ring-completer", daemon=True)
        self.t.start()
        self.h = threading.Thread(target=self._keep, name="hs_dataset-ring-housekeeping", daemon=True)
        self.h.start()

    def put(self, job) -> None:
        self.q.put(job)

    def _run(self) -> None:
        while True:
            self._complete(*self.q.get())

    def _keep(self) -> None:
        while True:
            time.sleep(0.1)
            self._housekeeping()

    def _complete(self, done, counts, per_token, items) -> None:
        t0 = time.perf_counter()
        try:
            done.synchronize()  # lets go of the GIL: the one wait to take it back
            self.stats["copy_wait_s"] += time.perf_counter() - t0
            per_state = counts.numpy()  # pinned memory: no copy
            spans: dict[int, list[int]] = {}  # per encoding, the items' indices
            for i, item in enumerate(items):
                spans.setdefault(item[3], []).append(i)
            totals: dict[int, Any] = {}
            for enc, which in spans.items():
                sums = span_stats(per_token[enc].numpy(), [(items[i][4], items[i][2]) for i in which])
                for j, i in enumerate(which):
                    totals[i] = sums[:, j]
            for i, (ring, seq, n, _, _, n_states) in enumerate(items):
                ring.complete(seq, n, per_state[:n_states, i], totals[i][:n_states])
        except BaseException:
            for ring, seq, *_ in items:
                ring.fail(seq, "hs_dataset capture failed in the SGLang scheduler:\n" + traceback.format_exc()[-300:])
        finally:
            with S.lock:
                for ring, *_ in items:
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
                        close_ring(token)
        if now - self._stats_at >= 0.5 and self.stats != self._saved:
            self._stats_at = now
            self._saved = dict(self.stats, rings=len(S.rings))
            try:
                atomic_json(Path(self.dir, PLUGIN_STATS), {k: round(v, 4) for k, v in self._saved.items()})
            except OSError:
                pass  # statistics only
