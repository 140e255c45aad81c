"""Stage 5, integrity: what is read or pushed is what was written, and the right states for the right sample.

* :mod:`.checksums`: each shard's size, rows and xxh3-128, and the checks against them;
* :mod:`.verify`: a build (or a published version) against its ``hs_dataset.json``;
* statistics counted while a build writes, and the probe against the reference backend.

Credentials are kept out of everything written by :mod:`hs_dataset.redact` (a root module: every stage
from the source on redacts).
"""
