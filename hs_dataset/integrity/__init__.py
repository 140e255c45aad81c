"""Stage 5, integrity: what is read or pushed is what was written, and holds no credential.

* :mod:`.checksums`: each shard's size, rows and xxh3-128, and the checks against them;
* :mod:`.verify`: a build (or a published version) against its ``hs_dataset.json``;
* :mod:`.redact`: credentials out of everything written, and the scan before a push.
"""
