"""Trainers on other nodes: a Ray actor on the builder's node serves the rows through Ray's object store.

``hs-dataset build ... --stream ray:NAME`` (the builder connected to a Ray cluster) starts the relay,
a named actor (``hs_dataset-stream:NAME``, namespace ``hs_dataset``) placed on the builder's own node.
It is a reader of the build like a local trainer (:class:`~hs_dataset.stream.rows.LocalRows`, one
per remote rank, each attached to the spool with its deal, so backpressure works as for local ranks):
a trainer rank anywhere in the cluster, ``open_stream("ray:NAME")``, asks it for its next row, and the
row's Arrow buffers go into the object store on the builder's node (one copy) and from there to
the trainer's node (Ray's transfer); the trainer decodes them from its own object store. No socket
protocol of ours: Ray moves the bytes.

The relay outlives the build (a detached actor): it serves the rest of epoch 0 and the later
epochs from the finished version on the builder's node, and exits after ``idle_s`` seconds without
a call once the build has ended. Ray is optional (``pip install 'hs-dataset[ray]'``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from hs_dataset.errors import ConfigError, StreamError
from hs_dataset.stream.rows import LocalRows
from hs_dataset.stream.spool import announcement, builder_alive

__all__ = ["NAMESPACE", "RelayRows", "actor_name", "start_relay"]

NAMESPACE = "hs_dataset"
RELAY_IDLE_S = 600.0  # a finished build's relay goes away after this long without a call
_CALL_WAIT_S = 1.0  # one call waits this long for a row, then the trainer asks again (and checks its timeout)


def actor_name(name: str) -> str:
    return f"hs_dataset-stream:{name}"


def _ray() -> Any:
    try:
        import ray  # optional: pip install 'hs-dataset[ray]'
    except ImportError:
        raise ConfigError("a stream over Ray needs Ray: pip install 'hs-dataset[ray]' (on every node)") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE, log_to_driver=False)
    return ray


class Relay:
    """The relay actor's body: one :class:`LocalRows` per remote reader (see the module)."""

    def __init__(self, out: str, idle_s: float = RELAY_IDLE_S):
        self.out, self.idle_s = out, idle_s
        self._readers: dict[str, LocalRows] = {}
        self._last_call = time.monotonic()
        threading.Thread(target=self._watch, name="hs_dataset-relay-idle", daemon=True).start()

    def node_id(self) -> str:
        import ray  # optional: this runs in a Ray worker

        return ray.get_runtime_context().get_node_id()

    def open(self, seed: int, world: int, rank: int) -> str:
        self._last_call = time.monotonic()
        rows = LocalRows(self.out, seed=seed, world=world, rank=rank)
        self._readers[rows.id] = rows
        return rows.id

    def call(self, rid: str, method: str, *args: Any) -> Any:
        """``start_at``, ``wait_known``, ``total``, ``where``, ``unregister``, ``close`` of reader ``rid``."""
        self._last_call = time.monotonic()
        rows = self._readers[rid]
        if method == "where":
            return dict(rows.where)
        if method == "wait_known":
            try:
                return rows.wait_known(args[0], timeout=_CALL_WAIT_S)
            except StreamError:
                return None
        if method == "close":
            self._readers.pop(rid).close()
            return None
        return getattr(rows, method)(*args)

    def row(self, rid: str, g: int) -> tuple[str, pa.Table | None]:
        """``("row", table)``, ``("end", None)`` past the end of the build, or ``("wait", None)``: ask again."""
        self._last_call = time.monotonic()
        try:
            table = self._readers[rid].row(g, timeout=_CALL_WAIT_S)
        except StreamError:
            return "wait", None
        return ("row", table) if table is not None else ("end", None)

    def _watch(self) -> None:
        import ray  # optional: this runs in a Ray worker

        while True:
            time.sleep(min(self.idle_s, 30.0))
            a = announcement(Path(self.out))
            ended = a is None or not builder_alive(a)
            if ended and time.monotonic() - self._last_call > self.idle_s:
                ray.kill(ray.get_runtime_context().current_actor)


def start_relay(name: str, out: str | os.PathLike, *, idle_s: float = RELAY_IDLE_S) -> Any:
    """Start (or find) the relay ``name`` for the build at ``out`` on this process's Ray node.

    Raises:
        ConfigError: Ray is not installed, or no Ray cluster can be reached.
    """
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # optional: Ray

    here = ray.get_runtime_context().get_node_id()
    try:
        old = ray.get_actor(actor_name(name), namespace=NAMESPACE)
    except ValueError:
        old = None
    if old is not None:
        if ray.get(old.node_id.remote()) == here:
            return old
        ray.kill(old)  # a relay of an earlier run on another node: this run's spool is here
    actor = ray.remote(Relay).options(
        name=actor_name(name), namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=64,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote(os.path.abspath(out), idle_s)
    ray.get(actor.node_id.remote())
    return actor


class RelayRows:
    """A trainer's :class:`~hs_dataset.stream.dataset.RowSource` served by the relay ``name`` (see the module)."""

    def __init__(self, name: str, *, seed: int, world: int, rank: int):
        ray = _ray()
        try:
            self._actor = ray.get_actor(actor_name(name), namespace=NAMESPACE)
        except ValueError:
            raise StreamError(f"no stream {name!r} on this Ray cluster: start the build with `--stream ray:{name}` "
                              "on a node of it (or check RAY_ADDRESS)") from None
        self._ray = ray
        self._rid = ray.get(self._actor.open.remote(seed, world, rank))
        self.where: dict[str, float] = {}

    def _call(self, method: str, *args: Any) -> Any:
        return self._ray.get(self._actor.call.remote(self._rid, method, *args))

    def row(self, g: int, stop: threading.Event | None = None, timeout: float | None = None) -> pa.Table | None:
        t0 = time.monotonic()
        while True:
            kind, table = self._ray.get(self._actor.row.remote(self._rid, g))
            if kind == "row":
                return table
            if kind == "end":
                return None
            if stop is not None and stop.is_set():
                raise StreamError("the stream was closed while waiting for a row")
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise StreamError(f"the stream's relay has no row {g} after {timeout:g} s: is the build running?")

    def wait_known(self, n: int, stop: threading.Event | None = None, timeout: float | None = None) -> int:
        t0 = time.monotonic()
        while True:
            known = self._call("wait_known", n)
            if known is not None:
                return known
            if stop is not None and stop.is_set():
                raise StreamError("the stream was closed while waiting for rows")
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise StreamError(f"the stream's relay has not {n} rows after {timeout:g} s: is the build running?")

    def total(self) -> int | None:
        return self._call("total")

    def start_at(self, g: int) -> None:
        self._call("start_at", g)

    def unregister(self) -> None:
        self._call("unregister")
        self.where = self._call("where")

    def close(self) -> None:
        self._call("close")
