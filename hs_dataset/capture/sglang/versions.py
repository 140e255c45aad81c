"""What hs_dataset knows about SGLang versions, in one place (the plugin and the backend import it).

The audited releases (docs/sglang-releases.md; tests/sglang_audit checks every touchpoint of each one's source):
0.5.14 through 0.5.23. The minimum is 0.5.14, not 0.5.11 (the first release with the plugin framework):

* 0.5.11-0.5.13 run prefill through piecewise CUDA graphs by default on CUDA (``disable_piecewise_cuda_graph``,
  no ``cuda_graph_config``): replayed passes would skip the capture hooks, and no run of ours covered them;
* 0.5.11-0.5.12's ``deepseek_v2.py`` adds 1 to every EAGLE-3 layer id (0.5.13+: only when the first id is 1).

``ServerArgs`` changed shape twice inside the range: a dataclass up to 0.5.19, a ``msgspec.Struct`` from 0.5.20
(:func:`server_arg_names`); from 0.5.19 the fields keep what the caller passed and the values SGLang resolved live
in its declarations (``sglang/srt/arg_groups/overrides.py``: ``resolution_result``), which :func:`resolved` reads.

Imports nothing heavy: the plugin loads it in SGLang's scheduler process before SGLang is checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hs_dataset.errors import BackendError

__all__ = ["ALLOW_UNTESTED", "AUDITED_SGLANG", "GPU_TESTED_SGLANG", "MAX_SGLANG", "MIN_SGLANG", "SUPPORTED_SGLANG",
           "outside_audited_range",
           "chunked_prefill_size", "check_sglang_version", "dp_attention_size", "engine_processes",
           "prefill_cuda_graph", "resolved", "server_arg_names", "sglang_version_tuple",
           "stop_before_kill", "watched_children"]

MIN_SGLANG = (0, 5, 14)  # the oldest audited release (see the module docstring for why not 0.5.11)
MAX_SGLANG = (0, 5, 23)  # the newest audited release: pyproject's [sglang] extra allows no newer one
GPU_TESTED_SGLANG = "0.5.17"  # what the GPU suite ran on (the device's torch allows no newer one)
AUDITED_SGLANG = f"{'.'.join(map(str, MIN_SGLANG))} - {'.'.join(map(str, MAX_SGLANG))}"
SUPPORTED_SGLANG = AUDITED_SGLANG
ALLOW_UNTESTED = "backend_options.allow_untested_sglang=true"


def sglang_version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.17.post1"`` -> ``(0, 5, 17)``."""
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def outside_audited_range(version: str) -> str | None:
    """None for an audited release; else the one-line refusal naming the range and the opt-in."""
    v = sglang_version_tuple(version)
    if MIN_SGLANG <= v[:3] <= MAX_SGLANG:
        return None
    return (f"SGLang {version} is outside the releases hs_dataset's capture is audited for ({AUDITED_SGLANG}): "
            f"install one of them (pip install 'hs-dataset[sglang]'), or go on at your own risk with --set "
            f"{ALLOW_UNTESTED} (the start-up self-check still compares the captured layers)")


def check_sglang_version(allow_untested: bool = False) -> str:
    """Return the installed SGLang version.

    Args:
        allow_untested: go on with a release outside the audited range.

    Raises:
        BackendError: SGLang is not installed, or (without ``allow_untested``) is outside the audited range.
    """
    try:
        import sglang  # optional: pip install 'hs-dataset[sglang]'
    except ImportError as e:
        raise BackendError(f"the sglang backend needs SGLang {AUDITED_SGLANG}: pip install 'hs-dataset[sglang]' "
                           f"({e})") from None
    refusal = outside_audited_range(sglang.__version__)
    if refusal and not allow_untested:
        raise BackendError(refusal)
    return sglang.__version__


def server_arg_names(cls: Any) -> set[str]:
    """The fields of SGLang's ``ServerArgs``: a dataclass up to 0.5.19, a ``msgspec.Struct`` from 0.5.20 (where
    ``dataclasses.fields`` raises ``TypeError``)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    names = getattr(cls, "__struct_fields__", None)  # msgspec.Struct: its field names, in order
    if names is None:
        raise TypeError(f"{cls!r} is neither a dataclass nor a msgspec.Struct: an SGLang outside {AUDITED_SGLANG}?")
    return set(names)


def resolved(args: Any, name: str, default: Any = None) -> Any:
    """The value SGLang resolved for the ``ServerArgs`` field ``name``: from 0.5.19 through SGLang's own
    ``resolution_result`` (the field keeps what the caller passed: ``None`` for a default), before it the field."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result  # optional: SGLang >= 0.5.19
    except ImportError:  # older SGLang: __post_init__ wrote the resolved values into the fields
        return getattr(args, name, default)
    try:
        return resolution_result(args, name, default)
    except Exception:  # not a ServerArgs record (a resolved view, a namespace): its attribute is the value
        return getattr(args, name, default)


def _backend_name(backend: Any) -> str:
    return str(getattr(backend, "value", backend)).lower()


def prefill_cuda_graph(args: Any) -> str | None:
    """The backend that replays prefill passes as CUDA graphs (``"breakable"``, ``"full"``...), None when prefill
    runs eagerly. From 0.5.19 prefill graphs are on by default on CUDA and only the resolved
    ``cuda_graph_config`` says so; 0.5.14-0.5.18 resolve it into the field."""
    if resolved(args, "disable_cuda_graph", False) is True and resolved(args, "cuda_graph_config") is None:
        return None
    cfg = resolved(args, "cuda_graph_config")
    prefill = getattr(cfg, "prefill", None)
    if isinstance(cfg, dict):
        prefill = cfg.get("prefill")
    backend = prefill.get("backend") if isinstance(prefill, dict) else getattr(prefill, "backend", None)
    if backend is None:  # nothing resolved (a raw record): the explicit option, if any
        backend = resolved(args, "cuda_graph_backend_prefill")
    name = _backend_name(backend) if backend is not None else "disabled"
    return None if name in ("disabled", "none") else name


def dp_attention_size(args: Any) -> int:
    """How many DP attention ranks the engine runs (1: DP attention off): ``attn_dp_size`` from 0.5.22
    (``enable_dp_attention`` is its deprecated spelling), ``enable_dp_attention`` with ``dp_size`` before."""
    size = resolved(args, "attn_dp_size")
    if isinstance(size, int) and size > 1:
        return size
    if resolved(args, "enable_dp_attention", False) is True:
        dp = resolved(args, "dp_size", 1)
        return max(2, int(dp)) if isinstance(dp, int) else 2
    return 1


def chunked_prefill_size(args: Any) -> int | None:
    """The most positions of one request a prefill pass computes, as SGLang resolved it (None: chunked prefill
    off, or this record never went through resolution)."""
    size = resolved(args, "chunked_prefill_size")
    return int(size) if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


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
