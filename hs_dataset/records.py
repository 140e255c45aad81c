"""Records passed between the pipeline stages.

prepare (source -> conversation -> tokens + mask) -> capture -> codec -> build -> hub -> read

Every stage takes and returns these small dataclasses, so that each stage can be tested alone.
A stage that cannot handle one sample raises :class:`~hs_dataset.errors.SampleError`; the builder turns it into a
:class:`Reject` (sample id, field, reason) and goes on, so that samples in = written + rejected.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the plugin-free stages and the command line import this module
    import numpy as np
    import torch

__all__ = ["CaptureResult", "Conversation", "Counts", "Message", "Reject", "SourceRow", "TokenizedSample"]

@dataclass(frozen=True)
class Message:
    """One chat turn, normalised: role is ``system``, ``user`` or ``assistant``.

    ``reasoning_content``: an assistant turn's thinking, given to the chat template under that key
    (the template decides whether it is rendered).
    """

    role: str
    content: str
    reasoning_content: str | None = None

    def as_chat(self) -> dict[str, str]:
        """The message as a chat template sees it (``reasoning_content`` only when present)."""
        chat = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            chat["reasoning_content"] = self.reasoning_content
        return chat


@dataclass
class SourceRow:
    """One raw row read from a source, before any validation.

    ``sample_id`` is stable across runs: ``<source name>:<row index>`` or a content hash.
    """

    sample_id: str
    index: int
    data: Any


@dataclass
class Conversation:
    """A validated conversation (system prompt optional, at least one assistant turn)."""

    sample_id: str
    messages: list[Message]


@dataclass
class TokenizedSample:
    """Token ids and the loss mask (1 = assistant reply token the drafter is trained on)."""

    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool = False
    messages: str | None = None  # regenerate builds: the conversation the tokens render (JSON text)
    tags: dict[str, Any] | None = None  # builds with tag columns: tag_<name> -> value (hs_dataset.prepare.tags)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class CaptureResult:
    """Hidden states of one sample as the backend produced them (CPU tensors).

    ``states`` is ``[len(layers) + 1, T, H]``: the configured layers in the order of ``layers``,
    then the final post-norm state (``[len(layers), T, H]``, without it, from a backend asked for no final
    state: :func:`hs_dataset.capture.base.start_capture`). See :mod:`hs_dataset.model_info` for the layer index
    convention. They are ``torch.bfloat16``, or, when ``scales`` is given, float8 e4m3 bits
    (``torch.uint8``) with per-token float32 ``scales [len(layers) + 1, T]`` (:mod:`hs_dataset.codec.fp8`;
    the SGLang plugin quantizes on the GPU). The tensors may view a backend's transport memory
    (the SGLang ring): it is reused once nothing references them.

    A sample larger than the backend's transport arrives as several *pieces*, in order: each covers
    positions ``[token_start, token_start + states.shape[1])`` (:attr:`last` on the final one).
    """

    sample: TokenizedSample
    layers: tuple[int, ...]
    states: torch.Tensor
    # Per state, how many positions hold NaN/Inf, when the backend already counted them (the SGLang
    # plugin does it on the GPU); None: the encode stage checks on the CPU.
    nonfinite: tuple[int, ...] | None = None
    scales: torch.Tensor | None = None
    token_start: int = 0
    # The statistics of the whole sample's stored values, float64 [len(layers) + 1, 5]
    # (hs_dataset.codec.state_stats.FIELDS), when the backend counted them where it made the states (the SGLang
    # plugin, on the GPU): on the sample's last piece (and its last row), zeros on the others. None: the build
    # counts them on its host (hs_dataset.integrity.stats).
    value_stats: torch.Tensor | None = None
    # The teacher's top-k at every position (hs_dataset.codec.teacher): ids int32 [T, k], log-probs float32
    # [T, k], logsumexp float32 [T]; None unless the build asked for it.
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_positions(self) -> int:
        """Positions this result (piece) covers."""
        return int(self.states.shape[1])

    @property
    def last(self) -> bool:
        """Whether this result ends its sample (always, unless the sample came in pieces)."""
        return self.token_start + self.num_positions >= self.sample.num_tokens

    @property
    def encoding(self) -> str:
        return "bfloat16" if self.scales is None else "fp8_e4m3"

    def layer(self, k: int) -> torch.Tensor:
        return self.states[self.layers.index(k)]

    @property
    def final(self) -> torch.Tensor:
        return self.states[-1]


@dataclass
class Reject:
    """A sample that was not written, and why."""

    sample_id: str
    field: str
    reason: str
    stage: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class Counts:
    """Samples in = written + rejected, per build (or per part of a build)."""

    samples_in: int = 0
    written: int = 0
    rejected: int = 0
    tokens_written: int = 0
    rejects_by_stage: dict[str, int] = field(default_factory=dict)
    rows_written: int = 0  # dataset rows: written, unless long samples span several rows (see row_tokens)

    def add(self, other: "Counts") -> None:
        self.samples_in += other.samples_in
        self.written += other.written
        self.rejected += other.rejected
        self.tokens_written += other.tokens_written
        self.rows_written += other.rows_written
        for k, v in other.rejects_by_stage.items():
            self.rejects_by_stage[k] = self.rejects_by_stage.get(k, 0) + v

    @staticmethod
    def rows_of(counts: dict[str, Any]) -> int:
        """The dataset rows a recorded ``Counts`` dict stands for (records older than long rows: ``written``)."""
        return int(counts.get("rows_written") or counts.get("written", 0))

    def check(self) -> None:
        if self.samples_in != self.written + self.rejected:
            raise RuntimeError(
                f"sample accounting broken: {self.samples_in} in != {self.written} written + "
                f"{self.rejected} rejected; this is a bug in hs_dataset, please report it"
            )
