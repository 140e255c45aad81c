"""Stage 4, write: the build directory, written part by part and resumable, that plain ``load_dataset`` reads.

* :mod:`.resolve`: the configuration resolved once (model, layers, tokenizer) and passed down;
* :mod:`.driver`: ``build()``, the part loop;
* :mod:`.builder`: the ``datasets`` builder of one part; :mod:`.capture_stream`: one capture across parts;
* :mod:`.parts`: one part generated into staging, then committed; :mod:`.resume`: part records and
  recovery; :mod:`.output`: whose output it is, its lock, write errors; :mod:`.shares`: a worker's share;
* :mod:`.finalize`: ``hs_dataset.json``, ``rejects.jsonl`` and the card (:mod:`.card`);
* :mod:`.plan`: what a build would cost, without the model; :mod:`.progress`: the progress display.
"""
