"""Scale-out: one version built by many workers, each with its own engine, then merged into one build.

    hs-dataset build SCRIPT -o OUT --num-shards 4 --shard-index 1   # one worker: shard 1 of 4
    hs-dataset build SCRIPT -o OUT --num-shards auto                # index and count from Slurm / torchrun
    hs-dataset merge OUT                                            # (automatic when the last shard ends)
    hs-dataset build SCRIPT -o OUT --ray [ADDRESS]                  # every shard as a Ray task (ray_build)

The source is split **by part** (``part_size`` rows): part ``p`` belongs to shard ``p % N``
(:func:`shard_parts`). Parts keep their global index, so a part's record, its files
(``train-PPPPP-SSS``) and their content hashes are exactly those of a single-worker build. Each
shard is its own resumable build (lock, part records, recovery: :mod:`hs_dataset.resume`) in
``OUT/.hs_build/shards/shard-IIIII-of-NNNNN/`` (never published). Its ``.hs_build/shard.json``
records which shard it is, the whole plan (parts, rows, part size), the model, layers, the
configuration (redacted) and the build command, and ``done`` once every part of the shard is
recorded. A shard holds no ``hs_dataset.json``: it cannot be pushed or loaded by mistake.

A worker that finishes its shard and finds every shard of ``OUT`` done merges them
(:func:`hs_dataset.merge.merge_shards`: checks, hard links, the normal finalize); a worker that finds
another one merging leaves it to that one. ``hs-dataset merge`` does the same by hand.

Launchers: ``--num-shards auto`` takes the count from ``SLURM_ARRAY_TASK_COUNT`` (a Slurm job
array) or torchrun's ``WORLD_SIZE``; ``--shard-index`` defaults to ``SLURM_ARRAY_TASK_ID`` (less
``SLURM_ARRAY_TASK_MIN``, over ``SLURM_ARRAY_TASK_STEP``) or ``RANK``. Without ``--num-shards``
those variables are ignored: a Slurm array of unrelated builds is not split. Under torchrun a worker
that needs GPUs and finds ``CUDA_VISIBLE_DEVICES`` unset is given ``LOCAL_RANK``'s own GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .errors import ConfigError, ConfigMismatchError
from .layout import SHARD_FILE, SHARDS_DIR, STATE_DIR, shard_dir_name
from .redact import redact
from .resume import atomic_write, part_record

if TYPE_CHECKING:  # kept out of the import: the command line imports this module for its flags
    from .backends import CaptureBackend
    from .config import HiddenStatesConfig
    from .merge import MergeSummary
    from .records import Counts
    from .shard_writer import BuildSummary

__all__ = ["ShardSpec", "begin_shard", "build_shard", "count_parts", "finish_shard", "launcher_shard",
           "merge_if_complete", "parse_count", "pin_local_gpus", "read_shard", "resolve_shard", "shard_dir",
           "shard_count", "shard_parts", "single_worker_command", "worker_resources"]


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` (0-based) of ``count``: the parts ``p`` with ``p % count == index``."""

    index: int
    count: int

    def __post_init__(self):
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ConfigError(f"shard index {self.index} of {self.count} shards: the index must be in 0..count-1 "
                              "and the count at least 1")

    @property
    def name(self) -> str:
        return shard_dir_name(self.index, self.count)


def shard_parts(n_parts: int, num_shards: int) -> list[list[int]]:
    """The parts of each shard of a build of ``n_parts`` parts: part ``p`` belongs to shard ``p % num_shards``.

    Raises:
        ConfigError: ``num_shards`` < 1.
    """
    if num_shards < 1:
        raise ConfigError(f"--num-shards {num_shards}: use at least 1")
    return [list(range(i, n_parts, num_shards)) for i in range(num_shards)]


def count_parts(config: HiddenStatesConfig) -> int:
    """How many parts a build of ``config`` has (its source's rows, at most ``max_samples``, per ``part_size``)."""
    from .resume import part_ranges
    from .sources import rows_to_build

    return len(part_ranges(rows_to_build(config.source, config.max_samples), config.part_size))


def shard_dir(out: str | os.PathLike, spec: ShardSpec) -> Path:
    """``OUT/.hs_build/shards/shard-IIIII-of-NNNNN``: where the worker of ``spec`` builds."""
    return Path(out) / STATE_DIR / SHARDS_DIR / spec.name


# -- launchers ----------------------------------------------------------------------------------------
def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not a number") from None


def launcher_shard(env: Mapping[str, str] | None = None) -> tuple[int, int, str] | None:
    """(index, count, launcher) from a Slurm job array or torchrun's environment; None outside both.

    Raises:
        ConfigError: both are present (say which with ``--num-shards N --shard-index I``), or a value is not a number.
    """
    env = os.environ if env is None else env
    slurm = "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env
    torchrun = "RANK" in env and "WORLD_SIZE" in env
    if slurm and torchrun:
        raise ConfigError("both a Slurm job array (SLURM_ARRAY_TASK_ID) and torchrun (RANK) set this worker's "
                          "shard: pass --num-shards N --shard-index I")
    if slurm:
        first, step = _env_int(env, "SLURM_ARRAY_TASK_MIN", 0), max(1, _env_int(env, "SLURM_ARRAY_TASK_STEP", 1))
        index = (_env_int(env, "SLURM_ARRAY_TASK_ID") - first) // step
        return index, _env_int(env, "SLURM_ARRAY_TASK_COUNT"), "Slurm array"
    if torchrun:
        return _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE"), "torchrun"
    return None


def parse_count(num_shards: str | int) -> int:
    """The number of ``--num-shards N``.

    Raises:
        ConfigError: not a number of at least 1.
    """
    try:
        count = int(num_shards)
    except ValueError:
        raise ConfigError(f"--num-shards {num_shards!r}: expected a number or auto") from None
    if count < 1:
        raise ConfigError(f"--num-shards {count}: use at least 1")
    return count


def shard_count(num_shards: str | int, env: Mapping[str, str] | None = None) -> int:
    """The number of ``--num-shards N|auto`` (auto: the launcher's count).

    Raises:
        ConfigError: not a number of at least 1, or auto with no launcher.
    """
    if str(num_shards) != "auto":
        return parse_count(num_shards)
    launched = launcher_shard(env)
    if launched is None:
        raise ConfigError("--num-shards auto takes the count from a launcher (SLURM_ARRAY_TASK_COUNT of a Slurm job "
                          "array, torchrun's WORLD_SIZE) and none is set: pass --num-shards N --shard-index I")
    return launched[1]


def resolve_shard(num_shards: str | int | None, shard_index: int | None,
                  env: Mapping[str, str] | None = None) -> ShardSpec:
    """This worker's shard from ``--num-shards N|auto`` and ``--shard-index I``, the launcher filling in the rest.

    Raises:
        ConfigError: no count or no index can be found, they disagree with the launcher's, or are out of range.
    """
    launched = launcher_shard(env)
    if num_shards is None:
        raise ConfigError("--shard-index needs --num-shards N (or --num-shards auto under a launcher)")
    count = shard_count(num_shards, env)
    if str(num_shards) != "auto":
        if launched is not None and shard_index is None and launched[1] != count:
            raise ConfigError(f"--num-shards {count} but the {launched[2]} has {launched[1]} workers: make them equal "
                              "(or use --num-shards auto)")
    if shard_index is None:
        if launched is None:
            raise ConfigError(f"--num-shards {count} needs --shard-index I (0..{count - 1}) outside a launcher "
                              "(a Slurm job array or torchrun sets it)")
        shard_index = launched[0]
    return ShardSpec(int(shard_index), count)


def worker_resources(config: HiddenStatesConfig, gpus_available: bool = True) -> tuple[float, float]:
    """(CPUs, GPUs) one worker's engine needs: ``tp_size`` GPUs for an SGLang engine it starts (none
    to attach to a server), one for transformers on CUDA (its default when ``gpus_available``), else none."""
    opts = config.backend_options
    if config.backend == "sglang":
        return 1.0, 0.0 if opts.get("sglang_url") else float(int(opts.get("tp_size", 1)))
    device = str(opts.get("device") or ("cuda" if gpus_available else "cpu"))
    return 1.0, 1.0 if device.startswith("cuda") else 0.0


def pin_local_gpus(config: HiddenStatesConfig, env: dict[str, str] | None = None) -> str | None:
    """Under torchrun (``LOCAL_RANK``) with ``CUDA_VISIBLE_DEVICES`` unset, show this worker only its
    own GPUs (local rank ``r`` with ``g`` GPUs per engine: ``r*g .. r*g+g-1``). -> the GPUs set, or None."""
    env = os.environ if env is None else env
    _, gpus = worker_resources(config)
    if "LOCAL_RANK" not in env or "CUDA_VISIBLE_DEVICES" in env or not gpus:
        return None
    first = _env_int(env, "LOCAL_RANK") * int(gpus)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + k) for k in range(int(gpus)))
    return env["CUDA_VISIBLE_DEVICES"]


# -- the shard's own record (called by hs_dataset.shard_writer) ----------------------------------------
def read_shard(path: str | os.PathLike) -> dict[str, Any] | None:
    """A shard build's ``.hs_build/shard.json`` (None: ``path`` is not a shard, or it is unreadable)."""
    try:
        r = json.loads((Path(path) / STATE_DIR / SHARD_FILE).read_text(encoding="utf-8"))
        ok = isinstance(r, dict) and all(k in r for k in ("shard", "plan", "parts", "model", "layers", "config"))
        return r if ok and isinstance(r["shard"], dict) and isinstance(r["plan"], dict) else None
    except (OSError, ValueError):
        return None


def begin_shard(state: Path, spec: ShardSpec, parts: list[tuple[int, int, int]], rows: int,
                config: HiddenStatesConfig, info: Any, layers: tuple[int, ...],
                build_command: str | None) -> list[tuple[int, int, int]]:
    """Record the shard and the whole plan in ``state/shard.json`` (not done) -> this shard's parts.

    Raises:
        ConfigMismatchError: the folder holds another shard (another index or count).
    """
    mine = set(shard_parts(len(parts), spec.count)[spec.index])
    old = read_shard(state.parent)
    if old is not None and old["shard"] != {"index": spec.index, "count": spec.count}:
        raise ConfigMismatchError(f"{state.parent} holds shard {old['shard'].get('index')} of {old['shard'].get('count')}"
                                  f", not {spec.index} of {spec.count}: use the output of that split, or a new --output")
    record = {"shard": {"index": spec.index, "count": spec.count},
              "plan": {"parts": len(parts), "rows": rows, "part_size": config.part_size},
              "parts": sorted(mine), "done": False, "model": info.to_dict(), "layers": list(layers),
              "config": redact(config.to_dict())[0], "build_command": build_command}
    atomic_write(state / SHARD_FILE, json.dumps(record, indent=1))
    return [p for p in parts if p[0] in mine]


def finish_shard(state: Path, parts: list[tuple[int, int, int]]) -> Counts:
    """Sum the shard's part records and mark it done (``shard.json``) -> its counts."""
    from .records import Counts

    counts = Counts()
    for i, _, _ in parts:
        counts.add(Counts(**json.loads(part_record(state, i).read_text(encoding="utf-8"))["counts"]))
    counts.check()
    record = json.loads((state / SHARD_FILE).read_text(encoding="utf-8"))
    record.update(done=True, counts=dataclasses.asdict(counts))
    atomic_write(state / SHARD_FILE, json.dumps(record, indent=1))
    return counts


# -- one worker ---------------------------------------------------------------------------------------
def build_shard(config: HiddenStatesConfig, out: str | os.PathLike, spec: ShardSpec, *,
                backend: CaptureBackend | None = None, progress: bool = True, build_command: str | None = None,
                merge: bool = True) -> tuple[BuildSummary, MergeSummary | None]:
    """Build (or resume) shard ``spec`` of ``config`` under ``out``; with ``merge``, merge every shard
    when this one was the last to finish. -> (the shard's summary, the merge's or None).

    Raises:
        what :func:`hs_dataset.shard_writer.build` raises, and :class:`~hs_dataset.errors.ShardError`
        when the finished shards cannot be merged.
    """
    from .shard_writer import build

    pin_local_gpus(config)
    d = shard_dir(out, spec)
    d.mkdir(parents=True, exist_ok=True)
    summary = build(config, d, backend=backend, progress=progress, build_command=build_command, shard=spec)
    return summary, merge_if_complete(out, spec.count) if merge else None


def merge_if_complete(out: str | os.PathLike, count: int) -> MergeSummary | None:
    """Merge the ``count`` shards of ``out`` when every one is done (None: one is not, or another worker
    is merging them). The merged build records the shards' command (redacted) without the shard flags."""
    from .errors import BuildLockedError
    from .merge import merge_shards

    dirs = [shard_dir(out, ShardSpec(i, count)) for i in range(count)]
    if not all((read_shard(d) or {}).get("done") for d in dirs):
        return None
    try:
        return merge_shards(out, dirs)
    except BuildLockedError:
        return None  # another worker finished at the same time and merges


def single_worker_command(command: str | None) -> str | None:
    """``command`` without ``--num-shards``, ``--shard-index`` and ``--ray``: the command that
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
        if flag in ("--num-shards", "--shard-index", "--ray"):
            nxt = words[k + 1] if k + 1 < len(words) else "-"
            skip = "=" not in w and (flag != "--ray" or not nxt.startswith("-"))  # as argparse read it
            continue
        kept.append(w)
    return shlex.join(kept)
