"""Stage 1, prepare: source rows -> conversations -> token ids and a loss mask, before any model runs.

* :mod:`.sources` reads rows (JSONL, JSON, Parquet, a saved dataset, ``hf:``), never failing on one bad row;
* :mod:`.conversations` validates a row into a conversation (ShareGPT, OpenAI) or raw tokens;
* :mod:`.regenerate` has the target write the assistant replies (``responses="regenerate"``), :mod:`.thinking`
  in the template's thinking modes;
* :mod:`.tags` gives each sample its tag columns (source, row, mode, turns, tokens, language, the user's);
* :mod:`.tokenizer` loads the target's tokenizer once; :mod:`.token_offsets` gives each token's characters;
* :mod:`.loss_mask` renders the chat template and masks the assistant spans;
* :mod:`.samples` is the stage as one generator, for the builder, the capture stream and ``plan``.

Rows that cannot be used are rejects (:class:`~hs_dataset.errors.SampleError`), never errors.
"""
