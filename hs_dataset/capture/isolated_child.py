"""The child side of :class:`~hs_dataset.capture.isolated.ProcessBackend`: the backend process's
entry point, and the framing both sides use (a pickled header, then raw tensor bytes)."""

from __future__ import annotations

import os
import pickle
import queue
import signal
import struct
import threading
import traceback
from typing import Any, Iterator

import torch
import tqdm

from hs_dataset.atomic import write_all
from hs_dataset.processes import set_parent_death_signal
from hs_dataset.capture.registry import backend_class
from hs_dataset.model_info import ModelInfo
from hs_dataset.records import CaptureResult, TokenizedSample

__all__ = ["HEADER", "child_main"]

HEADER = struct.Struct("<QQ")  # pickled message length, raw payload length

# Blocking I/O, a reader thread, the backend in the main thread.


def _read_exact_blocking(fd: int, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _child_send(fd: int, msg: tuple, payload: memoryview | None = None) -> None:
    meta = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    size = 0 if payload is None else payload.nbytes
    write_all(fd, HEADER.pack(len(meta), size) + meta)
    if payload is not None and size:
        write_all(fd, payload)


def _child_reader(fd: int, inbox: queue.Queue) -> None:
    try:
        while True:
            head = _read_exact_blocking(fd, HEADER.size)
            if head is None:
                break
            n, size = HEADER.unpack(head)
            meta = _read_exact_blocking(fd, n)
            if meta is None or (size and _read_exact_blocking(fd, size) is None):
                break
            inbox.put(pickle.loads(meta))
    except OSError:
        pass
    inbox.put(("eof",))




def child_main(rfd_conn: Any, wfd_conn: Any, name: str, model: str | ModelInfo, layers: tuple[int, ...], revision: str | None,
                options: dict[str, Any], parent_pid: int, death_signal: bool) -> None:
    """Entry point of the backend process."""
    if death_signal:
        set_parent_death_signal(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    try:  # progress bars would create a multiprocessing lock that a killed child leaks; a thread lock will do

        tqdm.tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    rfd, wfd = rfd_conn.fileno(), wfd_conn.fileno()
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_child_reader, args=(rfd, inbox), name="hs_dataset-backend-inbox", daemon=True).start()
    try:
        backend = backend_class(name)(model, layers, revision=revision, **options)
        _child_send(wfd, ("ready", backend.versions()))
    except BaseException as e:
        _child_send(wfd, ("error", None, type(e).__name__, str(e)[:20000], traceback.format_exc()[-20000:]))
        return
    try:
        while True:
            msg = inbox.get()
            if msg[0] in ("close", "eof"):
                return
            if msg[0] == "capture":
                if not _child_capture(backend, msg[1], inbox, wfd):
                    return
    except BrokenPipeError:
        return  # the parent is gone
    finally:
        backend.close()


def _child_capture(backend, epoch: int, inbox: queue.Queue, wfd: int) -> bool:
    """Serve one ``capture`` call; False when the child must exit (close or end-of-file)."""
    keep_going = True

    def samples() -> Iterator[TokenizedSample]:
        nonlocal keep_going
        while True:
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                _child_send(wfd, ("starved", epoch))
                msg = inbox.get()
            kind = msg[0]
            if kind in ("close", "eof"):
                keep_going = False
                return
            if len(msg) > 1 and msg[1] != epoch:
                continue  # left over from an abandoned capture
            if kind == "sample":
                yield msg[2]
            elif kind == "end":
                return

    try:
        for item in backend.capture(samples()):
            if isinstance(item, CaptureResult):
                st, counted = item.states, item.value_stats
                if st.dtype != torch.bfloat16 or st.device.type != "cpu":
                    st, counted = st.to("cpu", torch.bfloat16), None  # counted of other values than these
                st = st.contiguous()
                raw = st.view(torch.uint8).reshape(-1).numpy()
                _child_send(wfd, ("result", epoch, item.sample.sample_id, tuple(st.shape),
                                  None if counted is None else counted.tolist()), memoryview(raw.data))
            else:
                _child_send(wfd, ("reject", epoch, item))
        if keep_going:
            _child_send(wfd, ("done", epoch))
    except BrokenPipeError:
        raise
    except Exception as e:
        _child_send(wfd, ("error", epoch, type(e).__name__, str(e)[:20000], traceback.format_exc()[-20000:]))
    return keep_going
