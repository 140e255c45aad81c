"""Every place where hs_dataset's SGLang plugin and backend touch SGLang's source, and how to find each one in a
release's source tree.

:func:`extract` reads an unpacked SGLang wheel (``<root>/sglang/srt/...``) and returns, per touchpoint, the file,
the line and the code it found there; :func:`audit` compares that code with the variants the project has read
and says how it handles (``accepted.json``): a touchpoint whose code is not one of them fails, naming its file and
line. ``releases/<version>.json`` keeps what :func:`extract` found in each release (refreshed from PyPI by
``python -m tests.sglang_audit.refresh``), so the audit needs no download.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ACCEPTED", "RELEASES", "TOUCHPOINTS", "Touchpoint", "audit", "extract", "fingerprint", "license_header",
           "load_release"]

HERE = Path(__file__).resolve().parent
RELEASES = HERE / "releases"
ACCEPTED = HERE / "accepted.json"
ABSENT = "absent"


@dataclass(frozen=True)
class Touchpoint:
    """One thing the plugin or backend relies on.

    ``files``: paths under ``sglang/srt/`` (globs allowed), the first holding ``pattern`` counts. ``scope``:
    regexes of the enclosing class / def lines, outermost first. ``kind``: ``line`` (the matched line),
    ``statement`` (through its closing bracket), ``signature`` (a def through its ``:``), ``block`` (the whole
    indented block), ``grep`` (the lines of the scope matching ``pattern``). ``uses``: what hs_dataset does with it.
    """

    id: str
    files: tuple[str, ...]
    pattern: str
    kind: str = "line"
    scope: tuple[str, ...] = ()
    uses: str = ""


def _fields(*names: str) -> list[Touchpoint]:
    files = ("server_args.py", "arg_groups/fields/*.py")
    return [Touchpoint(f"ServerArgs.{n}", files, rf"^    {n}\s*:", "statement", (),
                       "sglang_engine_args passes it / versions.py reads it") for n in names]


_LLAMA, _DSV2 = ("models/llama.py",), ("models/deepseek_v2.py",)
_CAPTURE = r"layers_to_capture|aux_hidden_states|captured_last_layer_outputs|capture_output|residual_batch|self\.norm\("

TOUCHPOINTS: tuple[Touchpoint, ...] = (
    # the plugin framework: entry points and hooks
    Touchpoint("plugins.entry_group", ("plugins/__init__.py",), r"sglang\.srt\.plugins|SGLANG_PLUGINS", "grep",
               uses="entry point group hs_dataset_capture registers in; SGLANG_PLUGINS allow-list"),
    Touchpoint("HookRegistry.register", ("plugins/hook_registry.py",), r"def register\(", "signature",
               (r"^class HookRegistry\b",), "register(target, fn, HookType)"),
    Touchpoint("HookType", ("plugins/hook_registry.py",), r"^class HookType\b", "block", uses="AFTER, AROUND"),
    # hook targets and their signatures
    Touchpoint("ModelRunner.load_model", ("model_executor/model_runner.py",), r"def load_model\(", "signature",
               (r"^class ModelRunner\b",), "AFTER hook: find the text model, write the manifest"),
    Touchpoint("ModelRunner.forward", ("model_executor/model_runner.py",), r"def forward\(", "signature",
               (r"^class ModelRunner\b",), "AROUND hook: original(runner, forward_batch, ...)"),
    Touchpoint("LogitsProcessor.forward", ("layers/logits_processor.py",), r"def forward\(", "signature",
               (r"^class LogitsProcessor\b",), "AROUND hook: (input_ids, hidden_states, lm_head, logits_metadata, "
                                                  "aux_hidden_states)"),
    Touchpoint("parallel_state.tp_rank", ("distributed/parallel_state.py",),
               r"^def get_tensor_model_parallel_rank\(", "signature"),
    Touchpoint("parallel_state.tp_size", ("distributed/parallel_state.py",),
               r"^def get_tensor_model_parallel_world_size\(", "signature"),
    Touchpoint("parallel_state.pp_size", ("distributed/parallel_state.py",),
               r"^def get_pipeline_model_parallel_world_size\(", "signature"),
    Touchpoint("parallel_state.get_tp_group", ("distributed/parallel_state.py",), r"^def get_tp_group\(",
               "signature", uses="all_gather of the teacher's parts"),
    # ForwardBatch
    Touchpoint("ForwardBatch.fields", ("model_executor/forward_batch_info.py",),
               r"^    (forward_mode|rids|extend_seq_lens_cpu|extend_prefix_lens_cpu|capture_hidden_mode|"
               r"residual_stream)\s*:", "grep", (r"^class ForwardBatch\b",), "split a pass by request"),
    Touchpoint("ForwardMode.is_extend", ("model_executor/forward_batch_info.py",), r"def is_extend\(", "block",
               (r"^class ForwardMode\b",)),
    Touchpoint("CaptureHiddenMode.need_capture", ("model_executor/forward_batch_info.py",), r"def need_capture\(",
               "block", (r"^class CaptureHiddenMode\b",)),
    # the capture point and the final norm
    Touchpoint("llama.capture_point", _LLAMA, _CAPTURE, "grep", (r"^class LlamaModel\b", r"    def forward\("),
               "aux capture of layer k's output at layers_to_capture = k + 1; the final norm's residual"),
    Touchpoint("llama.layer_output", _LLAMA, r"return |capture_output|residual", "grep",
               (r"^class LlamaDecoderLayer\b", r"    def forward\("), "the self-check's reference: the layer's output"),
    Touchpoint("llama.capture_flag", _LLAMA, r"capture_aux_hidden_states", "grep", (r"^class LlamaForCausalLM\b",),
               "switched on per pass by the plugin"),
    Touchpoint("deepseek_v2.capture_point", _DSV2, _CAPTURE, "grep",
               (r"^class DeepseekV2Model\b", r"    def forward\("), "as llama"),
    Touchpoint("deepseek_v2.layer_output", _DSV2, r"return |captured_last_layer_outputs|capture_output", "grep",
               (r"^class DeepseekV2DecoderLayer\b", r"    def forward\("), "as llama"),
    Touchpoint("deepseek_v2.capture_flag", _DSV2, r"capture_aux_hidden_states", "grep",
               (r"^class DeepseekV2ForCausalLM\b",)),
    Touchpoint("communicator.capture", ("layers/communicator.py",), r"def prepare_attn_and_capture_last_layer_outputs\(",
               "block", uses="DeepSeek's capture of the entering state (0.5.14-0.5.20)"),
    Touchpoint("aux_hidden_states", ("layers/aux_hidden_states.py",),
               r"^class |def append|def capture|copies_on_append|\.clone\(|\.copy_\(|torch\.cat", "grep",
               uses="the aux states' container (a list, or packed [tokens, n * H])"),
    Touchpoint("residual_batch.snapshot", ("layers/layer_boundary/residual/stream.py",), r"def snapshot\(", "block",
               (r"^class ResidualStream\b",), "the self-check's reference on 0.5.21+"),
    # set_eagle3_layers_to_capture: the layer-id rule per model file (hs_dataset.capture.layer_ids)
    *(Touchpoint(f"set_eagle3.{f}", (f"models/{f}.py",), r"def set_eagle3_layers_to_capture\(", "block",
                 uses="hs_dataset.capture.layer_ids: the SGLang ids of a drafter config")
      for f in ("llama", "deepseek_v2", "glm4_moe_lite", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "gpt_oss")),
    # the Kimi-K2.5 wrapper
    Touchpoint("kimi_k25.wrapper", ("models/kimi_k25.py",), r"self\.language_model\s*=|self\.model\s*=|"
               r"capture_aux_hidden_states|def set_eagle3", "grep", (r"^class KimiK25ForConditionalGeneration\b",),
               "find_text_model: the text model under .language_model"),
    # ServerArgs: its kind, the fields we pass or read, SGLang's resolution
    Touchpoint("ServerArgs.kind", ("server_args.py",), r"^ServerArgs = |^class ServerArgs\b|^@dataclasses\.dataclass",
               "grep",
               uses="versions.server_arg_names: dataclass or msgspec.Struct"),
    *_fields("model_path", "tp_size", "skip_tokenizer_init", "disable_radix_cache", "log_level",
             "cuda_graph_backend_prefill", "chunked_prefill_size", "custom_sigquit_handler", "trust_remote_code",
             "enable_dp_attention", "attn_dp_size", "dp_size", "cuda_graph_config", "disable_cuda_graph"),
    Touchpoint("resolution_result", ("arg_groups/overrides.py",), r"^def resolution_result\(", "block",
               uses="versions.resolved (0.5.19+)"),
    Touchpoint("CudaGraph.Backend", ("model_executor/cuda_graph_config.py",), r"^class Backend\b", "block",
               uses="versions.prefill_cuda_graph: backend names"),
    # the engine: requests, SIGQUIT, shutdown steps we copy
    Touchpoint("Engine.async_generate", ("entrypoints/engine.py",), r"def async_generate\(", "signature",
               (r"^class Engine\b",), "OwnEngine.submit: input_ids, sampling_params, rid"),
    Touchpoint("Engine.sigquit", ("entrypoints/engine.py",), r"custom_sigquit_handler", "grep",
               uses="SGLang installs our SIGQUIT handler"),
    Touchpoint("Engine.shutdown", ("entrypoints/engine.py",),
               r"_subprocess_watchdog|send_to_rpc|_weight_cache_daemon|kill_process_tree|_attached|^\s+return",
               "grep", (r"^class Engine\b", r"    def shutdown\("), "versions.stop_before_kill copies these steps"),
    Touchpoint("watchdog.processes", ("utils/watchdog.py",), r"self\._processes\s*=|self\._names\s*=|def stop\(",
               "grep", uses="versions.watched_children: names and exit codes of the engine's children"),
    Touchpoint("scheduler.error_line", ("managers/scheduler.py",), r"Scheduler hit an exception", "grep",
               uses="the plugin keeps the scheduler's last exception line"),
)


def license_header(text: str) -> list[str]:
    """The file's leading comment lines (SGLang's Apache-2.0 header), kept with its excerpts."""
    out = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        out.append(line)
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block_end(lines: list[str], start: int) -> int:
    """The end (exclusive) of the indented block opened at ``lines[start]`` (past its signature)."""
    i = _statement_end(lines, start)
    base = _indent(lines[start])
    while i < len(lines):
        s = lines[i]
        if s.strip() and not s.lstrip().startswith("#") and _indent(s) <= base:
            break
        i += 1
    while i > start + 1 and not lines[i - 1].strip():
        i -= 1
    return i


def _statement_end(lines: list[str], start: int) -> int:
    depth = 0
    for i in range(start, len(lines)):
        code = re.sub(r"#.*$", "", re.sub(r"(\"[^\"]*\"|'[^']*')", "", lines[i]))
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0:
            return i + 1
    return len(lines)


def _find(lines: list[str], touch: Touchpoint) -> tuple[int, str] | None:
    lo, hi = 0, len(lines)
    for scope in touch.scope:
        rx = re.compile(scope)
        at = next((i for i in range(lo, hi) if rx.search(lines[i])), None)
        if at is None:
            return None
        lo, hi = at, _block_end(lines, at)
    rx = re.compile(touch.pattern)
    if touch.kind == "grep":
        hits = [i for i in range(lo, hi) if rx.search(lines[i])]
        return (hits[0] + 1, "\n".join(f"{i - hits[0]:+d}: {lines[i].strip()}" for i in hits)) if hits else None
    at = next((i for i in range(lo, hi) if rx.search(lines[i])), None)
    if at is None:
        return None
    end = {"line": at + 1, "statement": _statement_end(lines, at), "block": _block_end(lines, at)}.get(touch.kind)
    if touch.kind == "signature":
        end = at
        while end < len(lines) and not re.search(r":\s*(#.*)?$", lines[end]):
            end += 1
        end += 1
    return at + 1, "\n".join(line.rstrip() for line in lines[at:end])


def extract(root: Path, version: str) -> dict:
    """What every touchpoint is in SGLang ``version`` unpacked at ``root`` (``root/sglang/srt/...``):
    ``{"version", "files": {path: {"license": [...]}}, "touchpoints": {id: {"file", "line", "text"} or "absent"}}``."""
    srt = Path(root, "sglang", "srt")
    out: dict = {"version": version, "files": {}, "touchpoints": {}}
    for touch in TOUCHPOINTS:
        found: object = ABSENT
        for pattern in touch.files:
            for path in sorted(srt.glob(pattern)):
                text = path.read_text(encoding="utf-8")
                hit = _find(text.splitlines(), touch)
                if hit is None:
                    continue
                rel = str(path.relative_to(root))
                out["files"].setdefault(rel, {"license": license_header(text)})
                found = {"file": rel, "line": hit[0], "text": hit[1]}
                break
            if found != ABSENT:
                break
        out["touchpoints"][touch.id] = found
    return out


def fingerprint(found: object) -> str:
    """A touchpoint's code with blank lines, trailing spaces and a grep's line offsets (``+12: ``) ignored
    (``absent`` stays itself): code moved within its file is the same code."""
    if found == ABSENT or not isinstance(found, dict):
        return ABSENT
    text = "\n".join(re.sub(r"^[+-]\d+: ", "", line.rstrip()) for line in found["text"].splitlines() if line.strip())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_release(version: str) -> dict:
    return json.loads((RELEASES / f"{version}.json").read_text())


def audit(release: dict, accepted: dict | None = None) -> list[str]:
    """One line per touchpoint of ``release`` (what :func:`extract` gave) whose code the project has not read
    (not among ``accepted``'s variants for it), naming the file and line; empty when every one is known."""
    accepted = json.loads(ACCEPTED.read_text()) if accepted is None else accepted
    problems = []
    for touch in TOUCHPOINTS:
        found = release["touchpoints"].get(touch.id, ABSENT)
        known = accepted.get(touch.id, {})
        fp = fingerprint(found)
        if fp in known:
            continue
        where = f"{found['file']}:{found['line']}" if isinstance(found, dict) else f"sglang/srt/{touch.files[0]}"
        what = "is gone" if fp == ABSENT else f"changed (fingerprint {fp})"
        problems.append(f"SGLang {release['version']}: {where}: touchpoint {touch.id} {what}; hs_dataset uses it for: "
                        f"{touch.uses or touch.id}. Read the change, handle it, and add it to "
                        "tests/sglang_audit/accepted.json with how it is handled")
    return problems
