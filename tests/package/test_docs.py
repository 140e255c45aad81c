"""The README and the guides (issue 49): short, every relative link resolving, no run history, the benchmarks page
what benchmarks/results gives, the API page naming every entry point, and the guides' blocks marked
``<!-- runs on the demo build -->`` run as they stand on the demo build. (`mkdocs build --strict` in .ci/run
checks the site itself: pages, nav, anchors, API entries.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
RUNS = "<!-- runs on the demo build -->"
MAX_README_LINES = 250

# What a user guide does not say: how, where and when a figure was obtained (benchmarks.md dates its rows: data).
HISTORY = [r"this VM", r"\bsessions?\b", r"was lent", r"not run yet", r"before this change", r"\bnot measured yet\b",
           r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",  # a commit hash
           r"\b20\d\d-\d\d-\d\d\b"]  # a date


def _slug(heading: str) -> str:
    """The anchor MkDocs (toc) gives a heading."""
    text = re.sub(r"[`*_\[\]()]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", page.read_text(encoding="utf-8"), re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # links in code are not links
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines"


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue  # http(s):, mailto:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not bad, bad


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_history(page):
    text = page.read_text(encoding="utf-8")
    patterns = HISTORY[:-1] if page.name == "benchmarks.md" else HISTORY
    found = [m.group(0) for p in patterns for m in re.finditer(p, text)]
    assert not found, found


def test_the_benchmarks_page_is_what_the_results_give():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_api_page_documents_every_entry_point():
    import hs_dataset

    api = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [f"{module}.{name}" for name, module in hs_dataset._EXPORTS.items()  # noqa: SLF001
               if f"::: {module}.{name}\n" not in api]
    assert not missing, f"docs/api.md does not document {missing}"


def _runnable_blocks() -> list[tuple[str, str, str]]:
    """(page, language, code) of every block marked to run on the demo build."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(re.escape(RUNS) + r"\n```(bash|python)\n(.*?)```", text, re.S):
            found.append((str(page.relative_to(ROOT)), m.group(1), m.group(2)))
    return found


def test_some_guides_blocks_claim_to_run():
    assert {page for page, _, _ in _runnable_blocks()} >= {"docs/checking.md", "docs/loading.md"}


@pytest.fixture(scope="module")
def demo(tiny_model, tmp_path_factory) -> Path:
    """The README's demo build (builder_scripts/tiny_demo.py) in ``.../demo_out``."""
    out = tmp_path_factory.mktemp("guides") / "demo_out"
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "build", str(ROOT / "builder_scripts" / "tiny_demo.py"),
                        "--output", str(out), "--set", f"model={tiny_model}", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("block", _runnable_blocks(), ids=lambda b: f"{b[0]}-{b[1]}")
def test_the_guides_blocks_run_as_they_stand(block, demo, tmp_path):
    page, language, code = block
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HF_DATASETS_CACHE=str(tmp_path / "hf-cache"))
    if language == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    r = subprocess.run(cmd, cwd=demo.parent, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (page, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr[-3000:]


def test_the_readmes_demo_commands_run_as_they_stand(tmp_path):
    """The README's first command after its install step (plan, build, inspect of the demo), in a fresh folder."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(python3 -m venv .*?)```", readme, re.S).group(1)
    first = block.split("\n\n")[0].replace("\\\n", " ")
    demo = first[first.index("hs-dataset plan"):]  # the install step is .ci/run's
    assert demo.count("hs-dataset ") == 3 and "demo_out" in demo
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HS_DATASET_CACHE=str(tmp_path / "cache"), HF_DATASETS_CACHE=str(tmp_path / "hf-cache"))
    (tmp_path / "builder_scripts").symlink_to(ROOT / "builder_scripts")  # the README's commands run in a clone
    r = subprocess.run(["bash", "-e", "-c", demo], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "64 samples written" in r.stdout and (tmp_path / "demo_out" / "hs_dataset.json").is_file()
