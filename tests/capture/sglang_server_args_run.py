"""Run by tests/capture/test_sglang_versions.py in a child process whose path holds one unpacked SGLang release:
the in-process engine's configuration code and versions.py's accessors against that release's real ``ServerArgs``.
Prints one JSON object of what it saw."""

from __future__ import annotations

import json
import pickle
import sys

from hs_dataset.capture.sglang import versions as V
from hs_dataset.capture.sglang.engine import on_sigquit, sglang_engine_args
from hs_dataset.errors import BackendError


def main(model: str) -> dict:
    import sglang
    from sglang.srt.server_args import ServerArgs

    out: dict = {"version": sglang.__version__, "kind": type(ServerArgs).__name__,
                 "check": V.check_sglang_version(), "fields": len(V.server_arg_names(ServerArgs))}
    args = sglang_engine_args(model, tp_size=1, chunked_prefill_size=64, extra={"attention_backend": "triton"})
    sa = ServerArgs(**args)  # SGLang's own validation of every argument we pass
    out["engine_args"] = sorted(args)
    out["passed"] = {"cuda_graph_backend_prefill": sa.cuda_graph_backend_prefill,
                     "sigquit": sa.custom_sigquit_handler is on_sigquit, "chunked": sa.chunked_prefill_size,
                     "radix_off": sa.disable_radix_cache}
    try:
        sglang_engine_args(model, extra={"no_such_setting": 1})
    except BackendError as e:
        out["unknown"] = str(e)
    raw = {"dp_new": V.dp_attention_size(ServerArgs(model_path=model, tp_size=2, attn_dp_size=2))
           if "attn_dp_size" in V.server_arg_names(ServerArgs) else None,
           "dp_old": V.dp_attention_size(ServerArgs(model_path=model, tp_size=2, dp_size=2, enable_dp_attention=True)),
           "dp_off": V.dp_attention_size(ServerArgs(model_path=model)),
           "prefill": V.prefill_cuda_graph(ServerArgs(model_path=model, cuda_graph_backend_prefill="breakable")),
           "prefill_off": V.prefill_cuda_graph(ServerArgs(model_path=model, cuda_graph_backend_prefill="disabled")),
           "chunked": V.chunked_prefill_size(ServerArgs(model_path=model, chunked_prefill_size=512))}
    out["raw"] = raw
    try:  # 0.5.19+: what SGLang's resolution declares, the fields keeping the caller's None
        from sglang.srt.arg_groups.overrides import declare_resolution
        from sglang.srt.model_executor.cuda_graph_config import Backend, default_cuda_graph_config
    except ImportError:
        return out
    rec = ServerArgs(model_path=model)
    cfg = default_cuda_graph_config()
    cfg.prefill.backend = Backend.BREAKABLE  # what the pipeline declares on CUDA when prefill graphs are on
    declared = {"chunked_prefill_size": 8192, "cuda_graph_config": cfg}
    if "attn_dp_size" in V.server_arg_names(ServerArgs):
        declared["attn_dp_size"] = 4
    else:
        declared.update(enable_dp_attention=True, dp_size=4)
    declare_resolution(rec, "hs_dataset test", **declared)
    rec = pickle.loads(pickle.dumps(rec))  # as the scheduler process receives it
    out["declared"] = {"fields": [rec.chunked_prefill_size, rec.cuda_graph_config],
                       "chunked": V.chunked_prefill_size(rec), "prefill": V.prefill_cuda_graph(rec),
                       "dp": V.dp_attention_size(rec)}
    from hs_dataset.capture.sglang.plugin import _check_engine

    try:
        _check_engine(type("Runner", (), {"server_args": rec})())
    except RuntimeError as e:
        out["refused"] = str(e)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), default=str))
