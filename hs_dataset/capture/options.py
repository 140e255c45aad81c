"""The options of each capture backend (a build's ``backend_options``), declared as the build configuration's
fields are: dataclasses whose fields carry their default and one-line help in ``metadata``
(:class:`TransformersOptions`, :class:`SGLangOptions`, and :class:`IsolateOptions` for every backend), so that
``hs-dataset build --help`` and the check of a configuration's ``backend_options`` cost no import of the
backends (torch, SGLang). Each backend's constructor takes these keywords with these defaults
(``tests/capture/test_options.py`` holds them together).

``isolate`` and the options of the child process it starts (:class:`~hs_dataset.capture.isolated.ProcessBackend`:
``timeout``, ``start_timeout``, ``max_inflight``) apply to every backend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hs_dataset.capture.registry import class_path
from hs_dataset.config import _f, did_you_mean
from hs_dataset.errors import ConfigError

__all__ = ["ISOLATE_OPTIONS", "BackendOption", "IsolateOptions", "SGLangOptions", "TransformersOptions",
           "backend_options", "check_backend_options"]

ISOLATE_HELP = "run the backend in a child process: its death or hang stops the build with a clear error"
# The options of the isolation (ProcessBackend) that every backend takes.
ISOLATE_OPTIONS = ("isolate", "timeout", "start_timeout", "max_inflight")


@dataclass(frozen=True)
class TransformersOptions:
    """``backend_options`` of ``backend=transformers`` (:class:`~hs_dataset.capture.transformers.TransformersBackend`)."""

    device: str | None = _f(None, '"cpu", "cuda", ... (default: cuda when available)')
    batch_tokens: int = _f(8192, "padded tokens per forward pass")
    max_batch: int = _f(64, "most samples per forward pass")
    prefill_chunk: int | None = _f(None, "a sample longer than this runs alone, this many positions per forward pass "
                                   "over a KV cache (as an engine's chunked prefill), so that attention's memory stays "
                                   "bounded at long context (default: every sample in one pass)")
    trust_remote_code: bool = _f(False, "allow the model directory's own modeling code (auto_map)")


@dataclass(frozen=True)
class SGLangOptions:
    """``backend_options`` of ``backend=sglang`` (:class:`~hs_dataset.capture.sglang.backend.SGLangBackend`)."""

    tp_size: int = _f(1, "tensor parallel size (in-process engine)")
    sglang_url: str | None = _f(None, "attach to a running patched server instead of starting one (user:password@ "
                                "in it is sent as HTTP basic auth)")
    ring_dir: str | None = _f(None, "in-process: where the private ring folder is made (default /dev/shm); attach: "
                              "the folder named dir in the server's HS_DATASET_CAPTURE (required)")
    ring_bytes: int | None = _f(None, "size of the shared-memory ring: the states in flight at once (default: 8 GiB, "
                                "or half of what the ring's folder has free when that is less)")
    max_inflight: int = _f(32, "requests outstanding at once")
    chunked_prefill_size: int | None = _f(None, "passed to SGLang (None: SGLang's default)")
    request_timeout: float = _f(600.0, "seconds without progress before the build stops with an error")
    prefetch: int = _f(4, "results read from the ring ahead of the consumer")
    engine_args: dict[str, Any] | None = _f(None, "more sglang.Engine arguments (e.g. attention_backend, "
                                            "mem_fraction_static)")
    trust_remote_code: bool = _f(False, "the engine's trust_remote_code (Kimi-K2.5's tokenizer and processor need it), "
                                 "unless engine_args set it")
    allow_untested_sglang: bool = _f(False, "go on with an SGLang outside the audited releases (docs/sglang-releases.md); "
                                     "the start-up self-check still runs")


@dataclass(frozen=True)
class IsolateOptions:
    """The options of ``isolate`` (:class:`~hs_dataset.capture.isolated.ProcessBackend`), for every backend."""

    timeout: float = _f(600.0, "seconds without any word from the child while a result is due before it counts as "
                        "hung (killed, BackendError); must exceed the slowest batch")
    start_timeout: float = _f(3600.0, "seconds allowed for the child to start the backend (load the model)")
    max_inflight: int = _f(64, "samples sent ahead of the results received")


OPTIONS: dict[str, type] = {"transformers": TransformersOptions, "sglang": SGLangOptions}


@dataclass(frozen=True)
class BackendOption:
    """One ``backend_options`` key: its name, default and one-line help."""

    name: str
    default: Any
    help: str


def _options(cls: type, prefix: str = "") -> list[BackendOption]:
    return [BackendOption(f.name, f.default, prefix + f.metadata["help"]) for f in dataclasses.fields(cls)]


def backend_options(name: str) -> list[BackendOption]:
    """The options of backend ``name`` (``transformers`` or ``sglang``), then the isolation options.

    Raises:
        ConfigError: an unknown backend name.
    """
    class_path(name)  # an unknown name: one line naming the closest
    own = _options(OPTIONS[name])
    names = {o.name for o in own}
    iso = [o for o in _options(IsolateOptions, "with isolate: ") if o.name not in names]
    return own + [BackendOption("isolate", False, ISOLATE_HELP)] + iso


def check_backend_options(name: str, options: dict[str, Any]) -> None:
    """Refuse a ``backend_options`` key that backend ``name`` does not take, naming the closest one.

    Raises:
        ConfigError: an unknown backend or option.
    """
    known = [o.name for o in backend_options(name)]
    for key in options:
        if key not in known:
            raise ConfigError(f"backend_options.{key}: the {name} backend has no option {key!r}"
                              f"{did_you_mean(key, known)}; its options: {', '.join(known)}")
