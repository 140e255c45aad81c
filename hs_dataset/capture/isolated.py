"""Run any capture backend in a child process, so that its death or hang ends the build cleanly.

``ProcessBackend`` starts the named backend (``transformers``, ``sglang``) in a child process
(``multiprocessing`` *spawn*) and streams samples to it and results back over two pipes:

* parent -> child: small pickled messages (the tokenized samples);
* child -> parent: a pickled header per item, and for a :class:`~hs_dataset.records.CaptureResult`
  the raw bytes of its bf16 ``states`` tensor, written by the child straight from the tensor's
  memory and read by the parent straight into a freshly allocated tensor (one copy each side; no
  pickling of tensors, no shared-memory files that a killed process could leak). Pipes are
  resized to 1 MiB where the kernel allows it.

The parent never blocks without a deadline: every read and write waits with ``select`` and checks
the child's exit status about every 0.2 s. So

* the child dies (killed, out of memory, crashed) -> :class:`~hs_dataset.errors.BackendError`
  within a fraction of a second, naming the process, its exit code or signal, and that rerunning
  the same command resumes the build;
* the child returns nothing for ``timeout`` seconds while a result is due (hang, SIGSTOP,
  deadlock in a collective) -> it is killed and ``BackendError`` is raised;
* the child is still starting after ``start_timeout`` seconds -> ``BackendError``.

Flow control: the parent keeps at most ``max_inflight`` samples ahead of the results it has
received; a backend that batches more than that (it waits for input) says so ("starved") and gets
one more sample at a time, so the two sides can never wait for each other.

The child ends when the parent closes it, when its input pipe reaches end-of-file (the parent
died), or (Linux) by ``PR_SET_PDEATHSIG`` when the parent dies: no orphan keeps a GPU.

Use it through the build configuration::

    backend_options: {"isolate": true, "timeout": 600, ...the backend's own options...}
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import select
import threading
import time
from collections import deque
from typing import Any, Iterable, Iterator

import torch

from hs_dataset.capture.base import BackendItem
from hs_dataset.capture.isolated_child import HEADER, child_main
from hs_dataset.processes import describe_exit
from hs_dataset.errors import BackendError, ConfigError
from hs_dataset.layout import StorageDtype
from hs_dataset.model_info import ModelInfo, target_of
from hs_dataset.records import CaptureResult, TokenizedSample

__all__ = ["ProcessBackend"]

_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031
_POLL = 0.2  # seconds between liveness checks while waiting
_MAX_MESSAGE = 1 << 30


class _Timeout(Exception):
    pass


def _grow_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
    except (OSError, ImportError):
        pass




# ------------------------------------------------------------------------------------------------
# parent side: non-blocking I/O with deadlines
# ------------------------------------------------------------------------------------------------


def _shutdown(proc: mp.process.BaseProcess, fds: list[int], grace: float) -> None:
    """Stop the child (close asks nicely first, through its input pipe being closed) and close fds."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    if proc.pid is None:
        return
    proc.join(grace)
    if proc.exitcode is None:
        proc.kill()
        proc.join(10)


class ProcessBackend:
    """A capture backend run in a child process (see the module docstring).

    Results cross the pipe as bf16 (``encodings``); ``continuous`` is False: each part is its own call.

    Args:
        name: the backend to run there (``transformers`` or ``sglang``).
        model, layers, revision: as for that backend.
        options: that backend's own options.
        timeout, start_timeout, max_inflight: the isolation's options
            (:class:`~hs_dataset.capture.options.IsolateOptions`, which says what each does).
    """

    continuous = False
    encodings: tuple[StorageDtype, ...] = ("bfloat16",)

    def __init__(self, name: str, model: str | ModelInfo, layers: Iterable[int], *, revision: str | None = None,
                 options: dict[str, Any] | None = None, timeout: float = 600.0, start_timeout: float = 3600.0,
                 max_inflight: int = 64):
        self.name = name
        self.info, self.layers = target_of(model, layers, revision)
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.max_inflight = max(1, int(max_inflight))
        if self.timeout <= 0 or self.start_timeout <= 0:
            raise ConfigError(f"backend_options.timeout={timeout} and start_timeout={start_timeout}: both must be > 0 "
                              "seconds", field="backend_options.timeout", value=timeout)
        self._dead: str | None = None
        self._epoch = 0
        self._versions: dict[str, str] = {}
        ctx = mp.get_context("spawn")
        to_child_r, to_child_w = ctx.Pipe(duplex=False)
        from_child_r, from_child_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=child_main, name=f"hs_dataset-{name}-backend",
            args=(to_child_r, from_child_w, name, self.info, self.layers, revision, dict(options or {}), os.getpid(),
                  threading.current_thread() is threading.main_thread()))
        self._proc.start()
        to_child_r.close()  # the child holds these now: its death closes the pipes
        from_child_w.close()
        self._wfd = os.dup(to_child_w.fileno())
        self._rfd = os.dup(from_child_r.fileno())
        to_child_w.close()
        from_child_r.close()
        for fd in (self._wfd, self._rfd):
            os.set_blocking(fd, False)
            _grow_pipe(fd)
        self._fds = [self._wfd, self._rfd]
        # runs at interpreter exit before multiprocessing joins its children (or when collected)
        self._finalizer = mp.util.Finalize(self, _shutdown, args=(self._proc, self._fds, 5.0), exitpriority=10)
        try:
            msg, _ = self._recv(time.monotonic() + self.start_timeout, starting=True)
            if msg[0] == "error":
                self._fail(f"the {name} backend failed to start in process {self._proc.pid}: {msg[2]}: {msg[3]}\n"
                           f"{msg[4]}", kill=False)
            if msg[0] != "ready":
                self._fail(f"the {name} backend process sent {msg[0]!r} instead of 'ready'")
            self._versions = dict(msg[1])
        except BaseException:
            self.close()
            raise

    # -- liveness -------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The child's process id (for monitoring; tests kill it)."""
        return self._proc.pid

    def _fail(self, reason: str, *, kill: bool = True) -> None:
        if self._dead is None:
            self._dead = reason
        if kill and self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(10)
        raise BackendError(self._dead)

    def _died(self) -> None:
        self._proc.join(2)  # an end-of-file may come a moment before the exit status
        code = self._proc.exitcode
        self._fail(f"the {self.name} capture backend process (pid {self._proc.pid}) {describe_exit(code)}; "
                   "the build stopped, nothing of the unfinished part was kept. Run the same command again "
                   "to resume the build from its finished parts.")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise BackendError(self._dead)
        if self._proc.exitcode is not None:
            self._died()

    # -- framed, deadline-bound I/O --------------------------------------------------------------
    def _wait(self, fd: int, write: bool, deadline: float) -> None:
        while True:
            self._check_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout()
            r, w, _ = select.select([] if write else [fd], [fd] if write else [], [], min(left, _POLL))
            if r or w:
                return

    def _read_into(self, view: memoryview, deadline: float) -> None:
        got = 0
        while got < len(view):
            try:
                k = os.readv(self._rfd, [view[got:]])
            except BlockingIOError:
                self._wait(self._rfd, False, deadline)
                continue
            if k == 0:
                self._died()
            got += k

    def _recv(self, deadline: float, *, starting: bool = False) -> tuple[tuple, torch.Tensor | None]:
        try:
            head = bytearray(HEADER.size)
            self._read_into(memoryview(head), deadline)
            n, size = HEADER.unpack(head)
            if n > _MAX_MESSAGE:
                self._fail(f"the {self.name} backend process sent a corrupt message header")
            meta = bytearray(n)
            # a message that has begun is finished within the timeout too
            deadline = max(deadline, time.monotonic() + self.timeout)
            self._read_into(memoryview(meta), deadline)
            msg = pickle.loads(meta)
            payload = None
            if size:
                payload = torch.empty(size, dtype=torch.uint8)
                self._read_into(memoryview(payload.numpy().data), deadline)
            return msg, payload
        except _Timeout:
            waited = self.start_timeout if starting else self.timeout
            what = "started (loaded the model)" if starting else "returned anything"
            knob = "start_timeout" if starting else "timeout"
            self._fail(f"the {self.name} capture backend process (pid {self._proc.pid}) has not {what} for "
                       f"{waited:g} s: it hangs (stopped, deadlocked, or a batch takes longer than "
                       f"backend_options.{knob}={waited:g}, which you can raise). It was killed; the build "
                       "stopped, nothing of the unfinished part was kept. Run the same command again to resume.")
        raise AssertionError("unreachable")

    def _send(self, msg: tuple) -> None:
        data = memoryview(self._frame(msg))
        deadline = time.monotonic() + self.timeout
        try:
            while data:
                try:
                    k = os.write(self._wfd, data)
                    data = data[k:]
                except BlockingIOError:
                    self._wait(self._wfd, True, deadline)
                except BrokenPipeError:
                    self._died()
        except _Timeout:
            self._fail(f"the {self.name} capture backend process (pid {self._proc.pid}) took no input for "
                       f"{self.timeout:g} s: it hangs. It was killed; the build stopped. Run the same command again "
                       "to resume.")

    @staticmethod
    def _frame(msg: tuple) -> bytes:
        meta = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        return HEADER.pack(len(meta), 0) + meta

    # -- the protocol ------------------------------------------------------------------------------
    def versions(self) -> dict[str, str]:
        return dict(self._versions)

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[BackendItem]:
        self._check_alive()
        self._epoch += 1
        epoch = self._epoch
        self._send(("capture", epoch))
        it = iter(samples)
        pending: deque[TokenizedSample] = deque()
        exhausted = finished = False

        def send_next() -> None:
            nonlocal exhausted
            s = next(it, None)
            if s is None:
                exhausted = True
                self._send(("end", epoch))
                return
            pending.append(s)
            self._send(("sample", epoch, s))

        try:
            while True:
                while not exhausted and len(pending) < self.max_inflight:
                    send_next()
                msg, payload = self._recv(time.monotonic() + self.timeout)
                kind = msg[0]
                if kind == "error":
                    self._fail(f"the {self.name} backend failed in its process (pid {self._proc.pid}): "
                               f"{msg[2]}: {msg[3]}\n{msg[4]}", kill=False)
                if msg[1] != epoch:
                    continue  # from an earlier, abandoned capture call
                if kind == "starved":
                    if not exhausted:
                        send_next()
                elif kind == "done":
                    if pending:
                        self._fail(f"the {self.name} backend process finished a capture with {len(pending)} "
                                   "sample(s) unanswered")
                    finished = True
                    return
                elif kind in ("result", "reject"):
                    if not pending:
                        self._fail(f"the {self.name} backend process answered a sample it was not sent")
                    s = pending.popleft()
                    sid = msg[2] if kind == "result" else msg[2].sample_id
                    if sid != s.sample_id:
                        self._fail(f"the {self.name} backend process answered {sid!r} where {s.sample_id!r} was due")
                    if kind == "reject":
                        yield msg[2]
                    else:
                        shape = msg[3]
                        states = payload.view(torch.bfloat16).view(shape) if payload is not None else \
                            torch.empty(shape, dtype=torch.bfloat16)
                        counted = None if msg[4] is None else torch.tensor(msg[4], dtype=torch.float64)
                        yield CaptureResult(sample=s, layers=self.layers, states=states, value_stats=counted)
                else:
                    self._fail(f"the {self.name} backend process sent an unknown message {kind!r}")
        finally:
            if not finished and self._dead is None and self._proc.exitcode is None and not exhausted:
                try:  # let the child finish this capture; its late answers are skipped by epoch
                    self._send(("end", epoch))
                except BackendError:
                    pass

    def close(self) -> None:
        """Ask the child to stop (closing its input), wait briefly, then kill it if needed."""
        if self._fds and self._dead is None and self._proc.exitcode is None:
            try:
                os.write(self._wfd, self._frame(("close",)))
                self._proc.join(60)  # the backend's own close (an engine shutdown) may take a while
            except OSError:
                pass
        self._finalizer()
