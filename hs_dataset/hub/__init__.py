"""Stage 6, hub: versions on the Hugging Face Hub, pushed as tags and loaded with plain ``load_dataset``.

* :mod:`.publish`: :func:`~hs_dataset.hub.publish.push_dataset`, resumable, no tag on partial data;
* :mod:`.uploads`: what a push uploads, verified and hashed first;
* :mod:`.versions`: the versions on the Hub (order, listing, the history their cards carry);
* :mod:`.names`: which names a version may have; :mod:`.access`: can the Hub be used, and its errors.
"""
