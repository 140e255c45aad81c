"""What a build looks like on disk, and the choices a build offers: one home for every such name.

A finished build directory::

    OUT/README.md               YAML `configs:` + `dataset_info:` (plain load_dataset(OUT) works), the card
    OUT/hs_dataset.json         model, layers + convention, storage dtype, counts, versions, command
    OUT/rejects.jsonl           one line per rejected sample: id, field, reason, stage
    OUT/data/train-PPPPP-SSS.arrow   whole shards only (P = part, S = shard within the part)
    OUT/.hs_build/              resume state (never published)

Columns: ``id``, ``input_ids``, ``loss_mask``, ``num_tokens``, one ``hidden_layer_<k>`` per captured
layer, ``hidden_final``; with fp8 storage each state column has a ``<column>_scale`` companion.

Imports nothing heavy: the SGLang plugin's modules may use it.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

__all__ = [
    "BACKENDS", "DAMAGED_FILE", "DATA_DIR", "DUPLICATES_FILE", "DUPLICATES_POLICIES", "DUPLICATE_STAGE",
    "COMPRESSIONS", "Compression", "DuplicatesPolicy", "FILE_FORMATS", "FINAL_COLUMN", "LAYER_PREFIX", "MASK_MODES",
    "META_FILE",
    "MESSAGES_COLUMN", "NONFINITE_POLICIES", "README_FILE", "REDACTED_FILE", "REJECTS_FILE", "RESPONSES_MODES",
    "SAMPLE_STATS_FILE", "SAMPLE_TOKENS_COLUMN", "TEACHER_IDS_COLUMN", "TEACHER_LOGPROBS_COLUMN", "TEACHER_LSE_COLUMN",
    "TOKEN_START_COLUMN", "parse_teacher", "part_ranges",
    "ResponsesMode", "SAMPLE_ID_MODES", "SHARD_RE", "STATE_DIR", "STORAGE_DTYPES", "TRUNCATION_MODES", "BackendName",
    "FileFormat", "MaskMode", "NonfinitePolicy",
    "SampleIdMode", "StorageDtype", "TruncationMode", "layer_column", "layer_of", "scale_column", "shard_name",
    "escape_controls", "state_columns", "utf8_safe",
    "SHARES_DIR", "SHARE_FILE", "share_dir_name",
]

# -- choices (typed on HiddenStatesConfig; the CLI derives its choices from these) --------------------
MaskMode = Literal["all", "last"]  # every assistant turn, or only the last one
TruncationMode = Literal["truncate", "reject"]  # longer than max_length: keep the first max_length tokens, or reject
NonfinitePolicy = Literal["fail", "reject"]  # NaN/Inf in a state: stop the build, or reject the sample
SampleIdMode = Literal["row", "hash"]  # sample ids: <source>:<row>, or a content hash
FileFormat = Literal["arrow", "parquet"]
Compression = Literal["none", "zstd"]  # Arrow shards as written, or their buffers zstd-compressed
StorageDtype = Literal["bfloat16", "fp8_e4m3"]  # exact bf16 bits, or fp8 e4m3 + a per-token scale
BackendName = Literal["transformers", "sglang"]
ResponsesMode = Literal["source", "regenerate"]  # assistant replies as in the source, or written by the target
DuplicatesPolicy = Literal["keep", "skip"]  # a sample repeating an earlier one's ids and mask: capture it again, or not

MASK_MODES: tuple[str, ...] = get_args(MaskMode)
TRUNCATION_MODES: tuple[str, ...] = get_args(TruncationMode)
NONFINITE_POLICIES: tuple[str, ...] = get_args(NonfinitePolicy)
SAMPLE_ID_MODES: tuple[str, ...] = get_args(SampleIdMode)
FILE_FORMATS: tuple[str, ...] = get_args(FileFormat)
COMPRESSIONS: tuple[str, ...] = get_args(Compression)
STORAGE_DTYPES: tuple[str, ...] = get_args(StorageDtype)
BACKENDS: tuple[str, ...] = get_args(BackendName)
RESPONSES_MODES: tuple[str, ...] = get_args(ResponsesMode)
DUPLICATES_POLICIES: tuple[str, ...] = get_args(DuplicatesPolicy)

# -- files ---------------------------------------------------------------------------------------------
META_FILE = "hs_dataset.json"  # exists only in a finished build (written last)
README_FILE = "README.md"
REJECTS_FILE = "rejects.jsonl"
SAMPLE_STATS_FILE = "sample_stats.parquet"  # the teacher's statistics per row (hs_dataset.integrity.teacher_stats)
DATA_DIR = "data"
STATE_DIR = ".hs_build"  # resume state: part records, staging, lock; never published
DAMAGED_FILE = "damaged.json"  # in STATE_DIR: parts a full verify found damaged; the next build redoes them
REDACTED_FILE = "redacted.json"  # in STATE_DIR: salted hashes of the credentials the build redacted
DUPLICATES_FILE = "duplicates.json"  # in STATE_DIR: the rows duplicates=skip leaves out, with their originals
DUPLICATE_STAGE = "duplicate"  # the reject stage of a sample duplicates=skip leaves out
SHARD_RE = re.compile(r"^train-(\d{5,})-(\d{3,})\.(arrow|parquet)$")
# A build made by many workers (hs_dataset.scale): OUT/.hs_build/shares/share-IIIII-of-NNNNN/ is the
# resumable build of one worker's share of the parts; its own .hs_build/share.json says which share.
SHARES_DIR = "shares"  # in STATE_DIR (never published)
SHARE_FILE = "share.json"  # in a share build's STATE_DIR: its index and count, the whole plan, done


def share_dir_name(index: int, count: int) -> str:
    """``share-IIIII-of-NNNNN``: the folder of worker share ``index`` (0-based) of ``count``."""
    return f"share-{index:05d}-of-{count:05d}"


def shard_name(part: int, shard: int, file_format: str) -> str:
    """``train-PPPPP-SSS.<format>``: shard ``shard`` of part ``part``."""
    return f"train-{part:05d}-{shard:03d}.{file_format}"


# -- columns -------------------------------------------------------------------------------------------
MESSAGES_COLUMN = "messages"  # regenerate builds: the conversation as trained on (JSON text)
# Builds whose max_length exceeds row_tokens: a sample is one or more rows, in order, each covering positions
# [token_start, token_start + num_tokens) of a sample of sample_tokens tokens (input_ids, loss_mask and the states
# of that range). Rows of one sample share its id and are adjacent, in token order.
TOKEN_START_COLUMN = "token_start"
SAMPLE_TOKENS_COLUMN = "sample_tokens"
# Builds with teacher="topk:K" (hs_dataset.codec.teacher): at each loss-masked position of the row, in order, the
# target's top-K token ids (highest first: the first is the argmax), their log-probabilities, and the logsumexp.
TEACHER_IDS_COLUMN = "teacher_ids"
TEACHER_LOGPROBS_COLUMN = "teacher_logprobs"
TEACHER_LSE_COLUMN = "teacher_lse"


def parse_teacher(spec: str | None) -> int:
    """``"topk:64"`` -> 64; None or ``""`` -> 0. Raises ValueError naming the accepted form."""
    if not spec:
        return 0
    kind, _, k = str(spec).partition(":")
    if kind != "topk" or not k.isdigit() or not 1 <= int(k) <= 1024:
        raise ValueError(f"teacher={spec!r}: use topk:K with 1 <= K <= 1024 (e.g. topk:64), or leave it unset")
    return int(k)


LAYER_PREFIX = "hidden_layer_"
FINAL_COLUMN = "hidden_final"
SCALE_SUFFIX = "_scale"


def layer_column(k: int) -> str:
    """Column name of captured layer ``k``."""
    return f"{LAYER_PREFIX}{k}"


def layer_of(column: str) -> int | None:
    """The layer id of a ``hidden_layer_<k>`` column (None for any other column)."""
    if column.startswith(LAYER_PREFIX) and column[len(LAYER_PREFIX):].isdigit():
        return int(column[len(LAYER_PREFIX):])
    return None


def state_columns(layers: tuple[int, ...] | list[int]) -> list[str]:
    """Hidden-state column names in storage order: the layers, then the final state."""
    return [layer_column(k) for k in layers] + [FINAL_COLUMN]


def scale_column(column: str) -> str:
    """The per-token fp8 scale column of a state column."""
    return f"{column}{SCALE_SUFFIX}"


# -- text ----------------------------------------------------------------------------------------------
_SURROGATE = re.compile("[\ud800-\udfff]")
# Control characters (ESC, BEL, ...) and the bidirectional overrides (U+202E) of a file name would act on a terminal
# or reorder the text of a card: escaped where a name is shown or becomes a sample id.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """``text`` with control characters and bidirectional overrides escaped (``\\x1b``, ``\\u202e``)."""
    def escape(m: re.Match) -> str:
        o = ord(m.group(0))
        return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"

    return _CONTROL.sub(escape, text)


def utf8_safe(text: str) -> str:
    """``text`` as valid UTF-8 (for sample ids, the card): the bytes of a file name that is not UTF-8
    (Python's surrogate escapes, ``\\udcff``) become ``\\xff``, other lone surrogates ``\\ud800``."""
    def escape(m: re.Match) -> str:
        o = ord(m.group(0))
        return f"\\x{o - 0xDC00:02x}" if 0xDC80 <= o <= 0xDCFF else f"\\u{o:04x}"

    return _SURROGATE.sub(escape, text)


def part_ranges(rows: int, part_size: int) -> list[tuple[int, int, int]]:
    """The parts of a build of ``rows`` source rows: ``(index, first row, end row)``, ``part_size`` rows each
    (the last one shorter): the unit of resume, of a shard's share and of the plan."""
    return [(i, s, min(s + part_size, rows)) for i, s in enumerate(range(0, rows, part_size))]
