"""The house: no import cycle in the package (imports inside functions counted), each stage folder
importing only the stages before it (two named exceptions), a function-local import only to defer a
heavy or optional dependency (with its reason in a comment), modules under ~350 lines, and docs/layout.md's
Layout section naming every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hs_dataset"
MAX_LINES = 350
# Modules allowed past MAX_LINES, with the reason (none today).
LONG_MODULES: dict[str, str] = {}


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        if "demo/data" in p.relative_to(ROOT).as_posix():  # a tokenizer's own code, shipped as data
            continue
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = p
    return out


def imported(p: Path, name: str) -> set[str]:
    """Every hs_dataset module ``p`` imports, at any depth (function bodies included)."""
    tree = ast.parse(p.read_text(encoding="utf-8"))
    pkg = name.split(".") if p.name == "__init__.py" else name.split(".")[:-1]
    deps = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            mod = ".".join(pkg[: len(pkg) - n.level + 1] + ([n.module] if n.module else [])) if n.level else n.module
            if mod and mod.split(".")[0] == "hs_dataset":
                deps.add(mod)
        elif isinstance(n, ast.Import):
            deps.update(a.name for a in n.names if a.name.split(".")[0] == "hs_dataset")
    return deps


def test_no_import_cycle():
    mods = modules()
    graph = {m: {d for d in imported(p, m) if d in mods and d != m} for m, p in mods.items()}
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [m, d]))
            elif d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(cycles)
    assert not any(m in graph[m] for m in graph)


# The stage folders in pipeline order (docs/layout.md); the root modules and demo/ sit below them all.
STAGES = ("prepare", "capture", "codec", "write", "integrity", "hub", "read", "derive", "stream", "scale", "interop", "cli")
# A stage that uses a later stage's modules, with the reason (docs/layout.md says the same).
LATER_STAGES_USED = {
    ("capture", "codec"): "the SGLang plugin and the reference backend encode on their device (fp8, the teacher)",
    ("write", "integrity"): "the writer computes the checksums, statistics and damage marks that verify checks",
}


def _place(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in (*STAGES, "demo") else "root"


def test_each_stage_imports_only_the_stages_before_it():
    wrong = []
    for m, p in modules().items():
        a = _place(m)
        for d in imported(p, m):
            b = _place(d)
            if a == b or b == "root" or (a, b) in LATER_STAGES_USED:
                continue
            earlier = b == "demo" or (a in STAGES and b in STAGES and STAGES.index(b) < STAGES.index(a))
            if not earlier and m != "hs_dataset":  # the entry points, imported lazily
                wrong.append(f"{m} -> {d}")
    assert not wrong, "a stage imports a later stage (or a root module a stage):\n" + "\n".join(wrong)


def test_a_function_local_import_says_why():
    bare = []
    for m, p in modules().items():
        lines = p.read_text(encoding="utf-8").splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(fn):
                    if isinstance(n, (ast.Import, ast.ImportFrom)):
                        here, above = lines[n.end_lineno - 1], lines[n.lineno - 2]
                        if not (re.search(r"#\s*(deferred|optional)\b", here) or
                                re.match(r"\s*#\s*(deferred|optional)\b", above)):
                            bare.append(f"{p.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    assert not bare, "function-local imports without '# deferred: why' or '# optional: ...':\n" + "\n".join(bare)


def test_modules_are_small():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert set(long) <= set(LONG_MODULES), f"modules over {MAX_LINES} lines: {long}"


def layout_tree() -> set[str]:
    """The modules docs/layout.md's tree names, as paths under ``hs_dataset/`` (indentation: 2 spaces a level)."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    block = text[text.index("```text") + len("```text"):]
    block = block[:block.index("```")]
    stack: list[tuple[int, str]] = []
    named = set()
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        word = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if word.endswith("/"):
            stack.append((indent, word.rstrip("/")))
        elif word.endswith(".py"):
            named.add("/".join([d for _, d in stack[1:]] + [word]))  # stack[0] is hs_dataset/ itself
    return named


def test_the_documented_layout_is_the_tree():
    files = {str(p.relative_to(PACKAGE)) for p in modules().values()}
    files = {f for f in files if not f.endswith("__init__.py") or f == "__init__.py" or f.startswith("cli/")}
    named = layout_tree()
    assert not files - named, f"docs/layout.md does not name {sorted(files - named)}"
    assert not named - files, f"docs/layout.md names modules that do not exist: {sorted(named - files)}"


def test_the_public_names_are_typed_and_documented():
    import inspect

    import hs_dataset

    undocumented = []
    for name in hs_dataset.__all__:
        if name == "__version__":
            continue
        obj = getattr(hs_dataset, name)
        doc = inspect.getdoc(obj) or ""
        if inspect.isfunction(obj):
            ok = "Args:" in doc and "Raises:" in doc and inspect.signature(obj).return_annotation is not inspect._empty
        else:
            ok = "Args:" in doc or "Attributes:" in doc
        if not ok:
            undocumented.append(name)
    assert not undocumented, f"public names without Args:/Raises:/a return type: {undocumented}"
    assert (PACKAGE / "py.typed").is_file()
    with __import__("pytest").warns(FutureWarning, match="build_share"):
        assert hs_dataset.build_shard is hs_dataset.build_share  # the 0.2 name still works
    assert callable(hs_dataset.build)  # the function, not the hs_dataset.write package
