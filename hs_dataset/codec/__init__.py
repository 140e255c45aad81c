"""Stage 3, codec: captured states -> the exact bits stored (bf16 as uint16, or fp8 e4m3 + per-token
scales, :mod:`.fp8`) -> one-row Arrow tables, and the dataset's schema (:mod:`.encode`)."""
