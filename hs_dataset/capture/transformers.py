"""Reference capture backend: HF transformers, any device (the CPU included).

Samples are batched by a padded-token budget with **right** padding: under the causal mask a
real token never attends to a pad that comes after it, so padding changes no state. (Batched
matrix products can still round differently from one-sample runs; tests/test_build.py states the
tolerance.) The forward hooks keep only the configured layers, never all of them; the hook on the
last decoder layer gives its output before the final norm (layer ``L-1``).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Iterable, Iterator

import torch

from hs_dataset.capture.base import BackendItem
from hs_dataset.codec.teacher import teacher_topk
from hs_dataset.layout import StorageDtype
from hs_dataset.model_info import ModelInfo, target_of
from hs_dataset.prepare.regenerate import Generation, Prompt
from hs_dataset.records import CaptureResult, Reject, TokenizedSample

__all__ = ["TEXT_MODEL_WRAPPERS", "TransformersBackend", "load_language_model"]

# Multimodal wrappers whose text model is a plain causal LM stored under a prefix (read_model_info
# already reads their text_config): model_type -> (transformers config class of text_config, prefix).
TEXT_MODEL_WRAPPERS = {"kimi_k25": ("DeepseekV3Config", "language_model.")}


def load_language_model(model: str, *, trust_remote_code: bool = False):
    """``AutoModelForCausalLM`` in bf16 from a local directory; for a multimodal wrapper (Kimi-K2.5)
    its text model alone, from the same tensors (the vision tower's weights are left out).
    ``trust_remote_code`` allows a model directory's own modeling code."""
    import transformers  # deferred: transformers takes seconds to import
    from transformers import AutoModelForCausalLM  # deferred: transformers takes seconds to import

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    kw: dict = {"dtype": torch.bfloat16, "trust_remote_code": trust_remote_code}
    wrapper = TEXT_MODEL_WRAPPERS.get(cfg.get("model_type", ""))
    if wrapper is not None:
        kw["config"] = getattr(transformers, wrapper[0])(**cfg["text_config"])
        kw["key_mapping"] = {"^" + re.escape(wrapper[1]): ""}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # no load report, no weight-loading bar inside our own progress
    transformers.logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(model, **kw)
    finally:
        transformers.logging.set_verbosity(verbosity)
        with warnings.catch_warnings():  # HF_HUB_DISABLE_PROGRESS_BARS=1: huggingface_hub warns, and keeps them off
            warnings.simplefilter("ignore")
            transformers.logging.enable_progress_bar()


class TransformersBackend:
    """Runs ``AutoModelForCausalLM`` in bf16 and captures the configured layers + final state.

    Args:
        model: local model directory (or its :class:`~hs_dataset.model_info.ModelInfo`, as a build resolved it).
        layers: layer ids (see :mod:`hs_dataset.model_info` for the convention).
        revision: recorded in the dataset metadata (the directory is used as it is).
        device, batch_tokens, max_batch, prefill_chunk, trust_remote_code: the backend's options
            (:class:`~hs_dataset.capture.options.TransformersOptions`, which says what each does).
    """

    name = "transformers"
    continuous = False  # batches by a token budget: a resumed part must be batched as before
    teachers = True  # capture(samples, teacher_k=K): the top-K of lm_head(final), on this backend's device
    encodings: tuple[StorageDtype, ...] = ("bfloat16",)

    def __init__(self, model: str | ModelInfo, layers: Iterable[int], *, revision: str | None = None,
                 device: str | None = None, batch_tokens: int = 8192, max_batch: int = 64,
                 prefill_chunk: int | None = None, trust_remote_code: bool = False):
        self.info, self.layers = target_of(model, layers, revision)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.batch_tokens = int(batch_tokens)
        self.max_batch = int(max_batch)
        self.prefill_chunk = int(prefill_chunk) if prefill_chunk else None
        lm = load_language_model(self.info.path, trust_remote_code=trust_remote_code)
        self._model = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        self._lm = lm.to(self.device).eval()  # the lm_head serves generate() (responses=regenerate) only
        self._caught: dict[int, torch.Tensor] = {}
        decoder_layers = self._model.layers
        self._hooks = [decoder_layers[k].register_forward_hook(self._hook(k)) for k in self.layers]

    def _hook(self, k: int):
        def fn(_module, _inputs, output):
            self._caught[k] = output[0] if isinstance(output, tuple) else output
        return fn

    def versions(self) -> dict[str, str]:
        import transformers  # deferred: transformers takes seconds to import

        return {"transformers": transformers.__version__, "torch": torch.__version__}

    def capture(self, samples: Iterable[TokenizedSample], *, teacher_k: int = 0) -> Iterator[BackendItem]:
        """Results in input order; with ``teacher_k`` each carries the teacher's top-k (:mod:`hs_dataset.codec.teacher`)."""
        for r in self._capture(samples):
            if teacher_k and isinstance(r, CaptureResult):
                r.teacher = self._teacher(r.final, teacher_k)
            yield r

    @torch.inference_mode()
    def _teacher(self, final: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight = self._lm.get_output_embeddings().weight
        ids, lp, lse = teacher_topk(final.to(self.device), weight[:self.info.vocab_size], k)
        return ids.cpu(), lp.cpu(), lse.cpu()

    def _capture(self, samples: Iterable[TokenizedSample]) -> Iterator[BackendItem]:
        batch: list[TokenizedSample] = []
        longest = 0
        for s in samples:
            if s.num_tokens == 0:
                yield Reject(s.sample_id, "input_ids", "no tokens to run", "capture")
                continue
            if self.prefill_chunk is not None and s.num_tokens > self.prefill_chunk:
                if batch:
                    yield from self._run(batch)
                    batch, longest = [], 0
                yield self._run_chunked(s, self.prefill_chunk)
                continue
            longest_if_added = max(longest, s.num_tokens)
            if batch and (longest_if_added * (len(batch) + 1) > self.batch_tokens or len(batch) >= self.max_batch):
                yield from self._run(batch)
                batch, longest_if_added = [], s.num_tokens
            batch.append(s)
            longest = longest_if_added
        if batch:
            yield from self._run(batch)

    @torch.inference_mode()
    def _run(self, batch: list[TokenizedSample]) -> Iterator[CaptureResult]:
        T = max(s.num_tokens for s in batch)
        ids = torch.zeros((len(batch), T), dtype=torch.long)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : s.num_tokens] = torch.from_numpy(s.input_ids)
            mask[i, : s.num_tokens] = 1
        self._caught.clear()
        out = self._model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        per_layer = [self._caught[k] for k in self.layers] + [out.last_hidden_state]
        stacked = torch.stack(per_layer).to("cpu", torch.bfloat16)  # [n+1, B, T, H]
        self._caught.clear()
        for i, s in enumerate(batch):
            yield CaptureResult(sample=s, layers=self.layers, states=stacked[:, i, : s.num_tokens].contiguous())

    @torch.inference_mode()
    def _run_chunked(self, s: TokenizedSample, chunk: int) -> CaptureResult:
        """One long sample, ``chunk`` positions per pass over a KV cache: the states of every position,
        gathered on the CPU (the reference keeps the sample whole; the build then cuts it into rows). The
        cache is allocated once for the whole sample (a growing cache copies itself at every pass: at
        131,072 positions of the Kimi-width stand-in, terabytes of copies)."""
        from transformers import StaticCache  # deferred: transformers takes seconds to import

        T = s.num_tokens
        ids = torch.from_numpy(s.input_ids).to(torch.long).unsqueeze(0)
        states = torch.empty((len(self.layers) + 1, T, self.info.hidden_size), dtype=torch.bfloat16)
        cache = StaticCache(config=self._lm.config, max_cache_len=T)
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            self._caught.clear()
            with warnings.catch_warnings():  # transformers >= 5.2x names it `cache`; the device's 5.12 does not
                warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
                out = self._model(input_ids=ids[:, a:b].to(self.device), past_key_values=cache, use_cache=True,
                                  cache_position=torch.arange(a, b, device=self.device))
            for j, t in enumerate([self._caught[k] for k in self.layers] + [out.last_hidden_state]):
                states[j, a:b] = t[0].to("cpu", torch.bfloat16)
            self._caught.clear()
        return CaptureResult(sample=s, layers=self.layers, states=states)

    @torch.inference_mode()
    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        """Regenerate replies (:mod:`hs_dataset.prepare.regenerate`): HF ``generate``, one prompt at a time (no
        padding, so a reply does not depend on its batch), seeded per prompt."""
        out = []
        for p in prompts:
            o = p.options
            kw: dict = {"max_new_tokens": p.max_new_tokens, "eos_token_id": list(p.stop_ids),
                        "pad_token_id": p.stop_ids[0], "do_sample": o.temperature > 0}
            if o.temperature > 0:
                kw.update(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k if o.top_k > 0 else 0)
                torch.manual_seed(p.seed)
            ids = torch.tensor([p.ids], dtype=torch.long, device=self.device)
            gen = self._lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)[0, len(p.ids):].tolist()
            self._caught.clear()
            finished = bool(gen) and gen[-1] in p.stop_ids
            out.append(Generation(gen[:-1] if finished else gen, finished))
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
