"""Stage 8, stream: train while it builds. A trainer reads the rows of a running build as they are
captured, and the same rows are the committed version that later epochs read.

* :mod:`.spool`: the rows of a running build in shared memory, and its small event log;
* :mod:`.publish`: :class:`StreamPublisher`, the build's side (``hs-dataset build --stream``), with backpressure;
* :mod:`.deal`: which rows each trainer rank gets in an epoch, in what order (seeded, deterministic);
* :mod:`.rows`: a reader's view of a build on its node: the spool, the committed shards, the version;
* :mod:`.dataset`: :func:`open_stream`, the trainer's ``IterableDataset``, resumable;
* :mod:`.relay`: trainers on other nodes, through Ray's object store.
"""

from hs_dataset.stream.dataset import StreamDataset, open_stream
from hs_dataset.stream.publish import StreamPublisher, StreamStats

__all__ = ["StreamDataset", "StreamPublisher", "StreamStats", "open_stream"]
