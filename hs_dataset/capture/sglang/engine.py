"""The SGLang backend's own engine: ``sglang.Engine`` started in this process with the plugin's settings.

The engine's event loop runs on a thread of ours; requests are its ``async_generate`` coroutines.
The radix cache stays disabled (a prefix hit skips computing those positions, so their hidden
states would not exist) and prefill CUDA graphs off (they would replay passes without the
plugin's hooks); decode graphs are unaffected.

Faults:

* a scheduler, TP worker or detokenizer that dies: SGLang's watchdog sends this process SIGQUIT,
  whose default handler kills the whole process tree, the builder included, without a word. The
  engine is started with SGLang's own ``custom_sigquit_handler`` option instead, which only notes it;
  :meth:`OwnEngine.alive` (polled about every 0.1 s while a request is due) then raises one
  :class:`~hs_dataset.errors.BackendError` naming the process and how it ended, the build stops and
  keeps its finished parts;
* this process dying: SGLang's schedulers and detokenizer die with it (their ``PR_SET_PDEATHSIG``);
* a failed start (out of GPU memory, a model SGLang cannot load, a port in use): one line saying
  which, and what to change (:func:`start_error`);
* closing: only the processes the engine's start began are killed. ``sglang.Engine.shutdown`` kills
  every child of this process, so a trainer reading the build's stream that the same script started
  (found by the device's stream test) or a DataLoader's workers died with it.

SGLang logs at ``warning`` level (``--debug`` / ``HS_DATASET_DEBUG=1``: ``info``). Its scheduler's
weight-loading bar ("Multi-thread loading shards") stays: SGLang passes tqdm ``disable=`` explicitly, so
``TQDM_DISABLE`` cannot reach it, and silencing it would mean patching
tqdm inside SGLang's processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

from hs_dataset.processes import describe_exit
from hs_dataset.capture.sglang.versions import engine_processes, server_arg_names, stop_before_kill, watched_children
from hs_dataset.capture.transport import ENV, SCHEDULER_ERROR
from hs_dataset.errors import BackendError

__all__ = ["CHILD_DIED", "OwnEngine", "on_sigquit", "scheduler_error", "sglang_engine_args", "start_error"]

DEBUG_ENV = "HS_DATASET_DEBUG"
CHILD_DIED = threading.Event()  # set by on_sigquit: SGLang's watchdog saw one of its processes die


def on_sigquit(signum: int, frame: Any) -> None:
    """The engine's SIGQUIT handler (SGLang's ``custom_sigquit_handler``): note that a child died; the build's
    liveness check (:meth:`OwnEngine.alive`) says which and stops the build. A module-level function: SGLang
    pickles its server arguments for its child processes."""
    CHILD_DIED.set()


def _children() -> list:
    """This process's direct children now, as psutil processes (empty without psutil)."""
    try:
        import psutil  # optional: SGLang depends on it
    except ImportError:
        return []
    return psutil.Process().children()


def _child_pids() -> set[int]:
    return {p.pid for p in _children()}


def _started_since(before: set[int]) -> list:
    """This process's direct children that were not there in ``before``: what an engine start began."""
    return [p for p in _children() if p.pid not in before]


def _under(proc: Any, pids: set[int]) -> bool:
    """Whether the psutil process ``proc`` is one of ``pids`` or runs under one of them."""
    try:
        return proc.pid in pids or any(a.pid in pids for a in proc.parents())
    except Exception:  # psutil.Error: it is gone
        return False


def _kill_trees(roots: list, wait_s: float = 60.0) -> None:
    """SIGKILL each of ``roots`` and every process under it, then wait until they are gone (SGLang's shutdown
    does the same to every child of this process: a trainer or worker this process started too)."""
    if not roots:  # nothing started, or no psutil to tell
        return
    import psutil  # optional: SGLang depends on it

    victims = []
    for root in roots:
        try:
            victims += root.children(recursive=True) + [root]
        except psutil.Error:  # gone already
            continue
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=wait_s)


def scheduler_error(ring_dir: str | os.PathLike) -> str | None:
    """The last line of the exception SGLang's scheduler logged, as the plugin kept it (None: none)."""
    try:
        return str(json.loads(Path(ring_dir, SCHEDULER_ERROR).read_text())["line"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def start_error(e: BaseException, args: dict[str, Any], cause: str | None = None) -> BackendError:
    """What a failed ``sglang.Engine`` start means, in one line with the fix (``cause``: the scheduler's
    own exception, when it logged one: SGLang's error then only says "see the messages above")."""
    text = " ".join((f"{cause} ({e})" if cause else str(e)).split())
    low = text.lower()
    model = args.get("model_path")
    if "out of memory" in low or "not enough memory" in low or "memory capacity is unbalanced" in low \
            or "max_total_num_tokens" in low or "kv cache" in low and "memory" in low:
        frac = args.get("mem_fraction_static", "SGLang's default")
        return BackendError(f"SGLang could not start: the model and its KV cache do not fit in GPU memory at "
                            f"mem_fraction_static={frac} ({text[:300]}): free the GPU, change "
                            "backend_options.engine_args.mem_fraction_static, or use more GPUs (tp_size)")
    if "address already in use" in low or "errno 98" in low:
        return BackendError(f"SGLang could not start: a port it needs is in use ({text[:300]}): stop what holds it, "
                            "or set backend_options.engine_args.port to a free one")
    if isinstance(e, (OSError, ValueError, KeyError)) or "config" in low or "safetensors" in low:
        return BackendError(f"SGLang could not load the model directory {model} ({type(e).__name__}: {text[:300]}): "
                            "check that it holds the model's config.json and weights, and that this SGLang supports "
                            "its architecture")
    return BackendError(f"SGLang could not start ({type(e).__name__}: {text[:400]}); see SGLang's log above "
                        "(--debug shows more)")


def sglang_engine_args(model: str, *, tp_size: int = 1, chunked_prefill_size: int | None = None, debug: bool = False,
                sigquit: bool = True, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``sglang.Engine`` (``ServerArgs``) arguments of an in-process engine, for the installed SGLang's fields
    (a dataclass up to 0.5.19, a ``msgspec.Struct`` from 0.5.20: :func:`server_arg_names`).

    Args:
        model: the model directory. tp_size, chunked_prefill_size: SGLang's (None: its default).
        debug: SGLang logs at ``info`` (else ``warning``). sigquit: take SGLang's SIGQUIT (:func:`on_sigquit`;
            only on the main thread). extra: the user's ``engine_args`` (they win).

    Raises:
        BackendError: ``disable_radix_cache=False``, or an argument this SGLang's ``ServerArgs`` does not have.
    """
    import sglang  # optional: pip install 'hs-dataset[sglang]'
    from sglang.srt.server_args import ServerArgs  # optional: pip install 'hs-dataset[sglang]'

    names = server_arg_names(ServerArgs)
    args: dict[str, Any] = dict(model_path=model, tp_size=tp_size, skip_tokenizer_init=True,
                                disable_radix_cache=True, log_level="info" if debug else "warning")
    if "cuda_graph_backend_prefill" in names:
        args["cuda_graph_backend_prefill"] = "disabled"  # replayed passes would skip the capture hooks
    if chunked_prefill_size is not None:
        args["chunked_prefill_size"] = int(chunked_prefill_size)
    if sigquit and "custom_sigquit_handler" in names:
        args["custom_sigquit_handler"] = on_sigquit
    args.update(extra or {})
    if not args.get("disable_radix_cache", True):
        raise BackendError("disable_radix_cache=False: a radix-cache prefix hit skips computing those positions, "
                           "so their hidden states would not exist; leave the cache disabled")
    unknown = sorted(set(args) - names)
    if unknown:
        raise BackendError(f"backend_options.engine_args: SGLang {sglang.__version__} has no setting "
                           f"{', '.join(map(repr, unknown))} (see python -m sglang.launch_server --help)")
    return args


class OwnEngine:
    """An in-process ``sglang.Engine`` whose plugin captures ``layers`` into the ring ``ring_token`` in ``ring_dir``.

    Args:
        model: the model directory. layers: the captured layers (hs_dataset's convention).
        ring_dir: the private ring folder. ring_token: the ring's name. rid_prefix: our request ids' prefix.
        tp_size: tensor parallel size. chunked_prefill_size: passed to SGLang (None: its default).
        engine_args: more ``sglang.Engine`` arguments (they win over the defaults).

    Raises:
        BackendError: ``disable_radix_cache=False`` was asked for, or the engine could not start.
    """

    remote = False
    manifest_wait_s = 5.0  # the plugin writes its manifest while the engine loads the model

    def __init__(self, model: str, layers: tuple[int, ...], *, ring_dir: str, ring_token: str, rid_prefix: str,
                 tp_size: int = 1, chunked_prefill_size: int | None = None, engine_args: dict[str, Any] | None = None):
        import sglang as sgl  # optional: pip install 'hs-dataset[sglang]'

        os.environ[ENV] = json.dumps({"layers": list(layers), "dir": ring_dir, "rid_prefix": rid_prefix,
                                      "ring": ring_token})
        allowed = os.environ.get("SGLANG_PLUGINS")
        if allowed and "hs_dataset_capture" not in allowed.split(","):
            os.environ["SGLANG_PLUGINS"] = allowed + ",hs_dataset_capture"
        CHILD_DIED.clear()
        args = sglang_engine_args(model, tp_size=tp_size, chunked_prefill_size=chunked_prefill_size,
                                  debug=os.environ.get(DEBUG_ENV, "") not in ("", "0"),
                                  sigquit=threading.current_thread() is threading.main_thread(), extra=engine_args)
        before = _child_pids()
        try:
            self.engine = sgl.Engine(**args)
        except BackendError:
            raise
        except Exception as e:  # SGLang raises many kinds at start (RuntimeError, torch.OutOfMemoryError, OSError...)
            _kill_trees(_started_since(before))  # what the failed start left would hold the GPU
            raise start_error(e, args, scheduler_error(ring_dir)) from e
        self._started = _started_since(before)  # the engine's processes (and what its start began): close() ends them
        self._ring_dir = ring_dir
        self._children = watched_children(self.engine)
        self._others = [p for p in engine_processes() if _under(p, {q.pid for q in self._started})]
        self.loop: asyncio.AbstractEventLoop = self.engine.loop
        self._loop_thread: threading.Thread | None = threading.Thread(
            target=self.loop.run_forever, name="hs_dataset-sglang-loop", daemon=True)
        self._loop_thread.start()

    def submit(self, rid: str, ids: list[int], params: dict[str, Any]) -> cf.Future:
        """Send one request; its future gives SGLang's output dict."""
        return asyncio.run_coroutine_threadsafe(
            self.engine.async_generate(input_ids=ids, sampling_params=params, rid=rid), self.loop)

    def alive(self) -> None:
        """Raise :class:`BackendError` naming the SGLang process that died, and how."""
        for name, proc in self._children:
            if not proc.is_alive() and proc.exitcode != 0:
                cause = scheduler_error(self._ring_dir)
                raise BackendError(f"SGLang's {name} process (pid {proc.pid}) {describe_exit(proc.exitcode)}"
                                   + (f" after: {cause}" if cause else "") + "; the build stopped, its finished parts "
                                   "are kept. Run the same command again to resume")
        dead = [p for p in self._others if not p.is_running() or p.status() == "zombie"]
        if dead or CHILD_DIED.is_set():
            which = ", ".join(f"pid {p.pid}" for p in dead) or "a child process"
            cause = scheduler_error(self._ring_dir)
            raise BackendError(f"SGLang's engine lost {which} (" + (cause or "SGLang reported a failed child") +
                               "); the build stopped, its finished parts are kept. Run the same command again to "
                               "resume")

    def close(self) -> None:
        """Cancel what is still pending on the engine's loop, stop the loop, then the engine."""
        if self._loop_thread is not None:
            def cancel_all() -> None:
                for task in asyncio.all_tasks(self.loop):
                    task.cancel()

            self.loop.call_soon_threadsafe(cancel_all)  # no "Task was destroyed but it is pending!" at exit
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._loop_thread.join(timeout=30)
            self._loop_thread = None
        try:
            if self._started:  # not sglang.Engine.shutdown(): it SIGKILLs every child of this process, ours too
                stop_before_kill(self.engine)
                _kill_trees(self._started)
            else:  # no psutil to tell the engine's processes from others
                self.engine.shutdown()
        finally:
            os.environ.pop(ENV, None)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGQUIT, signal.SIG_DFL)  # our handler goes with the engine
