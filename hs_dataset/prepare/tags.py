"""Per-sample tags: plain columns that say where a row came from and what it is, for filters and mixes.

With ``tags=true`` every row carries (``datasets`` filters, the Hub viewer, ``plan``/``inspect`` counts and
``hs-dataset derive`` read them as they are):

* ``tag_source``: the source's name (file or dataset), ``tag_row``: the row's index in it;
* ``tag_mode``: the thinking mode a regenerate build wrote it in (``on``/``off``; ``template`` without a
  switch; ``source`` for replies from the source);
* ``tag_turns``: the conversation's assistant turns (0 for rows of raw tokens), ``tag_tokens``: its tokens;
* ``tag_language``: the source row's ``language`` (or ``lang``) field when it has one, else null;
* ``tag_<name>`` for each source column named in ``tag_columns`` (its text; JSON for other values; null when
  absent).

A regenerate build with a thinking switch records ``tag_mode`` even without ``tags``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from hs_dataset.records import Conversation, SourceRow, TokenizedSample

__all__ = ["COUNTED_TAGS_SKIP", "DEFAULT_TAGS", "MODE_TAG", "TAG_PREFIX", "count_tags", "set_tags", "source_tags",
           "tag_dtypes", "user_columns"]

TAG_PREFIX = "tag_"
MODE_TAG = "tag_mode"
DEFAULT_TAGS: dict[str, str] = {"tag_source": "string", "tag_row": "int64", MODE_TAG: "string", "tag_turns": "int32",
                                "tag_tokens": "int32", "tag_language": "string"}
_LANGUAGE_KEYS = ("language", "lang")
COUNTED_TAGS_SKIP = ("tag_row", "tag_tokens")  # a value per row: not counted by value


def user_columns(tag_columns: str | None) -> list[str]:
    """The source columns named in ``tag_columns`` (comma-separated), in order, without repeats."""
    return list(dict.fromkeys(c.strip() for c in str(tag_columns or "").split(",") if c.strip()))


def tag_dtypes(config: Mapping[str, Any]) -> dict[str, str]:
    """The tag columns of a build with this configuration (``HiddenStatesConfig.to_dict()``, or the ``config`` a
    build recorded) and their ``datasets`` dtypes; empty for a build without tags."""
    generation = config.get("generation") or {}
    thinking = config.get("responses") == "regenerate" and generation.get("thinking", "template") != "template"
    if not config.get("tags"):
        return {MODE_TAG: "string"} if thinking else {}
    out = dict(DEFAULT_TAGS)
    out.update({TAG_PREFIX + c: "string" for c in user_columns(str(config.get("tag_columns") or ""))})
    return out


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def source_tags(row: SourceRow, source: str, parsed: Conversation | TokenizedSample | None,
                columns: list[str]) -> dict[str, Any]:
    """The tags a source row gives (all but ``tag_tokens`` and ``tag_mode``, set with the sample)."""
    data = row.data if isinstance(row.data, Mapping) else {}
    turns = sum(m.role == "assistant" for m in parsed.messages) if isinstance(parsed, Conversation) else 0
    language = next((data[k] for k in _LANGUAGE_KEYS if isinstance(data.get(k), str)), None)
    tags: dict[str, Any] = {"tag_source": source, "tag_row": int(row.index), "tag_turns": turns,
                            "tag_language": language}
    tags.update({TAG_PREFIX + c: _text(data.get(c)) for c in columns})
    return tags


def set_tags(sample: TokenizedSample, tags: dict[str, Any], mode: str) -> TokenizedSample:
    """``sample`` with its tags (``tags`` from :func:`source_tags`, its mode and token count) attached."""
    sample.tags = {**tags, MODE_TAG: mode, "tag_tokens": sample.num_tokens}
    return sample


def count_tags(counts: dict[str, dict[Any, int]], tags: Mapping[str, Any]) -> None:
    """Add one row's ``tags`` to ``counts`` (``{column: {value: rows}}``; row indices and token counts left out)."""
    for name, value in tags.items():
        if name not in COUNTED_TAGS_SKIP:
            by_value = counts.setdefault(name, {})
            by_value[value] = by_value.get(value, 0) + 1
