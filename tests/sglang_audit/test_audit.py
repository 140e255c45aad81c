"""The CPU audit of every SGLang release in the supported range (issue 47, item 2): each touchpoint of the plugin
and backend (tests/sglang_audit/touchpoints.py) in each release's source is one the project read and says how it
handles (accepted.json); a changed one fails naming its file and line. Also: the [sglang] extra allows exactly the
audited releases.

The releases' excerpts are kept in releases/<version>.json (refreshed from PyPI by
``python -m tests.sglang_audit.refresh``). With unpacked wheels at $HS_SGLANG_SRC/<version>/sglang/srt (the
refresh script's cache: ~/.cache/hs_dataset/sglang-wheels/src), the source itself is re-read and must give the
stored excerpts."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest

from hs_dataset.capture.sglang.versions import AUDITED_SGLANG, MAX_SGLANG, MIN_SGLANG
from tests.sglang_audit.refresh import CACHE
from tests.sglang_audit.touchpoints import ACCEPTED, RELEASES, TOUCHPOINTS, audit, extract, fingerprint, load_release

ROOT = Path(__file__).resolve().parents[2]
SUPPORTED = [f"0.5.{p}" for p in range(MIN_SGLANG[2], MAX_SGLANG[2] + 1)]
SRC = Path(os.environ.get("HS_SGLANG_SRC", CACHE / "src"))


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_touchpoint_of_a_supported_release_is_known(version):
    problems = audit(load_release(version))
    assert problems == [], "\n".join(problems)


def test_the_supported_range_is_what_versions_py_declares():
    assert MIN_SGLANG[:2] == MAX_SGLANG[:2] == (0, 5)
    assert AUDITED_SGLANG == f"{SUPPORTED[0]} - {SUPPORTED[-1]}"
    assert all((RELEASES / f"{v}.json").exists() for v in SUPPORTED)


def test_accepted_names_the_releases_each_variant_was_read_in():
    accepted = json.loads(ACCEPTED.read_text())
    for touch in TOUCHPOINTS:
        for fp, entry in accepted[touch.id].items():
            assert entry["handled"], (touch.id, fp)
            for v in entry["releases"]:
                assert fingerprint(load_release(v)["touchpoints"][touch.id]) == fp, (touch.id, v)


def test_an_edited_excerpt_fails_naming_file_and_line():
    release = copy.deepcopy(load_release("0.5.17"))
    tp = release["touchpoints"]["llama.capture_point"]
    tp["text"] = tp["text"].replace("aux_hidden_states.append(hidden_states + residual)",
                                    "aux_hidden_states.append(residual)")
    (problem,) = audit(release)
    assert problem.startswith(f"SGLang 0.5.17: sglang/srt/models/llama.py:{tp['line']}: touchpoint llama.capture_point "
                              "changed (fingerprint ")
    assert "accepted.json" in problem


@pytest.mark.parametrize("version, touchpoint, file", [
    ("0.5.12", "set_eagle3.deepseek_v2", "sglang/srt/models/deepseek_v2.py:2529"),  # +1 always: off by one
    ("0.5.13", "ServerArgs.cuda_graph_backend_prefill", "sglang/srt/server_args.py"),  # prefill graphs: piecewise
])
def test_an_excluded_release_fails(version, touchpoint, file):
    problems = audit(load_release(version))
    hit = [p for p in problems if f"touchpoint {touchpoint} " in p]
    assert hit and hit[0].startswith(f"SGLang {version}: {file}"), problems


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_the_stored_excerpts_are_what_the_source_says(version):
    root = SRC / version
    if not (root / "sglang" / "srt").is_dir():
        pytest.skip(f"no unpacked SGLang {version} at {root} (python -m tests.sglang_audit.refresh {version} makes it)")
    assert extract(root, version)["touchpoints"] == load_release(version)["touchpoints"]


def test_an_edited_source_file_fails_naming_file_and_line(tmp_path):
    root = SRC / "0.5.23"
    if not (root / "sglang" / "srt").is_dir():
        pytest.skip(f"no unpacked SGLang 0.5.23 at {root} (python -m tests.sglang_audit.refresh 0.5.23 makes it)")
    copy_root = tmp_path / "0.5.23"
    shutil.copytree(root, copy_root)
    llama = copy_root / "sglang" / "srt" / "models" / "llama.py"
    text = llama.read_text()
    assert "if i in self.layers_to_capture" in text
    llama.write_text(text.replace("if i in self.layers_to_capture", "if i + 1 in self.layers_to_capture"))
    problems = audit(extract(copy_root, "0.5.23"))
    assert len(problems) == 1 and "sglang/srt/models/llama.py:" in problems[0] and "llama.capture_point" in problems[0]


def test_the_sglang_extra_allows_exactly_the_audited_releases():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert extra == [f"sglang>={SUPPORTED[0]},<={SUPPORTED[-1]}"]
