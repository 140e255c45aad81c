"""Bounded memory for any input, and the smaller faults of issue 12: a 50 MB conversation builds
within 1 GiB (the text is cut before tokenization, with the same tokens), a source file whose name
is not UTF-8 builds, and a disk with 0 bytes free is an OutputWriteError naming the path."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hs_dataset.write.driver import build
from hs_dataset.write.output import output_error
from hs_dataset.errors import OutputWriteError, SampleError
from hs_dataset.prepare.conversations import parse_row
from hs_dataset.prepare.loss_mask import CUT_CHARS_PER_TOKEN, CUT_MARGIN, assistant_char_spans, tokenize_sample
from hs_dataset.prepare.tokenizer import load_tokenizer
from hs_dataset.read.open import open_dataset
from hs_dataset.records import SourceRow
from tests.fixtures.builds import DEMO, config
from tests.scenarios.test_faults import _mounted

ROOT = Path(__file__).resolve().parents[2]
PEAK_RSS_LIMIT = 1 << 30

# Builds a source whose first row is a ~50 MB conversation in a subprocess and reports its peak RSS.
BIG_BUILD = textwrap.dedent("""
    import json, random, sys
    from pathlib import Path
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.write.driver import build
    work, model, mb = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(4000)]
    reply = " ".join(rng.choice(words) for _ in range(mb * 2**20 // 6))
    src = work / "src.jsonl"
    with open(src, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "Summarise this, please."},
                                         {"role": "assistant", "content": reply}]}) + "\\n")
        del reply
        for i in range(3):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                             {"role": "assistant", "content": "a short reply"}]}) + "\\n")
    print("source bytes", src.stat().st_size)
    cfg = HiddenStatesConfig(model=model, layers=(0, 1, 2), source=str(src), max_length=256,
                             backend_options={"device": "cpu"})
    s = build(cfg, work / "out", progress=False)
    print("written", s.counts.written, "rejected", s.counts.rejected)
    # VmHWM: this process image's peak; ru_maxrss would carry over the parent's across fork + exec
    print("peak_rss", int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024)
""")


def test_a_50_mb_conversation_builds_within_1_gib(tiny_model, tmp_path):
    r = subprocess.run([sys.executable, "-c", BIG_BUILD, str(tmp_path), tiny_model, "50"], capture_output=True,
                       text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert int(lines["source"].split()[-1]) > 50 * 10**6
    assert lines["written"] == "4 rejected 0"
    peak = int(lines["peak_rss"])
    print(f"\npeak RSS of a build with a {int(lines['source'].split()[-1]) / 1e6:.0f} MB conversation: "
          f"{peak / 2**20:.0f} MiB")
    assert peak < PEAK_RSS_LIMIT
    ds = open_dataset(tmp_path / "out")
    assert ds[0]["num_tokens"] == 256 and sum(ds[0]["loss_mask"]) > 200  # cut to max_length, reply masked


def _texts(rng: random.Random, n: int) -> str:
    """Text of every shape a pre-tokenizer splits: words, long words, digit runs, whitespace runs,
    newlines, punctuation, non-ASCII."""
    pieces = ["the", "quick", "brown", "fox", "Paris", "é", "日本語", "naïve", "123", "4567890", "  ", "\n", "\n\n",
              "\t", ",", "...", "!?", "<|im_end|>", "x" * 40, "ab" * 30, "9" * 50, " " * 30, "🙂", "don't"]
    return "".join(rng.choice(pieces) + rng.choice(["", " "]) for _ in range(n))


@pytest.mark.parametrize("seed", range(6))
def test_cutting_before_tokenization_keeps_the_tokens_and_the_mask(tiny_model, seed):
    """The tokens and mask of a long conversation equal those of tokenizing the whole rendered text
    and truncating it, for every max_length and both truncation modes."""
    tok = load_tokenizer(tiny_model)
    rng = random.Random(seed)
    turns = []
    for _ in range(rng.randint(1, 3)):
        turns += [{"role": "user", "content": _texts(rng, rng.randint(5, 3000))},
                  {"role": "assistant", "content": _texts(rng, rng.randint(5, 6000))}]
    conv = parse_row(SourceRow("s:0", 0, {"messages": turns}))
    full, spans = assistant_char_spans(tok, conv.messages)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"])
    offsets = enc["offset_mapping"]
    cut_any = False
    for max_length in (1, 7, 64, 256, 1000, len(ids) - 1, len(ids) + 5):
        cut_any |= len(full) > CUT_CHARS_PER_TOKEN * (max_length + CUT_MARGIN)
        n = min(max_length, len(ids))
        mask = np.array([any(s < b and e > a for a, b in spans) for s, e in offsets[:n]], dtype=np.uint8)
        try:
            got = tokenize_sample(conv, tok, max_length=max_length)
        except SampleError as e:  # nothing to train on in the first max_length tokens
            assert not mask.any(), e
        else:
            assert got.input_ids.tolist() == ids[:n].tolist() and got.loss_mask.tolist() == mask.tolist()
        if len(ids) > max_length:
            with pytest.raises(SampleError, match="more than max_length"):
                tokenize_sample(conv, tok, max_length=max_length, truncation="reject")
    assert cut_any


def test_a_source_file_whose_name_is_not_utf8_builds(tiny_model, backend, tmp_path):
    name = os.fsdecode(b"conv\xff\xfe-caf\xc3\xa9.jsonl")  # undecodable bytes, then a valid UTF-8 one
    src = tmp_path / name
    src.write_bytes(DEMO.read_bytes())
    out = tmp_path / "out"
    s = build(config(tiny_model, source=str(src), max_samples=8), out, backend=backend, progress=False,
              build_command=f"hs-dataset build x --set source={src}")
    assert s.counts.written == 8
    ids = list(open_dataset(out)["id"])
    assert ids[0] == "conv\\xff\\xfe-café:0"  # valid UTF-8, the bytes visible
    for f in ("README.md", "hs_dataset.json", "rejects.jsonl"):
        (out / f).read_bytes().decode("utf-8")  # strict UTF-8
    assert "conv\\xff\\xfe-café" in (out / "README.md").read_text()
    assert json.loads((out / "hs_dataset.json").read_text())["source"] == str(src)  # exact, JSON-escaped


def test_datasets_not_enough_disk_space_is_an_output_write_error(tmp_path):
    e = OSError("Not enough disk space. Needed: Unknown size (download: Unknown size, generated: Unknown size, "
                "post-processed: Unknown size)")
    err = output_error(e, tmp_path / "out")
    assert isinstance(err, OutputWriteError) and err.errno == errno.ENOSPC
    assert str(tmp_path / "out") in str(err) and "Not enough disk space" in str(err) and "run the same command" in str(err)


def _fill(disk: Path) -> None:
    """Write a file until the disk has exactly 0 bytes free."""
    with open(disk / "filler", "wb", buffering=0) as f:
        for block in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    assert os.statvfs(disk).f_bavail == 0


def test_zero_bytes_free_names_the_output(tiny_model, backend, tmp_path):
    """At exactly 0 bytes free the first shard write fails (datasets skips its own free-space check for the
    builder's parallel-writing file system): the build raises OutputWriteError naming the output and
    saying what to do, and resumes once there is space (needs root for the tmpfs; skipped elsewhere)."""
    with _mounted(tmp_path / "disk", "-t", "tmpfs", "-o", "size=4m", "tmpfs") as disk:
        out = disk / "out"
        build(config(tiny_model, max_samples=4), out, backend=backend, progress=False)
        for f in (out / "hs_dataset.json", out / "README.md", out / "rejects.jsonl", out / ".hs_build" / "hs_dataset.json",
                  out / ".hs_build" / "parts" / "part-00000.json", *(out / "data").iterdir()):
            f.unlink()  # part 0 must be built again, and nothing needs writing before it starts
        _fill(disk)
        with pytest.raises(OutputWriteError) as e:
            build(config(tiny_model, max_samples=4), out, backend=backend, progress=False)
        assert e.value.errno == errno.ENOSPC and str(out) in str(e.value), str(e.value)
        assert "No space left on device" in str(e.value) and "the build resumes" in str(e.value)
        (disk / "filler").unlink()
        assert build(config(tiny_model, max_samples=4), out, backend=backend, progress=False).counts.written == 4
