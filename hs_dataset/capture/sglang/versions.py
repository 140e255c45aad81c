"""What hs_dataset knows about SGLang versions, in one place (the plugin and the backend import it).

Imports nothing heavy: the plugin loads it in SGLang's scheduler process before SGLang is checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hs_dataset.errors import BackendError

__all__ = ["MIN_SGLANG", "SUPPORTED_SGLANG", "TESTED_SGLANG", "check_sglang_version", "engine_processes",
           "sglang_version_tuple", "sigquit_option", "stop_before_kill", "watched_children"]

MIN_SGLANG = (0, 5, 11)  # the first release with the plugin framework (entry points + HookRegistry)
TESTED_SGLANG = "0.5.17"  # what the GPU suite ran on
SUPPORTED_SGLANG = f"{'.'.join(map(str, MIN_SGLANG))} - {TESTED_SGLANG}"


def sglang_version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.17.post1"`` -> ``(0, 5, 17)``."""
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def check_sglang_version() -> str:
    """Return the installed SGLang version; raise a clear error when it has no plugin framework."""
    need = ".".join(map(str, MIN_SGLANG))
    try:
        import sglang  # optional: pip install 'hs-dataset[sglang]'
    except ImportError as e:
        raise BackendError(f"the sglang backend needs SGLang >= {need}: pip install 'hs-dataset[sglang]' ({e})") from None
    if sglang_version_tuple(sglang.__version__) < MIN_SGLANG:
        raise BackendError(f"SGLang {sglang.__version__} is older than {need}, which added the plugin framework "
                           f"hs_dataset patches through: upgrade SGLang (tested: {SUPPORTED_SGLANG})")
    return sglang.__version__


def watched_children(engine: Any) -> list[tuple[str, Any]]:
    """``(name, multiprocessing.Process)`` of an in-process engine's children, as SGLang's own subprocess
    watchdog lists them (``tokenizer_manager._subprocess_watchdog``, 0.5.17: scheduler_TP<i>, detokenizer):
    their names and exit codes say what died. Empty where this SGLang keeps no such list."""
    dog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    procs, names = getattr(dog, "_processes", None), getattr(dog, "_names", None)
    if not procs:
        return []
    return list(zip(names or [f"process {i}" for i in range(len(procs))], procs))


def stop_before_kill(engine: Any) -> None:
    """What ``sglang.Engine.shutdown`` does before it SIGKILLs every child of this process (0.5.17): stop its
    subprocess watchdog (a killed child is no fault then), close its RPC socket, let its weight-cache daemons
    clean up. The caller then kills the engine's own processes only."""
    dog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    if dog is not None:
        dog.stop()
    rpc = getattr(engine, "send_to_rpc", None)
    if rpc is not None:
        rpc.close(linger=0)
        engine.send_to_rpc = None
    daemons = getattr(engine, "_weight_cache_daemon_procs", None)
    if daemons:
        engine._terminate_weight_cache_daemons(daemons)
        engine._weight_cache_daemon_procs = []


def sigquit_option() -> str | None:
    """The ``ServerArgs`` field that takes our SIGQUIT handler (``custom_sigquit_handler``, 0.5.17), if this
    SGLang has one. Without it a child that dies makes SGLang kill this whole process tree, the builder
    included, with no message."""
    from sglang.srt.server_args import ServerArgs  # optional: pip install 'hs-dataset[sglang]'

    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return "custom_sigquit_handler" if "custom_sigquit_handler" in names else None


def engine_processes() -> list:
    """SGLang's long-lived children (scheduler / TP workers, detokenizer): they name themselves
    ``sglang::...``. Short-lived helpers (kernel compilers, resource trackers) are left out: their
    normal exit is no engine death."""
    try:
        import psutil  # optional: without it, request timeouts bound a dead engine
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
