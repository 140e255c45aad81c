"""The build's content key and the model it was made from, checked in one place.

A build records its content key (:attr:`hs_dataset.write.resolve.ResolvedBuild.key`: what decides its rows, the
source's and the weights' fingerprints) in ``.hs_build/build.json`` before it writes anything else
(:func:`begin_build`); a rerun, a worker share and a merge of another key are refused (:func:`check_resume`). The
model is checked three times, always against that record: its weights' fingerprint when the build is resolved
(in the key), its probe states once the backend runs (:func:`check_probe`), its weights again before each part is
committed (:func:`check_weights`): weights changed while a build runs stop it, the parts before are kept.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hs_dataset.atomic import atomic_write
from hs_dataset.capture.fingerprint import describe, same_probe
from hs_dataset.errors import ConfigMismatchError
from hs_dataset.layout import SHARE_FILE
from hs_dataset.model_info import weights_fingerprint
from hs_dataset.redact import record_redacted, redact_text
from hs_dataset.write.resolve import ResolvedBuild
from hs_dataset.write.resume import recorded_rows
from hs_dataset.write.shares import WorkerShare, share_record

__all__ = ["COMMAND_DIR_FILE", "FINGERPRINT_FIELDS", "RESUMABLE_CHANGES", "begin_build", "check_probe", "check_resume",
           "check_weights"]

logger = logging.getLogger(__name__)

# Content fields that may still change on resume, (from, to): rows already written stay right.
# on_nonfinite fail -> reject: a part written under "fail" holds no non-finite state (it would have
# stopped the build), so it is what "reject" would have written.
RESUMABLE_CHANGES: dict[str, set[tuple[Any, Any]]] = {"on_nonfinite": {("fail", "reject")}}

# The model's fingerprint (hs_dataset.capture.fingerprint): recorded when a build first knows it (builds made before
# it existed, and the probe, known once the backend runs), compared whenever both sides have it.
FINGERPRINT_FIELDS = ("model_weights", "model_probe")

# In STATE_DIR: the folder the build command ran in, so that the repair command verify prints runs from anywhere.
COMMAND_DIR_FILE = "command_dir.json"


def _resumed_key(state: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """``key`` checked against ``state/build.json`` (:func:`check_resume`) -> what to record there (None: as it is)."""
    path = state / "build.json"
    if not path.exists():
        return key
    old = json.loads(path.read_text())
    weights = [old.get("model_weights"), key.get("model_weights")]
    probes = [old.get("model_probe"), key.get("model_probe")]
    if not ((None in weights or weights[0] == weights[1]) and (None in probes or same_probe(probes[0], probes[1]))):
        raise ConfigMismatchError(
            f"{state.parent} holds rows of another model: fingerprint {describe(old)} there, {describe(key)} now "
            f"(the weights in {key.get('model', old.get('model'))} changed?). Refusing to mix two models in one "
            "build: use a new --output directory, or delete this one to start over.")
    key = {**{k: old[k] for k in FINGERPRINT_FIELDS if k in old}, **key}
    if key.get("model_probe") and old.get("model_probe"):
        key["model_probe"] = old["model_probe"]  # the same (checked above): the first one stays the reference
    diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
    changed = [k for k in diff if k not in FINGERPRINT_FIELDS]
    if any((old.get(k), key.get(k)) not in RESUMABLE_CHANGES.get(k, ()) for k in changed):
        details = redact_text("; ".join(f"{k}: {old.get(k)!r} -> {key.get(k)!r}" for k in diff))[0]
        raise ConfigMismatchError(
            f"{state.parent} holds a build made with another configuration ({details}). Refusing to mix "
            "rows: use a new --output directory, or delete this one to start over.")
    if changed:
        logger.warning("hs_dataset: resuming %s with %s", state.parent,
                       ", ".join(f"{k} {old.get(k)!r} -> {key.get(k)!r}" for k in changed))
    return key if diff else None


def check_resume(state: Path, key: dict[str, Any]) -> None:
    """Record ``key`` in ``state/build.json``, or refuse when the key recorded there differs from it, except for
    the changes in :data:`RESUMABLE_CHANGES` (recorded and allowed). The model's fingerprint
    (:data:`FINGERPRINT_FIELDS`) missing on one side is recorded; on both sides it must match (the probe's states
    to bf16 rounding: :func:`hs_dataset.capture.fingerprint.same_probe`).

    Raises:
        ConfigMismatchError: another configuration, or another model's fingerprint (naming both); nothing is written.
    """
    record = _resumed_key(state, key)
    if record is not None:
        atomic_write(state / "build.json", json.dumps(record, indent=1, sort_keys=True))


def begin_build(out: Path, state: Path, resolved: ResolvedBuild, share: WorkerShare | None,
                allow_shrink: bool) -> list[tuple[int, int, int]]:
    """Check the output's state against this build (the share it holds, the key recorded, the rows it holds beyond
    this build's, which :func:`~hs_dataset.write.resume.recover` would delete), then record the build: the key, the
    salted digests of the values redacted (push scans its uploads for them), the folder a command ran in (verify's
    repair command runs it there), the share. Nothing is written before everything is checked. -> this run's parts.

    Raises:
        ConfigMismatchError: another share, configuration or model; more rows without ``allow_shrink``.
    """
    assert resolved.key is not None, "resolved for a build (resolve_build(state=...))"
    parts, record = share_record(state, share, resolved) if share is not None else (resolved.parts, None)
    key = _resumed_key(state, resolved.key)
    held = recorded_rows(state)
    if held > resolved.rows and not allow_shrink:
        raise ConfigMismatchError(
            f"{out} holds {held} source rows, this build {resolved.rows} (max_samples lowered?): refusing to delete "
            f"the rows beyond {resolved.rows}. Raise max_samples back, use a new --output, or pass --allow-shrink to "
            "delete them.")
    record_redacted(state, resolved.secrets)
    if key is not None:
        atomic_write(state / "build.json", json.dumps(key, indent=1, sort_keys=True))
    if resolved.build_command is not None:
        atomic_write(state / COMMAND_DIR_FILE, json.dumps({"cwd": os.getcwd()}))
    if record is not None:
        atomic_write(state / SHARE_FILE, json.dumps(record, indent=1))
    return parts


def check_probe(state: Path, resolved: ResolvedBuild, probe: dict[str, Any] | None) -> None:
    """Check the probe states captured through the build's backend (None: it captures no arbitrary sample) against
    the recorded ones (:func:`check_resume`), or record them.

    Raises:
        ConfigMismatchError: the recorded probe came from other weights.
    """
    if probe is not None:
        check_resume(state, dict(resolved.key or {}, model_probe=probe))


def check_weights(resolved: ResolvedBuild, part: int) -> None:
    """Stop before part ``part`` is committed when the model's weight files changed since the build was resolved.

    Raises:
        ConfigMismatchError: they did (the parts before ``part`` are kept).
    """
    model = resolved.info.path
    recorded = (resolved.key or {}).get("model_weights")
    now = weights_fingerprint(model)
    if now != recorded:
        raise ConfigMismatchError(
            f"the weights in {model} changed while the build ran (fingerprint {recorded} at the start, {now} now): "
            f"part {part} is discarded, the parts before it are kept. Put the model back and run the same command "
            "again, or build the new model into a new --output directory")
