"""The card's quality section: the build's statistics (``hs_dataset.json``'s ``statistics``), its
duplicates and the last probe (``probe``), rendered from ``hs_dataset.json`` alone, so that
:func:`hs_dataset.integrity.metadata.check_metadata` can require the card to hold exactly
:func:`quality_section` of it."""

from __future__ import annotations

from typing import Any

__all__ = ["QUALITY_HEADING", "quality_section"]

QUALITY_HEADING = "## Quality"


def _num(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return "n/a"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{float(x):.4g}"


def _statistics(st: dict[str, Any], dtype: str) -> list[str]:
    rows = ["| column | mean | std | absmax | NaN | Inf | at the fp8 limit |", "|---|---|---|---|---|---|---|"]
    for c, s in (st.get("columns") or {}).items():
        rows.append(f"| `{c}` | {_num(s.get('mean'))} | {_num(s.get('std'))} | {_num(s.get('absmax'))} | "
                    f"{_num(s.get('nan'))} | {_num(s.get('inf'))} | {_num(s.get('fp8_limit'))} "
                    f"({float(s.get('fp8_limit_share') or 0):.2%}) |")
    lengths = st.get("lengths") or {}
    width, counts = int(lengths.get("bin") or 1), list(lengths.get("counts") or [])
    hist = ["| tokens | samples |", "|---|---|"] + [
        f"| {i * width + 1:,}-{(i + 1) * width:,} | {c:,} |" for i, c in enumerate(counts) if c]
    flags = st.get("flags") or []
    flagged = (["Rows flagged (NaN/Inf values, saturated fp8):", ""] +
               [f"- row {f.get('row')} (`{f.get('id')}`): `{f.get('column')}` holds {f.get('what')}" for f in flags]
               + ([f"- ... {int(st.get('flagged', 0)) - len(flags)} more"] if int(st.get("flagged", 0)) > len(flags)
                  else [])) if flags else ["Rows flagged (NaN/Inf values, saturated fp8): none."]
    return [f"Every stored value ({dtype}) counted while the build wrote it (`hs_dataset.json`, `statistics`; "
            "`hs-dataset verify DIR --stats` recounts them from the shards):", "", *rows, "",
            f"At the fp8 limit: {st.get('fp8_limit', '')}.", "",
            f"{_num(st.get('rows'))} samples, {_num(st.get('tokens'))} tokens ({_num(lengths.get('min'))} to "
            f"{_num(lengths.get('max'))} per sample); loss mask on {float(st.get('mask_fraction') or 0):.1%} of them "
            f"({_num(st.get('masked_tokens'))}).", "", "<details><summary>Lengths</summary>", "", *hist, "",
            "</details>", "", *flagged]


def _duplicates(d: dict[str, Any]) -> list[str]:
    policy = d.get("policy", "keep")
    skipped = int(d.get("skipped") or 0)
    if not d.get("same_ids") and not skipped:
        return ["Duplicate prompts: none (no sample repeats an earlier sample's token ids)."]
    what = "kept, captured again (`duplicates=keep`)" if policy == "keep" else \
        f"the exact ones skipped (`duplicates=skip`): {skipped:,} rejects of stage `{d.get('skip_stage')}`"
    lines = [f"Duplicate prompts: {_num(d.get('same_ids'))} written samples repeat an earlier sample's token ids "
             f"({_num(d.get('same_ids_and_mask'))} with its loss mask too: identical rows; {_num(d.get('tokens'))} "
             f"tokens); {what}.", ""]
    lines += [f"- row {r.get('row')} (`{r.get('id')}`) repeats row {r.get('first_row')} (`{r.get('first_id')}`)"
              + ("" if r.get("same_mask") else ", another loss mask") for r in d.get("rows") or []]
    return lines


def _probe(p: dict[str, Any] | None) -> list[str]:
    if not p:
        return ["Probe: not run. `hs-dataset verify DIR --probe 64` re-runs 64 random rows through the reference "
                "backend and compares every stored state, token and mask; its result is recorded here."]
    th = p.get("thresholds") or {}
    head = (f"Probe ({p.get('at')}, hs_dataset {p.get('hs_dataset')}): {_num(p.get('rows'))} random rows (seed "
            f"{p.get('seed')}) re-run through {p.get('backend')} on {p.get('device')} in {float(p.get('seconds') or 0):.1f}s "
            f"and compared ({p.get('storage_dtype')}: mean cosine >= {th.get('mean_cos')}, relative error <= "
            f"{th.get('rel_err')}, every token's cosine >= {th.get('token_cos')}); {p.get('tokens_checked')}.")
    worst = p.get("worst") or {}
    table = ["| column | lowest mean cosine | highest relative error |", "|---|---|---|"] + [
        f"| `{c}` | {float(w['mean_cos']):.5f} | {float(w['rel_err']):.2%} |" for c, w in worst.items()]
    if p.get("ok"):
        return [head + " **Every row matches.**", "", *table]
    failed = [f"- row {f.get('row')} (`{f.get('id')}`): " + "; ".join(f.get("problems") or []) for f in p.get("failed") or []]
    return [head + f" **{len(failed)} rows do not match:**", "", *failed, "", *table]


def quality_section(metadata: dict[str, Any]) -> str:
    """The card's quality section for a build's ``hs_dataset.json`` (its statistics, duplicates, probe)."""
    st = metadata.get("statistics")
    body = ["n/a: this build records no statistics (built by an hs_dataset without them)."] if not st else \
        _statistics(st, str(metadata.get("storage_dtype") or "bfloat16")) + ["", *_duplicates(st.get("duplicates") or {})]
    return "\n".join([QUALITY_HEADING, "", *body, "", *_probe(metadata.get("probe"))])
