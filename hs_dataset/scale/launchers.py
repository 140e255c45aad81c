"""Where a worker learns its share: ``--workers N|auto`` and ``--worker-index I``, a Slurm job array or
torchrun, and which GPUs and CPUs its engine needs.

``--workers auto`` takes the count from ``SLURM_ARRAY_TASK_COUNT`` (a Slurm job array) or torchrun's
``WORLD_SIZE``; ``--worker-index`` defaults to ``SLURM_ARRAY_TASK_ID`` (less ``SLURM_ARRAY_TASK_MIN``,
over ``SLURM_ARRAY_TASK_STEP``) or ``RANK``. Without ``--workers`` those variables are ignored: a
Slurm array of unrelated builds is not split. Under torchrun a worker that needs GPUs and finds
``CUDA_VISIBLE_DEVICES`` unset is given ``LOCAL_RANK``'s own GPUs.

Imports nothing heavy: the command line reads its flags through it.
"""

from __future__ import annotations

import os
import shlex
from typing import Mapping, MutableMapping

from hs_dataset.write.shares import WorkerShare
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ConfigError

__all__ = ["launcher_share", "parse_count", "pin_local_gpus", "resolve_share", "single_worker_command",
           "worker_count", "worker_resources"]


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not a number") from None


def launcher_share(env: Mapping[str, str] | None = None) -> tuple[int, int, str] | None:
    """(index, count, launcher) from a Slurm job array or torchrun's environment; None outside both.

    Raises:
        ConfigError: both are present (say which with ``--workers N --worker-index I``), or a value is not a number.
    """
    env = os.environ if env is None else env
    slurm = "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env
    torchrun = "RANK" in env and "WORLD_SIZE" in env
    if slurm and torchrun:
        raise ConfigError("both a Slurm job array (SLURM_ARRAY_TASK_ID) and torchrun (RANK) set this worker's "
                          "share: pass --workers N --worker-index I")
    if slurm:
        first, step = _env_int(env, "SLURM_ARRAY_TASK_MIN", 0), max(1, _env_int(env, "SLURM_ARRAY_TASK_STEP", 1))
        index = (_env_int(env, "SLURM_ARRAY_TASK_ID") - first) // step
        return index, _env_int(env, "SLURM_ARRAY_TASK_COUNT"), "Slurm array"
    if torchrun:
        return _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE"), "torchrun"
    return None


def parse_count(workers: str | int) -> int:
    """The number of ``--workers N``.

    Raises:
        ConfigError: not a number of at least 1.
    """
    try:
        count = int(workers)
    except ValueError:
        raise ConfigError(f"--workers {workers!r}: expected a number or auto") from None
    if count < 1:
        raise ConfigError(f"--workers {count}: use at least 1")
    return count


def worker_count(workers: str | int, env: Mapping[str, str] | None = None) -> int:
    """The number of ``--workers N|auto`` (auto: the launcher's count).

    Raises:
        ConfigError: not a number of at least 1, or auto with no launcher.
    """
    if str(workers) != "auto":
        return parse_count(workers)
    launched = launcher_share(env)
    if launched is None:
        raise ConfigError("--workers auto takes the count from a launcher (SLURM_ARRAY_TASK_COUNT of a Slurm job "
                          "array, torchrun's WORLD_SIZE) and none is set: pass --workers N --worker-index I")
    return launched[1]


def resolve_share(workers: str | int | None, worker_index: int | None,
                  env: Mapping[str, str] | None = None) -> WorkerShare:
    """This worker's share from ``--workers N|auto`` and ``--worker-index I``, the launcher filling in the rest.

    Raises:
        ConfigError: no count or no index can be found, they disagree with the launcher's, or are out of range.
    """
    launched = launcher_share(env)
    if workers is None:
        raise ConfigError("--worker-index needs --workers N (or --workers auto under a launcher)")
    count = worker_count(workers, env)
    if str(workers) != "auto":
        if launched is not None and worker_index is None and launched[1] != count:
            raise ConfigError(f"--workers {count} but the {launched[2]} has {launched[1]} workers: make them equal "
                              "(or use --workers auto)")
    if worker_index is None:
        if launched is None:
            raise ConfigError(f"--workers {count} needs --worker-index I (0..{count - 1}) outside a launcher "
                              "(a Slurm job array or torchrun sets it)")
        worker_index = launched[0]
    return WorkerShare(int(worker_index), count)


def worker_resources(config: HiddenStatesConfig, gpus_available: bool = True) -> tuple[float, float]:
    """(CPUs, GPUs) one worker's engine needs: ``tp_size`` GPUs for an SGLang engine it starts (none
    to attach to a server), one for transformers on CUDA (its default when ``gpus_available``), else none."""
    opts = config.backend_options
    if config.backend == "sglang":
        return 1.0, 0.0 if opts.get("sglang_url") else float(int(opts.get("tp_size", 1)))
    device = str(opts.get("device") or ("cuda" if gpus_available else "cpu"))
    return 1.0, 1.0 if device.startswith("cuda") else 0.0


def pin_local_gpus(config: HiddenStatesConfig, env: MutableMapping[str, str] | None = None) -> str | None:
    """Under torchrun (``LOCAL_RANK``) with ``CUDA_VISIBLE_DEVICES`` unset, show this worker only its
    own GPUs (local rank ``r`` with ``g`` GPUs per engine: ``r*g .. r*g+g-1``). -> the GPUs set, or None."""
    env = os.environ if env is None else env
    assert env is not None
    _, gpus = worker_resources(config)
    if "LOCAL_RANK" not in env or "CUDA_VISIBLE_DEVICES" in env or not gpus:
        return None
    first = _env_int(env, "LOCAL_RANK") * int(gpus)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + k) for k in range(int(gpus)))
    return env["CUDA_VISIBLE_DEVICES"]


def single_worker_command(command: str | None) -> str | None:
    """``command`` without ``--workers``, ``--worker-index`` and ``--ray``: the command that
    resumes (or repairs) the merged build in one process."""
    if command is None:
        return None
    words, kept = shlex.split(command), []
    skip = False
    for k, w in enumerate(words):
        if skip:
            skip = False
            continue
        flag = w.split("=", 1)[0]
        if flag in ("--workers", "--worker-index", "--ray"):
            nxt = words[k + 1] if k + 1 < len(words) else "-"
            skip = "=" not in w and (flag != "--ray" or not nxt.startswith("-"))  # as argparse read it
            continue
        kept.append(w)
    return shlex.join(kept)
