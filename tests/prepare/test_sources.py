"""Tests of the source stage: reading files/datasets (iter_source, read_rows, Source.rows, Source.fingerprint)
and validating rows (parse_row)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hs_dataset.errors import ConfigError, SampleError
from hs_dataset.prepare.conversations import parse_row
from hs_dataset.prepare.source_spec import resolve_source
from hs_dataset.prepare.sources import BadRow, iter_source
from hs_dataset.records import Conversation, Message, SourceRow, TokenizedSample
from tests.fixtures.cli import demo, run, user_error

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "builder_scripts" / "data" / "demo_conversations.jsonl"


def conv_row(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "conversations": [
            {"from": "human", "value": f"question {i}"},
            {"from": "gpt", "value": f"answer {i}"},
        ],
    }


def write_jsonl(path: Path, rows: list[Any], *, trailing_newline: bool = True) -> Path:
    text = "\n".join(json.dumps(r) for r in rows) + ("\n" if trailing_newline else "")
    path.write_text(text, encoding="utf-8")
    return path


def row(data: Any) -> SourceRow:
    return SourceRow(sample_id="t:0", index=0, data=data)


def field_of(data: Any) -> str:
    with pytest.raises(SampleError) as ei:
        parse_row(row(data))
    assert ei.value.field and ei.value.reason
    return ei.value.field


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_jsonl_rows_ids_and_range(tmp_path: Path, trailing_newline: bool) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", [conv_row(i) for i in range(7)], trailing_newline=trailing_newline)
    rows = list(iter_source(path))
    assert [r.index for r in rows] == list(range(7))
    assert [r.sample_id for r in rows] == [f"chats:{i}" for i in range(7)]
    assert rows[3].data == conv_row(3)
    assert resolve_source(path).rows == 7
    assert resolve_source(path).name == "chats"
    part = list(iter_source(str(path), start=2, stop=5))
    assert [r.index for r in part] == [2, 3, 4]
    assert [r.sample_id for r in part] == ["chats:2", "chats:3", "chats:4"]
    assert list(iter_source(path, start=10)) == []
    assert [r.index for r in iter_source(path, start=5, stop=100)] == [5, 6]


def test_hash_ids_are_content_hashes(tmp_path: Path) -> None:
    rows = [conv_row(0), conv_row(1), conv_row(0)]
    a = list(iter_source(write_jsonl(tmp_path / "a.jsonl", rows), sample_id="hash"))
    # Same content, other key order and file name: same ids.
    reordered = [{k: r[k] for k in reversed(list(r))} for r in rows]
    b = list(iter_source(write_jsonl(tmp_path / "b.jsonl", reordered), sample_id="hash"))
    ids = [r.sample_id for r in a]
    assert all(len(i) == 16 and all(c in "0123456789abcdef" for c in i) for i in ids)
    assert ids[0] == ids[2] != ids[1]
    assert ids == [r.sample_id for r in b]
    with pytest.raises(ValueError, match="sample_id"):
        iter_source(tmp_path / "a.jsonl", sample_id="uuid")


def test_jsonl_bad_lines_become_rejectable_rows(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        json.dumps(conv_row(0)).encode() + b"\n"
        + b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n'  # latin-1, not UTF-8
        + b'{"conversations": [\n'  # truncated JSON
        + b"\n"  # blank line
        + b"[1, 2, 3]\r\n"  # valid JSON, not an object; CRLF
        + json.dumps(conv_row(5)).encode() + b"\r\n"
    )
    rows = list(iter_source(path))
    assert len(rows) == resolve_source(path).rows == 6
    assert isinstance(parse_row(rows[0]), Conversation)
    assert isinstance(parse_row(rows[5]), Conversation)
    for i, words in [(1, "not valid UTF-8"), (2, "not valid JSON"), (3, "blank")]:
        assert isinstance(rows[i].data, BadRow)
        with pytest.raises(SampleError, match=words) as ei:
            parse_row(rows[i])
        assert f"line {i + 1}" in ei.value.reason
    with pytest.raises(SampleError, match="expected a JSON object"):
        parse_row(rows[4])
    # Hash ids work for undecodable lines too, and differ.
    hashed = [r.sample_id for r in iter_source(path, sample_id="hash")]
    assert len(set(hashed)) == 6


def test_json_file_list_and_data_key(tmp_path: Path) -> None:
    rows = [conv_row(i) for i in range(4)]
    (tmp_path / "plain.json").write_text(json.dumps(rows))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows, "version": 1}))
    for name in ("plain", "wrapped"):
        path = tmp_path / f"{name}.json"
        got = list(iter_source(path, start=1, stop=3))
        assert [r.sample_id for r in got] == [f"{name}:1", f"{name}:2"]
        assert [r.data for r in got] == rows[1:3]
        assert resolve_source(path).rows == 4
    (tmp_path / "broken.json").write_text('[{"a": 1},')
    with pytest.raises(ValueError, match="JSONL"):
        list(iter_source(tmp_path / "broken.json"))
    (tmp_path / "scalar.json").write_text("3")
    with pytest.raises(ValueError, match="list of rows"):
        resolve_source(tmp_path / "scalar.json").rows


def test_parquet_across_row_groups(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [conv_row(i) for i in range(25)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet", row_group_size=7)
    path = tmp_path / "p.parquet"
    assert resolve_source(path).rows == 25
    got = list(iter_source(path))
    assert [r.data for r in got] == rows
    part = list(iter_source(path, start=6, stop=15))
    assert [r.index for r in part] == list(range(6, 15))
    assert [r.data for r in part] == rows[6:15]
    assert all(isinstance(parse_row(r), Conversation) for r in part)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "json"])
def test_parts_read_in_one_pass_equal_the_whole(tmp_path: Path, kind: str) -> None:
    """read_rows over many part ranges (in order, out of order, one call each) gives exactly the rows of one
    pass; JSONL seeks from the line offsets its count recorded (ranges far from the last line read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hs_dataset.prepare.source_spec import LINES_PER_OFFSET
    from hs_dataset.prepare.sources import read_rows

    n = 3 * LINES_PER_OFFSET + 17
    rows = [conv_row(i) for i in range(n)]
    path = tmp_path / f"s.{kind}"
    if kind == "jsonl":
        write_jsonl(path, rows)
    elif kind == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=500)
    source = resolve_source(path)
    whole = [(r.index, r.sample_id, r.data) for r in read_rows(source, [(0, None)])]
    assert [w[2] for w in whole] == rows and source.rows == n
    size = 256
    ranges = [(s, min(s + size, n)) for s in range(0, n, size)]
    in_one = [(r.index, r.sample_id, r.data) for r in read_rows(source, ranges)]
    one_each = [(r.index, r.sample_id, r.data) for s, e in ranges for r in read_rows(source, [(s, e)])]
    assert in_one == one_each == whole
    picked = [(n - 5, None), (LINES_PER_OFFSET * 2 + 3, LINES_PER_OFFSET * 2 + 9), (1, 3), (n, None)]
    got = [r.index for r in read_rows(source, picked)]
    assert got == [*range(n - 5, n), *range(2 * LINES_PER_OFFSET + 3, 2 * LINES_PER_OFFSET + 9), 1, 2]
    assert [r.data for r in read_rows(source, picked)] == [rows[i] for i in got]


def damaged_parquet(tmp_path: Path) -> tuple[Path, Path]:
    """``(cut, damaged)``: a Parquet file cut in half (no footer), and one whose row group 1 of 3 has a
    garbled page header (its footer and the other row groups are fine)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([conv_row(i) for i in range(20)]), good, row_group_size=8)
    data = good.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    at = pq.ParquetFile(good).metadata.row_group(1).column(0).data_page_offset
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(data[:at] + b"\xff" * 8 + data[at + 8:])
    return cut, damaged


def test_a_damaged_parquet_file_is_one_config_error(tmp_path: Path) -> None:
    cut, damaged = damaged_parquet(tmp_path)
    for call in (lambda p: resolve_source(p).rows, iter_source):
        with pytest.raises(ConfigError) as ei:
            call(cut)
        msg = str(ei.value)
        assert "\n" not in msg and str(cut) in msg and "not a readable Parquet file" in msg and "write it again" in msg
        assert ei.value.field == "source" and ei.value.value == str(cut)
    assert resolve_source(damaged).rows == 20  # the footer is fine: the damage shows when row group 1 is read
    assert [r.index for r in iter_source(damaged, stop=8)] == list(range(8))
    rows = iter_source(damaged)
    with pytest.raises(ConfigError) as ei:
        for _ in rows:
            pass
    msg = str(ei.value)
    assert "\n" not in msg and str(damaged) in msg and "row group 1 (rows 8-15)" in msg and "write it again" in msg
    assert msg.isprintable()  # pyarrow's thrift message holds control characters: escaped


@pytest.mark.parametrize("which", ["cut", "damaged"])
def test_plan_and_build_of_a_damaged_parquet_source_are_one_line(tiny_model: str, tmp_path: Path, which: str) -> None:
    """Through the command line: exit 2, one line naming the file (was: a 25-line ArrowInvalid traceback, exit 1)."""
    path = dict(zip(("cut", "damaged"), damaged_parquet(tmp_path)))[which]
    r = run("plan", *demo(tiny_model, "--set", f"source={path}"))
    user_error(r, str(path), "Parquet", "write it again", cmd="plan")
    r = run("build", *demo(tiny_model, "--set", f"source={path}"), "-o", str(tmp_path / "out"))
    user_error(r, str(path), "Parquet", "write it again", cmd="build")


def test_saved_datasets_and_hf_sources(tmp_path: Path) -> None:
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(5)]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([1, 2])}).save_to_disk(str(tmp_path / "dd"))
    (tmp_path / "files").mkdir()
    ds.to_parquet(str(tmp_path / "files" / "train.parquet"))

    saved = list(iter_source(tmp_path / "saved", start=1, stop=3))
    assert [r.sample_id for r in saved] == ["saved:1", "saved:2"]
    assert [r.data for r in saved] == rows[1:3]
    assert resolve_source(tmp_path / "saved").rows == 5

    test_split = list(iter_source(f"{tmp_path / 'dd'}:test"))
    assert [r.sample_id for r in test_split] == ["dd/test:0", "dd/test:1"]
    assert [r.data for r in test_split] == rows[1:3]
    assert resolve_source(tmp_path / "dd").rows == 5  # default: train
    with pytest.raises(ValueError, match="no split"):
        resolve_source(f"{tmp_path / 'dd'}:validation").rows

    for src in (f"hf:{tmp_path / 'files'}", f"hf:{tmp_path / 'files'}:train"):
        got = list(iter_source(src, sample_id="row"))
        assert [r.sample_id for r in got] == [f"files/train:{i}" for i in range(5)]
        assert [r.data for r in got] == rows
        assert resolve_source(src).rows == 5
        assert isinstance(parse_row(got[0]), Conversation)
    assert resolve_source(f"hf:{tmp_path / 'files'}").fingerprint == resolve_source(f"hf:{tmp_path / 'files'}:train").fingerprint
    assert resolve_source(tmp_path / "saved").fingerprint != resolve_source(f"{tmp_path / 'dd'}:test").fingerprint


def test_fingerprint_changes_with_content(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [conv_row(0), conv_row(1)])
    fp1 = resolve_source(path).fingerprint
    assert fp1 == resolve_source(str(path)).fingerprint and len(fp1) == 64
    write_jsonl(path, [conv_row(0), conv_row(2)])
    assert resolve_source(path).fingerprint != fp1


def test_missing_or_unsupported_source(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        iter_source(tmp_path / "nope.jsonl")  # at call time, not at the first row
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        resolve_source(tmp_path / "x.csv").rows
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ValueError, match="save_to_disk"):
        list(iter_source(tmp_path / "plain_dir"))


def test_demo_file_parses() -> None:
    rows = list(iter_source(DEMO))
    assert len(rows) == resolve_source(DEMO).rows == 64
    convs = [parse_row(r) for r in rows]
    assert all(isinstance(c, Conversation) for c in convs)
    assert sum("conversations" in r.data for r in rows) == 32
    assert sum(c.messages[0].role == "system" for c in convs) >= 10
    assert sum(sum(m.role == "assistant" for m in c.messages) >= 2 for c in convs) >= 10
    assert max(sum(m.role == "assistant" for m in c.messages) for c in convs) == 4


# ----------------------------------------------------------------------------------------------
# parse_row: valid shapes
# ----------------------------------------------------------------------------------------------


def test_sharegpt_roles_any_case_and_system() -> None:
    conv = parse_row(row({"conversations": [
        {"from": "System", "value": "Be brief."},
        {"from": "HUMAN", "value": "hi"},
        {"from": "ChatGPT", "value": "hello"},
        {"from": "user", "value": "more"},
        {"from": "model", "value": "sure"},
        {"from": "human", "value": "and"},
        {"from": "bing", "value": "done"},
        {"from": "Human", "value": "unanswered"},
    ], "id": "extra fields are ignored"}))
    assert isinstance(conv, Conversation)
    assert conv.sample_id == "t:0"
    assert conv.messages == [
        Message("system", "Be brief."), Message("user", "hi"), Message("assistant", "hello"),
        Message("user", "more"), Message("assistant", "sure"), Message("user", "and"),
        Message("assistant", "done"),
    ]  # the trailing unanswered user turn is dropped


def test_openai_shape_with_text_parts() -> None:
    conv = parse_row(row({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"text": "part two"}]},
        {"role": "Assistant", "content": "reply", "name": "bot"},
    ]}))
    assert conv == Conversation("t:0", [Message("user", "part one\npart two"), Message("assistant", "reply")])


def test_same_conversation_in_both_shapes() -> None:
    a = parse_row(row({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}))
    b = parse_row(row({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}))
    assert a == b


def test_null_shape_keys_count_as_absent() -> None:
    # Columns unified by `datasets` give None for the other shape's key.
    conv = parse_row(row({"conversations": None, "messages": [{"role": "user", "content": "u", "from": None}, {"role": "assistant", "content": "a"}]}))
    assert isinstance(conv, Conversation)


def test_raw_tokens() -> None:
    s = parse_row(row({"input_ids": [5, 0, 7], "loss_mask": [0, 1, 1]}))
    assert isinstance(s, TokenizedSample)
    assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == np.uint8
    assert s.input_ids.tolist() == [5, 0, 7] and s.loss_mask.tolist() == [0, 1, 1]
    s = parse_row(row({"input_ids": [3, 4], "loss_mask": [True, False]}))
    assert s.loss_mask.tolist() == [1, 0]
    s = parse_row(row({"input_ids": np.array([3, 4], dtype=np.int64)}))
    assert s.loss_mask.tolist() == [1, 1]  # no mask: all ones


# ----------------------------------------------------------------------------------------------
# parse_row: every problem names its field
# ----------------------------------------------------------------------------------------------

U = {"from": "human", "value": "hi"}
G = {"from": "gpt", "value": "hello"}
SYS = {"from": "system", "value": "be nice"}


@pytest.mark.parametrize(
    "data, field, words",
    [
        ([1, 2], "row", "JSON object"),
        ("text", "row", "JSON object"),
        ({"text": "hello"}, "row", "no 'conversations'"),
        ({"conversations": [U, G], "messages": []}, "row", "several"),
        ({"conversations": []}, "conversations", "empty"),
        ({"conversations": "hi"}, "conversations", "expected a list"),
        ({"conversations": [U, "gpt: hello"]}, "conversations[1]", "expected an object"),
        ({"conversations": [U, {"value": "x"}]}, "conversations[1].from", "missing field 'from'"),
        ({"conversations": [U, {"from": "gpt"}]}, "conversations[1].value", "missing field 'value'"),
        ({"conversations": [U, {"from": "robot", "value": "x"}]}, "conversations[1].from", "unknown role 'robot'"),
        ({"conversations": [U, {"from": 3, "value": "x"}]}, "conversations[1].from", "expected a role string"),
        ({"conversations": [U, {"from": "gpt", "value": 42}]}, "conversations[1].value", "expected a string, got int"),
        ({"conversations": [U, {"from": "gpt", "value": ["a"]}]}, "conversations[1].value", "expected a string, got list"),
        ({"conversations": [U, {"from": "gpt", "value": b"x"}]}, "conversations[1].value", "raw bytes"),
        ({"conversations": [U, {"from": "gpt", "value": "bad \ud800 text"}]}, "conversations[1].value", "not valid UTF-8"),
        ({"conversations": [U, G, SYS, U, G]}, "conversations[2].from", "only allowed as the first turn"),
        ({"conversations": [G, U, G]}, "conversations[0].from", "must be a user turn"),
        ({"conversations": [SYS, G]}, "conversations[1].from", "must be a user turn"),
        ({"conversations": [SYS, SYS, U, G]}, "conversations[1].from", "only allowed as the first turn"),
        ({"conversations": [U, U, G]}, "conversations[1].from", "consecutive user"),
        ({"conversations": [U, G, G]}, "conversations[2].from", "consecutive assistant"),
        ({"conversations": [U]}, "conversations", "no assistant turn"),
        ({"conversations": [SYS, U]}, "conversations", "no assistant turn"),
        ({"conversations": [SYS]}, "conversations", "no assistant turn"),
        ({"conversations": [U, {"from": "gpt", "value": "  "}]}, "conversations[1].value", "reply is empty"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "messages[0].content", "missing field 'content'"),
        ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}, "messages[0].content",
         "field 'content' is null; give the turn's text"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{}]}]},
         "messages[1].content", "field 'content' is null; give the turn's text as a string (a turn of tool calls only"),
        ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role", "field 'role' is null; give the role"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{}]}]}, "messages[1].content",
         "missing field 'content' (found keys ['role', 'tool_calls'])"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}, {"role": "assistant", "content": "x"}]},
         "messages[0].content[0].text", "missing field 'text' (found keys ['type'])"),
        ({"conversations": [U, {"from": "gpt", "value": None}]}, "conversations[1].value", "field 'value' is null"),
        ({"conversations": [U, {"from": None, "value": "x"}]}, "conversations[1].from", "field 'from' is null"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}, {"role": "assistant", "content": "x"}]},
         "messages[0].content[0].text", "field 'text' is null; give the part's text"),
        ({"input_ids": None}, "input_ids", "field 'input_ids' is null; give the token ids as a list of integers"),
        ({"messages": None}, "messages", "field 'messages' is null; give the turns"),
        ({"messages": None, "input_ids": None}, "row", "fields ['messages', 'input_ids'] are all null"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "unknown role 'tool'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}, {"role": "assistant", "content": "x"}]}, "messages[0].content[0]", "image inputs are not supported yet"),
        ({"messages": [{"role": "user", "content": [{"type": "file", "file": "f"}]}, {"role": "assistant", "content": "x"}]}, "messages[0].content[0].type", "only text"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}, {"role": "assistant", "content": "x"}]}, "messages[0].content[0].text", "expected a string"),
        ({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "x"}]}, "messages[0].content[0]", "content part"),
        ({"messages": [{"role": "user", "content": []}, {"role": "assistant", "content": "x"}]}, "messages[0].content", "empty list"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}, {"role": "assistant", "content": "x"}]}, "messages[0].content", "expected a string, got dict"),
        ({"input_ids": []}, "input_ids", "empty"),
        ({"input_ids": "1 2 3"}, "input_ids", "expected a list"),
        ({"input_ids": [1, -2, 3]}, "input_ids[1]", "negative token id -2"),
        ({"input_ids": [1, 2.0]}, "input_ids[1]", "expected an integer, got float"),
        ({"input_ids": [1, True]}, "input_ids[1]", "expected an integer, got bool"),
        ({"input_ids": [1, "2"]}, "input_ids[1]", "expected an integer"),
        ({"input_ids": [1, 2**40]}, "input_ids[1]", "int32"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "loss_mask", "length 1 does not match input_ids length 2"),
        ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "loss_mask[1]", "expected 0 or 1"),
        ({"input_ids": [1, 2], "loss_mask": [1, "1"]}, "loss_mask[1]", "expected an integer"),
        ({"input_ids": [1, 2], "loss_mask": "11"}, "loss_mask", "expected a list"),
    ],
)
def test_parse_row_errors_name_the_field(data: Any, field: str, words: str) -> None:
    with pytest.raises(SampleError) as ei:
        parse_row(row(data))
    assert ei.value.field == field, ei.value
    assert words in ei.value.reason, ei.value
    assert str(ei.value) == f"{field}: {ei.value.reason}"


@pytest.mark.parametrize("data,ids,mask", [
    ({"input_ids": [5, 0, 2**31 - 1]}, [5, 0, 2**31 - 1], [1, 1, 1]),
    ({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, [5, 6, 7], [0, 1, 1]),
    ({"input_ids": [5, 6, 7], "loss_mask": [False, True, 1]}, [5, 6, 7], [0, 1, 1]),
    ({"input_ids": np.array([5, 6]), "loss_mask": [np.int64(1), np.bool_(False)]}, [5, 6], [1, 0]),
])
def test_token_rows_become_int32_ids_and_a_uint8_mask(data: Any, ids: list[int], mask: list[int]) -> None:
    """Plain ints (converted at once), bools in the mask, numpy integers (element by element): the same arrays."""
    got = parse_row(row(data))
    assert got.input_ids.dtype == np.int32 and got.input_ids.tolist() == ids
    assert got.loss_mask.dtype == np.uint8 and got.loss_mask.tolist() == mask


# ----------------------------------------------------------------------------------------------
# Property: malformed JSONL never breaks reading or parsing
# ----------------------------------------------------------------------------------------------

_surrogate_text = st.builds(
    lambda a, s, b: a + s + b,
    st.text(max_size=4),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    st.text(max_size=4),
)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=10) | _surrogate_text,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(
        st.sampled_from(["conversations", "messages", "input_ids", "loss_mask", "from", "value", "role", "content", "type", "text"])
        | st.text(max_size=6),
        children,
        max_size=4,
    ),
    max_leaves=15,
)


def _encode_line(value: Any, ensure_ascii: bool) -> bytes:
    # ensure_ascii=False with lone surrogates gives bytes that are not valid UTF-8.
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


_lines = st.one_of(
    st.builds(_encode_line, _json_values, st.booleans()),
    st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"")),
    st.just(b""),
    st.just(b"\xff\xfe{"),
)


@settings(max_examples=60, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_lines, max_size=12), sample_id=st.sampled_from(["row", "hash"]))
def test_jsonl_one_row_per_line_and_parse_never_crashes(lines: list[bytes], sample_id: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fuzz.jsonl")
        with open(path, "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines))
        rows = list(iter_source(path, sample_id=sample_id))
        assert len(rows) == len(lines) == resolve_source(path).rows
        assert [r.index for r in rows] == list(range(len(lines)))
        for r in rows:
            try:
                parsed = parse_row(r)
            except SampleError as e:
                assert e.field and e.reason
            else:
                assert isinstance(parsed, (Conversation, TokenizedSample))
