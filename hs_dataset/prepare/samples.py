"""The prepare stage as one generator: source rows -> parsed -> (regenerated) -> tokenized and masked.

One generator feeds both the builder and the capture stream, and ``plan`` reads the source through
it too, so a plan counts exactly what a build writes. It needs no model, only the tokenizer (and,
for ``responses="regenerate"``, the backend that writes the replies). With ``responses="source"``
each row goes through :func:`~hs_dataset.prepare.rows.prepare_row`, in this process or in
:class:`~hs_dataset.prepare.workers.TokenizeWorkers` (the same function on the same tokenizer, results
in row order: the same samples and rejects).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from hs_dataset.config import GenerationOptions, HiddenStatesConfig
from hs_dataset.errors import ConfigError, SampleError
from hs_dataset.prepare.conversations import parse_row
from hs_dataset.prepare.loss_mask import tokenize_sample
from hs_dataset.prepare.regenerate import Generator, messages_json, regenerate_conversations
from hs_dataset.prepare.rows import TokenizeRules, prepare_row
from hs_dataset.prepare.source_spec import Source
from hs_dataset.prepare.sources import read_rows
from hs_dataset.prepare.tags import set_tags, source_tags, tag_dtypes, user_columns
from hs_dataset.prepare.thinking import sample_mode, tokenize_in_mode
from hs_dataset.prepare.workers import TokenizeWorkers
from hs_dataset.records import Conversation, Reject, TokenizedSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["tokenized_samples"]


def tokenized_samples(source: Source, config: HiddenStatesConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                      ranges: list[tuple[int, int | None]], on_reject: Callable[[int, Reject], None], *,
                      generator: object | None = None,
                      workers: TokenizeWorkers | None = None) -> Iterator[tuple[int, TokenizedSample]]:
    """Read, parse, (regenerate,) then tokenize and mask the source rows of ``ranges``: ``(row index, sample)``.

    Args:
        source: the build's source, resolved once (:func:`~hs_dataset.prepare.source_spec.resolve_source`); its
            rows of all ``ranges`` are read in one pass (:func:`~hs_dataset.prepare.sources.read_rows`).
        config: the build's configuration (sample ids, max_length, mask, truncation, responses).
        tokenizer: the target's tokenizer, loaded once (:func:`hs_dataset.prepare.tokenizer.load_tokenizer`).
        vocab_size: token ids at or above it are rejects (the smaller of the tokenizer's and the model's
            embedding rows).
        ranges: ``(start, stop)`` source rows (``stop`` None: to the end).
        on_reject: gets ``(row index, reject)`` for a row that cannot be used (stage ``source``,
            ``regenerate`` or ``tokenize``).
        generator: with ``responses="regenerate"``, what writes the replies (the capture backend); each
            range's conversations are regenerated together (:mod:`hs_dataset.prepare.regenerate`).
        workers: with ``responses="source"``, worker processes that run :func:`~hs_dataset.prepare.rows.prepare_row` (started with
            this tokenizer's directory); None: this process does. The samples, rejects and their order
            are the same.

    Raises:
        ConfigError: ``responses="regenerate"`` without a generator that can generate.
    """
    cfg = config
    vocab = vocab_size
    if cfg.responses == "source":
        rules = TokenizeRules.of(cfg, vocab, source.name)
        rows = read_rows(source, ranges, sample_id=cfg.sample_id)
        results = workers.prepare(rows, rules) if workers is not None else (
            (row.index, prepare_row(row, tokenizer, rules)) for row in rows)
        for index, result in results:
            if isinstance(result, Reject):
                on_reject(index, result)
            else:
                yield index, result
        return

    gen = GenerationOptions.from_config(cfg.generation)
    tagged = bool(tag_dtypes(cfg.to_dict()))
    name, columns = (source.name, user_columns(cfg.tag_columns)) if cfg.tags else ("", [])
    row_tags: dict[int, dict] = {}

    def tokenized(index: int, sample_id: str, parsed: Conversation | TokenizedSample, stage: str):
        mode = sample_mode(gen, sample_id)
        try:
            if gen.thinking_set and isinstance(parsed, Conversation):  # the last reply as generated
                sample = tokenize_in_mode(parsed, tokenizer, gen, max_length=cfg.max_length, mask=cfg.mask,
                                          truncation=cfg.truncation, vocab_size=vocab)
            else:
                sample = tokenize_sample(parsed, tokenizer, max_length=cfg.max_length, mask=cfg.mask,
                                         truncation=cfg.truncation, vocab_size=vocab)
        except SampleError as e:
            on_reject(index, Reject(sample_id, e.field, e.reason, stage))
            return None
        sample.messages = messages_json(parsed)  # type: ignore[arg-type]
        if tagged:
            set_tags(sample, row_tags.pop(index, {}), mode)
        return sample

    for start, stop in ranges:  # one range at a time: its conversations are regenerated together
        parsed_rows: list[tuple[int, str, Conversation]] = []
        for row in read_rows(source, [(start, stop)], sample_id=cfg.sample_id):
            if cfg.tags:
                row_tags[row.index] = source_tags(row, name, None, columns)
            try:
                parsed = parse_row(row)
            except SampleError as e:
                on_reject(row.index, Reject(row.sample_id, e.field, e.reason, "source"))
                continue
            if not isinstance(parsed, Conversation):
                on_reject(row.index, Reject(row.sample_id, "input_ids", "already tokenized rows have no replies to "
                                            "regenerate (responses=regenerate needs conversations)", "regenerate"))
            else:
                parsed_rows.append((row.index, row.sample_id, parsed))
                if cfg.tags:
                    row_tags[row.index]["tag_turns"] = sum(m.role == "assistant" for m in parsed.messages)
        if parsed_rows:
            yield from _regenerated(parsed_rows, tokenizer, generator, cfg, on_reject, tokenized)
        row_tags.clear()  # the tags of this range's rejects


def _regenerated(rows: list[tuple[int, str, Conversation]], tokenizer: PreTrainedTokenizerBase,
                 generator: object | None, cfg: HiddenStatesConfig, on_reject: Callable[[int, Reject], None],
                 tokenized: Callable[..., TokenizedSample | None]) -> Iterator[tuple[int, TokenizedSample]]:
    if not isinstance(generator, Generator):
        name = getattr(generator, "name", "capture")
        raise ConfigError(f"responses=regenerate: the {name} backend cannot generate (use the transformers "
                          "or sglang backend, without isolate)")
    options = GenerationOptions.from_config(cfg.generation)
    convs = regenerate_conversations([c for _, _, c in rows], tokenizer, generator, options, cfg.max_length)
    for (index, sample_id, _), conv in zip(rows, convs):
        if isinstance(conv, SampleError):
            on_reject(index, Reject(sample_id, conv.field, conv.reason, "regenerate"))
            continue
        sample = tokenized(index, sample_id, conv, "tokenize")
        if sample is not None:
            yield index, sample
