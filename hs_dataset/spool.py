"""Binary transport of captured states from the SGLang scheduler to the builder (no JSON).

The plugin (TP rank 0) writes one file per request *chunk* into a spool directory (``/dev/shm``
by default, so the bytes never touch the disk before the shard writer):

    <rid>.<start:08d>.st     safetensors: "states" bf16 [n_states, length, H]; metadata start/length

written to a temporary name and renamed, so a visible file is always whole. A request prefilled
in one pass has one file starting at 0; a chunked prefill has one file per chunk, each naming
its start, so the reader follows ``start -> start + length`` without listing the directory.
``<rid>.error`` tells the reader why a request cannot be captured (e.g. a radix-cache hit).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

MANIFEST = "plugin-manifest.json"
PLUGIN_ERROR = "plugin-error.txt"
PLUGIN_STATS = "plugin-stats.json"  # the plugin's running totals (TP rank 0), rewritten at most twice a second
ENV = "HS_DATASET_CAPTURE"  # JSON {"layers": [...], "spool": "...", "rid_prefix": "..."} for the plugin
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in on first touch
POLL_MAX_S = 0.002  # longest sleep between looks for the next chunk file (a stat() each)
ALIVE_EVERY_S = 0.1


def chunk_path(spool: str | os.PathLike, rid: str, start: int) -> Path:
    return Path(spool) / f"{rid}.{start:08d}.st"


def error_path(spool: str | os.PathLike, rid: str) -> Path:
    return Path(spool) / f"{rid}.error"


def write_chunk(spool: str | os.PathLike, rid: str, start: int, parts: list[torch.Tensor], meta: dict[str, str]) -> int:
    """Write ``parts`` (each a contiguous bf16 ``[length, H]`` CPU tensor, one per state) as one
    safetensors tensor ``states [len(parts), length, H]`` without concatenating them first."""
    length, hidden = parts[0].shape
    nbytes = sum(p.numel() * 2 for p in parts)
    header = {"states": {"dtype": "BF16", "shape": [len(parts), length, hidden], "data_offsets": [0, nbytes]},
              "__metadata__": {**meta, "start": str(start), "length": str(length)}}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    final = chunk_path(spool, rid, start)
    tmp = final.with_name("." + final.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for p in parts:
            f.write(memoryview(p.contiguous().view(torch.int16).numpy()).cast("B"))
    os.replace(tmp, final)
    return nbytes


@dataclass
class Chunk:
    start: int
    states: torch.Tensor  # bf16 [n_states, length, H]
    nonfinite: tuple[int, ...] | None  # per state: positions with NaN/Inf, counted by the writer


def read_chunk(path: Path) -> Chunk:
    """Map a chunk file (safetensors layout) without copying it: the tensor views the file's pages,
    which stay valid after the file is unlinked, until the tensor is freed."""
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        size = os.fstat(f.fileno()).st_size
        # MAP_POPULATE: the page-table work happens here, on the reader thread, not later inside the
        # shard writer's copy of these bytes (16k page faults per 64 MB sample).
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ) \
            if size > 8 + hlen else None
    meta, info = header.get("__metadata__", {}), header["states"]
    if info["dtype"] != "BF16":
        raise RuntimeError(f"{path}: states are {info['dtype']}, expected BF16")
    begin, end = info["data_offsets"]
    shape = info["shape"]
    if mm is None:
        states = torch.empty(shape, dtype=torch.bfloat16)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mapping
            states = torch.frombuffer(mm, dtype=torch.bfloat16, offset=8 + hlen + begin,
                                      count=(end - begin) // 2).view(shape)
    nf = meta.get("nonfinite")
    return Chunk(int(meta["start"]), states, tuple(int(x) for x in nf.split(",")) if nf else None)


class SpoolTimeout(RuntimeError):
    pass


def collect(spool: str | os.PathLike, rid: str, num_tokens: int, *, timeout: float,
            alive: Callable[[], None] | None = None) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """Wait for and read every chunk of ``rid`` covering positions ``[0, num_tokens)``; delete them.

    Returns bf16 ``[n_states, num_tokens, H]`` and, when the writer counted them, the number of
    positions holding NaN/Inf per state. ``alive()`` is called while waiting and should
    raise if the engine died. Raises :class:`SpoolTimeout` after ``timeout`` seconds without
    progress, and ``RuntimeError`` with the plugin's reason if it wrote ``<rid>.error``.
    """
    chunks: list[torch.Tensor] = []
    nonfinite: list[int] | None = []
    pos = 0
    deadline = time.monotonic() + timeout
    next_alive = time.monotonic() + ALIVE_EVERY_S
    sleep = 0.0002
    while pos < num_tokens:
        path = chunk_path(spool, rid, pos)
        if path.exists():
            c = read_chunk(path)
            path.unlink()
            chunks.append(c.states)
            if c.nonfinite is None or nonfinite is None:
                nonfinite = None
            else:
                nonfinite = [a + b for a, b in zip(c.nonfinite, nonfinite)] if nonfinite else list(c.nonfinite)
            pos += c.states.shape[1]
            deadline = time.monotonic() + timeout
            sleep = 0.0002
            continue
        err = error_path(spool, rid)
        if err.exists():
            reason = err.read_text()
            err.unlink()
            raise RuntimeError(reason)
        now = time.monotonic()
        if now > deadline:
            raise SpoolTimeout(f"no hidden states for request {rid} at position {pos} of {num_tokens} "
                               f"after {timeout:.0f}s in {spool}")
        if alive is not None and now > next_alive:
            alive()
            next_alive = now + ALIVE_EVERY_S
        time.sleep(sleep)
        sleep = min(sleep * 2, POLL_MAX_S)
    if pos != num_tokens:
        raise RuntimeError(f"request {rid}: captured {pos} positions for {num_tokens} tokens")
    states = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
    return states, tuple(nonfinite) if nonfinite is not None else None


def request_spans(rids: list[str], extend_lens: list[int], prefix_lens: list[int],
                  rid_prefix: str) -> list[tuple[str, int, int, int]]:
    """Split a batched prefill into our requests: ``(rid, row_offset, start_position, length)``.

    Rows of a batched EXTEND pass are the requests' new tokens back to back, in batch order;
    ``start_position`` is the request's prefix length (tokens computed in earlier passes).
    Requests whose id does not start with ``rid_prefix`` are not ours and are skipped.
    """
    out = []
    off = 0
    for rid, n, p in zip(rids, extend_lens, prefix_lens):
        if rid.startswith(rid_prefix) and n > 0:
            out.append((rid, off, int(p), int(n)))
        off += int(n)
    return out
