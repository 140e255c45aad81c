"""The spool transport used between the SGLang plugin and the backend (CPU: files and splitting)."""

import threading
import time

import pytest
import torch

from hs_dataset.spool import SpoolTimeout, chunk_path, collect, error_path, read_chunk, request_spans, write_chunk


def test_request_spans_split_a_mixed_batch_by_extend_lengths():
    rids = ["hsds-a-0", "other-1", "hsds-a-2", "hsds-a-3"]
    spans = request_spans(rids, [5, 3, 4, 2], [0, 0, 128, 0], "hsds-")
    # rows: a0 0..5, other 5..8 (skipped), a2 8..12 (a chunk starting at position 128), a3 12..14
    assert spans == [("hsds-a-0", 0, 0, 5), ("hsds-a-2", 8, 128, 4), ("hsds-a-3", 12, 0, 2)]


def test_chunk_roundtrip_is_bit_exact_and_reads_with_safetensors(tmp_path):
    parts = [torch.randn(7, 16).to(torch.bfloat16) for _ in range(3)]
    write_chunk(tmp_path, "hsds-x-1", 0, parts, {"rid": "hsds-x-1", "nonfinite": "0,2,0"})
    c = read_chunk(chunk_path(tmp_path, "hsds-x-1", 0))
    assert c.nonfinite == (0, 2, 0)
    assert c.start == 0 and c.states.shape == (3, 7, 16) and c.states.dtype == torch.bfloat16
    for j in range(3):
        assert torch.equal(c.states[j].view(torch.int16), parts[j].view(torch.int16))
    assert not list(tmp_path.glob(".*tmp"))


def test_collect_joins_chunks_in_order_and_deletes_them(tmp_path):
    full = torch.randn(2, 10, 8).to(torch.bfloat16)

    def writer():  # chunks arrive late and out of order, as a chunked prefill's writer thread may
        time.sleep(0.05)
        write_chunk(tmp_path, "r", 6, [full[j, 6:] for j in range(2)], {})
        time.sleep(0.05)
        write_chunk(tmp_path, "r", 0, [full[j, :6] for j in range(2)], {})

    t = threading.Thread(target=writer)
    t.start()
    got, nonfinite = collect(tmp_path, "r", 10, timeout=5)
    assert nonfinite is None  # these chunks carry no count
    t.join()
    assert torch.equal(got.view(torch.int16), full.view(torch.int16))
    assert list(tmp_path.iterdir()) == []


def test_collect_reports_the_plugin_error_and_times_out(tmp_path):
    error_path(tmp_path, "r").write_text("request r: 12 prompt positions came from SGLang's radix cache")
    with pytest.raises(RuntimeError, match="radix cache"):
        collect(tmp_path, "r", 20, timeout=5)
    with pytest.raises(SpoolTimeout, match="position 0 of 4"):
        collect(tmp_path, "q", 4, timeout=0.2)
