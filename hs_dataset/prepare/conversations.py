"""Source stage, validating: one raw row -> a conversation or an already tokenized sample.

:func:`parse_row` returns a :class:`~hs_dataset.records.Conversation` (ShareGPT or OpenAI chat
shape) or a :class:`~hs_dataset.records.TokenizedSample` (raw token ids), or raises
:class:`~hs_dataset.errors.SampleError` naming the offending field.

Row rules: an optional system prompt first, then strictly alternating user/assistant turns
starting with a user turn, at least one assistant turn. A trailing user turn after the last
assistant reply is dropped (it would never be trained on).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hs_dataset.errors import SampleError
from hs_dataset.prepare.sources import BadRow
from hs_dataset.records import Conversation, Message, SourceRow, TokenizedSample

__all__ = ["ROLE_ALIASES", "parse_row"]

# Role names accepted in either shape (compared case-insensitively), mapped to Message roles.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "model": "assistant",
}

_INT32_MAX = 2**31 - 1


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return type(value).__name__


def _check_text(value: Any, field: str) -> str:
    """Return ``value`` if it is a string that is valid Unicode (encodable as UTF-8)."""
    if isinstance(value, (bytes, bytearray)):
        raise SampleError(field, f"expected a string, got {len(value)} raw bytes; decode them to text first")
    if not isinstance(value, str):
        raise SampleError(field, f"expected a string, got {_type_name(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SampleError(
            field,
            f"text is not valid UTF-8 (lone surrogate {value[e.start]!r} at character {e.start}); "
            "fix the text encoding of the source",
        ) from None
    return value


def _get(obj: Mapping[str, Any], key: str, field: str, what: str) -> Any:
    """``obj[key]``; absent: "missing field", null: "is null; give ``what``" (a SampleError naming it)."""
    name = f"{field}.{key}" if field else key
    if key not in obj:
        keys = sorted(str(k) for k in obj.keys())
        raise SampleError(name, f"missing field {key!r} (found keys {keys})")
    if obj[key] is None:
        raise SampleError(name, f"field {key!r} is null; give {what}")
    return obj[key]


def _as_list(value: Any, field: str) -> Sequence[Any]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise SampleError(field, f"expected a list, got {_type_name(value)}")
    return value


def _role(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise SampleError(field, f"expected a role string, got {_type_name(value)}")
    role = ROLE_ALIASES.get(value.strip().lower())
    if role is None:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise SampleError(
            field, f"unknown role {shown!r}; expected one of {sorted(ROLE_ALIASES)} (any case)"
        )
    return role


# Content parts that carry media (OpenAI's image_url / input_audio, and the image / video parts of
# multimodal chat templates such as Kimi-K2.5's): rejected, never dropped.
_MEDIA_PARTS = {"image": "image", "image_url": "image", "input_image": "image", "video": "video",
                "video_url": "video", "input_audio": "audio", "audio": "audio", "audio_url": "audio"}
# Row-level media fields of LLaVA-style ShareGPT rows.
_MEDIA_FIELDS = ("image", "images", "video", "videos", "audio", "audios")


def _media_kind(part: Mapping[str, Any]) -> str | None:
    """``"image"``/``"video"``/``"audio"`` for a media content part (by its type, or a media key), else None."""
    ptype = part.get("type")
    if isinstance(ptype, str) and ptype in _MEDIA_PARTS:
        return _MEDIA_PARTS[ptype]
    if ptype in (None, ""):
        return next((_MEDIA_PARTS[k] for k in _MEDIA_PARTS if part.get(k) is not None), None)
    return None


def _openai_content(value: Any, field: str) -> str:
    """OpenAI ``content``: a string, or a list of ``{"type": "text", "text": ...}`` parts joined by newlines.

    Image (and other media) parts are rejected: image inputs are not supported yet.
    """
    if isinstance(value, (list, tuple)):
        if not value:
            raise SampleError(field, "content is an empty list of parts")
        texts = []
        for k, part in enumerate(value):
            pfield = f"{field}[{k}]"
            if not isinstance(part, Mapping):
                raise SampleError(pfield, f"expected a content part object, got {_type_name(part)}")
            media = _media_kind(part)
            if media is not None:
                raise SampleError(pfield, f"{media} inputs are not supported yet (text-only capture); drop this "
                                          "sample or its media parts")
            ptype = part.get("type") or "text"
            if ptype != "text":
                raise SampleError(
                    f"{pfield}.type", f"only text content parts are supported, got {str(ptype)[:40]!r}"
                )
            texts.append(_check_text(_get(part, "text", pfield, "the part's text as a string"), f"{pfield}.text"))
        return "\n".join(texts)
    return _check_text(value, field)


def _parse_messages(items: Sequence[Any], key: str, role_key: str, content_key: str) -> list[Message]:
    if len(items) == 0:
        raise SampleError(key, "conversation is empty")
    messages: list[Message] = []
    for i, item in enumerate(items):
        field = f"{key}[{i}]"
        if not isinstance(item, Mapping):
            raise SampleError(field, f"expected an object with {role_key!r} and {content_key!r}, got {_type_name(item)}")
        role = _role(_get(item, role_key, field, "the role as a string (user, assistant or system)"),
                     f"{field}.{role_key}")
        text = "the turn's text as a string"
        if item.get("tool_calls") is not None:
            text += " (a turn of tool calls only is not supported: drop this sample)"
        raw_content = _get(item, content_key, field, text)
        if key == "messages":
            content = _openai_content(raw_content, f"{field}.{content_key}")
        else:
            content = _check_text(raw_content, f"{field}.{content_key}")
        messages.append(Message(role, content, _reasoning(item, role, field)))
    _check_order(messages, key, role_key, content_key)
    # A trailing user turn is never trained on: drop it.
    if messages[-1].role == "user":
        messages = messages[:-1]
    return messages


def _reasoning(item: Mapping[str, Any], role: str, field: str) -> str | None:
    """An assistant turn's ``reasoning_content`` (thinking), checked; None when absent."""
    value = item.get("reasoning_content")
    if value is None:
        return None
    if role != "assistant":
        raise SampleError(f"{field}.reasoning_content", f"only assistant turns carry reasoning, not a {role} turn")
    return _check_text(value, f"{field}.reasoning_content")


def _check_order(messages: list[Message], key: str, role_key: str, content_key: str) -> None:
    """Optional system first, then user, assistant, user, ... with at least one assistant turn."""
    expected = "user"
    for i, m in enumerate(messages):
        field = f"{key}[{i}].{role_key}"
        if m.role == "system":
            if i != 0:
                raise SampleError(field, f"a system message is only allowed as the first turn, found at turn {i}")
            continue
        if m.role != expected:
            if i == 0 or (i == 1 and messages[0].role == "system"):
                reason = f"the first turn after the optional system prompt must be a user turn, got {m.role}"
            else:
                reason = f"two consecutive {m.role} turns (turns {i - 1} and {i}); user and assistant turns must alternate"
            raise SampleError(field, reason)
        if m.role == "assistant" and not m.content.strip():
            raise SampleError(f"{key}[{i}].{content_key}", "assistant reply is empty; there is nothing to train on")
        expected = "assistant" if expected == "user" else "user"
    if not any(m.role == "assistant" for m in messages):
        raise SampleError(key, "conversation has no assistant turn; there is nothing to train on")


def _int_array(value: Any, field: str, *, allow_bool: bool = False) -> np.ndarray:
    """A list of integers as an array (int64; object for integers beyond it), or a :class:`SampleError` naming
    the first element that is not an integer (a bool counts as one only with ``allow_bool``). A list of plain
    ints, what JSON gives, is converted at once: element by element a 2,048-token row took ~1 ms, a tenth of a
    build's thread at Kimi width where rows are read on it."""
    items = _as_list(value, field)
    if not set(map(type, items)) <= ({int, bool} if allow_bool else {int}):
        for j, v in enumerate(items):
            if isinstance(v, (np.integer, np.bool_)):
                v = v.item()
            if isinstance(v, bool) and not allow_bool or not isinstance(v, int):
                raise SampleError(f"{field}[{j}]", f"expected an integer, got {_type_name(v)}")
        items = [int(v) for v in items]  # numpy integers and bools as plain ints
    try:
        return np.asarray(items, dtype=np.int64)
    except OverflowError:
        return np.asarray(items, dtype=object)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _parse_tokens(row: SourceRow, data: Mapping[str, Any]) -> TokenizedSample:
    ids = _int_array(data["input_ids"], "input_ids")
    if not ids.size:
        raise SampleError("input_ids", "input_ids is empty")
    if (ids < 0).any():
        j = _first(ids < 0)
        raise SampleError(f"input_ids[{j}]", f"negative token id {ids[j]}")
    if (ids > _INT32_MAX).any():
        j = _first(ids > _INT32_MAX)
        raise SampleError(f"input_ids[{j}]", f"token id {ids[j]} does not fit in int32")
    raw_mask = data.get("loss_mask")
    if raw_mask is None:
        mask = np.ones(ids.size, dtype=np.int64)
    else:
        mask = _int_array(raw_mask, "loss_mask", allow_bool=True)
        if mask.size != ids.size:
            raise SampleError("loss_mask", f"length {mask.size} does not match input_ids length {ids.size}")
        if ((mask != 0) & (mask != 1)).any():
            j = _first((mask != 0) & (mask != 1))
            raise SampleError(f"loss_mask[{j}]", f"expected 0 or 1, got {mask[j]}")
    return TokenizedSample(
        sample_id=row.sample_id,
        input_ids=ids.astype(np.int32),
        loss_mask=mask.astype(np.uint8),
    )


_SHAPES = ("conversations", "messages", "input_ids")
_SHAPE_VALUES = {"conversations": "the turns as a list of {'from', 'value'} objects",
                 "messages": "the turns as a list of {'role', 'content'} objects",
                 "input_ids": "the token ids as a list of integers"}


def parse_row(row: SourceRow) -> Conversation | TokenizedSample:
    """Validate one raw row; raise :class:`SampleError` naming the field on any problem.

    Shapes: ShareGPT ``{"conversations": [{"from", "value"}]}``, OpenAI
    ``{"messages": [{"role", "content"}]}`` (content may be a list of text parts, joined with
    ``"\\n"``), or raw tokens ``{"input_ids": [int], "loss_mask": [0/1] (optional)}``. An assistant
    turn may carry ``reasoning_content`` (its thinking, for the chat template). Image, video and
    audio inputs (content parts, or a row's ``image(s)`` field) are rejected: not supported yet.
    Other keys are ignored. A null shape key counts as absent when another shape is given (as the
    columns of a Parquet file or a dataset holding both shapes are); a null value the row needs (its
    only shape, a role, a content) is a reject saying it is null, an absent one "missing field".
    """
    data = row.data
    if isinstance(data, BadRow):
        raise SampleError(data.field, data.reason)
    if not isinstance(data, Mapping):
        raise SampleError("row", f"expected a JSON object, got {_type_name(data)}")
    present = [k for k in _SHAPES if data.get(k) is not None]
    nulls = [k for k in _SHAPES if k in data and data[k] is None]
    if not present and len(nulls) == 1:
        raise SampleError(nulls[0], f"field {nulls[0]!r} is null; give {_SHAPE_VALUES[nulls[0]]}")
    if not present and nulls:
        raise SampleError("row", f"fields {nulls} are all null; give one of them")
    if not present:
        keys = sorted(str(k) for k in data.keys())[:20]
        raise SampleError(
            "row", f"no 'conversations', 'messages' or 'input_ids' field (found keys {keys})"
        )
    if len(present) > 1:
        raise SampleError("row", f"row has several of {present}; keep exactly one of them")
    key = present[0]
    media = [k for k in _MEDIA_FIELDS if data.get(k) not in (None, "", [], ())]
    if media and key != "input_ids":
        raise SampleError(media[0], f"{media[0].rstrip('s')} inputs are not supported yet (text-only capture); "
                                    "drop this sample or its media")
    if key == "input_ids":
        return _parse_tokens(row, data)
    items = _as_list(data[key], key)
    if key == "conversations":
        messages = _parse_messages(items, key, "from", "value")
    else:
        messages = _parse_messages(items, key, "role", "content")
    return Conversation(sample_id=row.sample_id, messages=messages)
