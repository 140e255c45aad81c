"""The transport stage: captured states from the SGLang plugin (TP rank 0) to the builder through
one shared-memory ring per build, written by the GPU and read in place.

The builder (the *consumer*) creates the ring: one file ``<dir>/ring-<token>`` (``/dev/shm`` by
default), all of its pages allocated up front (``posix_fallocate``: a ``/dev/shm`` too small is
refused here, naming the size and the option), mapped once. The SGLang plugin (the *producer*)
maps the same file and registers it as pinned host memory (``cudaHostRegister``), so its
device-to-host copies land in it directly at PCIe speed; the builder wraps the bytes as tensors
and Arrow buffers without a copy. No file is created per chunk and no page is allocated on the
hot path.

File layout: a header page, a slot table, the data area. The consumer does all allocation:

1. before submitting a request it *reserves* a region of the data area big enough for the whole
   request (``[n_states, T, H]`` bf16, or fp8 bits ``[n_states, T, H]`` + float32 scales
   ``[n_states, T]``) and fills the request's slot (seq, offset, T, states, encoding); the request
   id names the ring and the seq (``<prefix><token>-<seq>``, and ``-k<k>`` when it asks for the teacher's
   top-k: :func:`make_rid`, :func:`parse_rid`);
2. the producer copies every prefill chunk of the request to its rows ``[start, start + n)`` of
   each state, and once the copy has completed on the GPU adds the chunk's NaN/Inf counts and, last,
   its rows to the slot (or marks the slot failed, with a message);
3. the consumer waits for ``rows == T``, hands out views of the region, and reuses the region once
   nothing references those views any more (the tensor storage's use count; nothing is freed
   early, nothing copied out). A request that ended without its states (aborted, timed out) keeps
   its region until the ring is closed, since its chunks might still arrive.

Backpressure is the ring's capacity: a request is submitted only when its region is reserved.

Faults: the producer beats a counter in the header twice a second; a consumer waiting on a ring
whose producer stopped beating raises :class:`TransportError`. The consumer holds an exclusive
``flock`` on the ring file for its whole life; the producer tests that lock and drops the rings
of dead consumers, and :func:`remove_stale` (run when a backend starts) deletes ring files and
private ring folders whose owner is gone. The consumer deletes the ring file as soon as the
producer has mapped it, so a crash leaves nothing in ``/dev/shm``.

Memory order: slot fields are plain aligned stores into shared memory, the rows count last; this
relies on a TSO machine (x86-64), where stores become visible in program order.

Only numpy-free, torch-only code: the plugin imports this module in SGLang's scheduler process.
"""

from hs_dataset.capture.transport.files import MEMORY_FS, file_system_type, private_dir, remove_stale
from hs_dataset.capture.transport.format import (DEFAULT_RING_BYTES, ENCODINGS, ENV, MANIFEST, PLUGIN_ERROR, PLUGIN_STATS,
                                                 SCHEDULER_ERROR, SlotInfo, make_rid,
                                                 parse_rid, region_bytes, request_spans, rid_teacher_k)
from hs_dataset.capture.transport.ring import Lease, Ring
from hs_dataset.capture.transport.writer import RingWriter
from hs_dataset.errors import RequestError, TransportError

__all__ = [
    "DEFAULT_RING_BYTES", "ENCODINGS", "ENV", "MANIFEST", "MEMORY_FS", "PLUGIN_ERROR", "PLUGIN_STATS", "SCHEDULER_ERROR", "Lease",
    "RequestError", "Ring", "RingWriter", "SlotInfo", "TransportError", "file_system_type", "make_rid", "parse_rid",
    "private_dir", "region_bytes", "remove_stale", "request_spans", "rid_teacher_k",
]
