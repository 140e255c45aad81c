"""The errors hs_dataset raises, in one catalogue.

Every error a user can act on derives from :class:`HsDatasetError`; its message says what is wrong
and what to do, and ``hs-dataset`` prints it as one line (exit 2; ``--debug`` shows the traceback).
Each also derives from the standard exception it refines (``ValueError``, ``OSError``,
``RuntimeError``), so ``except ValueError`` and the like keep working. :class:`SampleError` is not
among them: it is one bad sample, which the build rejects (``rejects.jsonl``) and goes on.

Imports nothing: the SGLang plugin's modules use it in the scheduler process.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BackendError", "BuildInterrupted", "BuildLockedError", "ConfigError", "ConfigMismatchError", "EmptyBuildError",
    "ForeignFilesError", "HsDatasetError", "HubAccessError", "IntegrityError", "InteropError", "MissingPathError",
    "NonFiniteError",
    "NotABuildError", "OutputWriteError", "PublishError", "RejectRateError", "RepoIdError", "RequestError", "SampleError",
    "SecretLeakError", "ShareError", "StreamError", "TokenizeWorkerError", "TransportError", "VersionExistsError",
    "VersionNameError",
]


class HsDatasetError(Exception):
    """An error the user can fix; the message names the fix."""


class SampleError(ValueError):
    """One sample cannot be used. ``field`` names the offending field (e.g. ``conversations[2].value``).

    Raised by a stage for one sample; the builder turns it into a reject and goes on.
    """

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# -- configuration and the output directory ---------------------------------------------------------
class ConfigError(HsDatasetError, ValueError):
    """A build configuration (a builder script, ``--set``) is invalid: unknown field, bad value, missing file.

    ``field`` names the configuration field (``max_length``, ``backend_options.tp_size``...) and ``value``
    the value refused, where one field is at fault (else None).

    Example::

        >>> HiddenStatesConfig(model="m", source="s", max_length=0)
        ConfigError: max_length=0: must be >= 1 (--set max_length=...)   # e.field == "max_length", e.value == 0
    """

    def __init__(self, message: str, *, field: str | None = None, value: Any = None):
        super().__init__(message)
        self.field = field
        self.value = value


class MissingPathError(ConfigError, FileNotFoundError):
    """A file or directory the configuration names does not exist (model, source, builder script...);
    ``path`` is that path, where known."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None):
        super().__init__(message, field=field, value=path)
        self.path = path


class ConfigMismatchError(HsDatasetError, RuntimeError):
    """The output directory holds a build made with a different configuration."""


class BuildLockedError(HsDatasetError, RuntimeError):
    """Another build is writing the same output directory."""


class ForeignFilesError(HsDatasetError, RuntimeError):
    """The output directory holds files hs_dataset did not write (it is not empty and not a build, its
    ``data/`` holds other files or links, or the source lies inside it): nothing was touched. ``path``
    is the folder or file at fault."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class ShareError(HsDatasetError, RuntimeError):
    """The worker shares of a build made by many workers cannot be merged (one missing, unfinished, given
    twice, built with another configuration or plan, or holding damaged files), or a worker failed
    for good; the message names the share and what to do (:mod:`hs_dataset.scale`)."""


class IntegrityError(HsDatasetError, RuntimeError):
    """A build's files differ from what its metadata records: a shard missing, changed (its content
    hash differs), truncated, holding other rows, or not listed at all. The message names each shard
    and the part to rebuild; ``problems`` lists them (:class:`hs_dataset.integrity.verify.Problem`)."""

    def __init__(self, message: str, problems: list | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


class EmptyBuildError(HsDatasetError, RuntimeError):
    """Every sample of a build was rejected: nothing to load or train on (``rejects.jsonl`` says why).
    The build is not marked finished (no ``hs_dataset.json``)."""


class RejectRateError(HsDatasetError, RuntimeError):
    """A build rejected more of its samples than the allowed rate (``hs-dataset build --max-reject-rate``)."""


class BuildInterrupted(KeyboardInterrupt):
    """Ctrl-C during a build: ``parts_done`` of ``parts_total`` parts are committed; the same command resumes."""

    def __init__(self, parts_done: int, parts_total: int):
        super().__init__(f"interrupted after {parts_done} of {parts_total} parts")
        self.parts_done = parts_done
        self.parts_total = parts_total


class OutputWriteError(HsDatasetError, OSError):
    """The output could not be written: disk full, over quota, read-only, not a directory...

    ``errno`` is the underlying error number; the message names the path and what to do.
    Nothing half-written is kept; rerunning the same command resumes.
    """

    def __init__(self, code: int, message: str, path: str | None = None):
        super().__init__(code, message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return self.message


# -- prepare ------------------------------------------------------------------------------------------
class TokenizeWorkerError(HsDatasetError, RuntimeError):
    """A tokenize worker process died (:mod:`hs_dataset.prepare.workers`); a rerun resumes the build."""


# -- capture ------------------------------------------------------------------------------------------
class BackendError(HsDatasetError, RuntimeError):
    """The capture backend as a whole failed (engine died, hangs, cannot start); the build stops and resumes."""


class NonFiniteError(BackendError):
    """NaN or Inf in a captured state with ``on_nonfinite="fail"``."""


class TransportError(HsDatasetError, RuntimeError):
    """The shared-memory ring as a whole failed (no space, the other side died, a corrupt ring)."""


class RequestError(TransportError):
    """One request cannot be captured (e.g. a radix-cache hit); its sample is rejected with this reason."""


class StreamError(HsDatasetError, RuntimeError):
    """A trainer's stream of a build cannot go on (no build came within its timeout, a resume state of
    another deal, DataLoader workers)."""


# -- publishing and interop ---------------------------------------------------------------------------
class PublishError(HsDatasetError, RuntimeError):
    """The push cannot proceed (bad local build, repository state, verification failure...)."""


class NotABuildError(PublishError):
    """The local directory is not a finished build."""


class VersionExistsError(PublishError):
    """The version tag already exists and ``force`` was not given."""


class VersionNameError(PublishError, ValueError):
    """The version name is or shadows a git ref on the Hub, or git refuses it; the message names the rule.
    ``version`` is the name refused."""

    def __init__(self, message: str, *, version: str | None = None):
        super().__init__(message)
        self.version = version


class RepoIdError(PublishError, ValueError):
    """A dataset repo id the Hub cannot have (``org/name``: letters, digits, ``-``, ``_``, ``.``); ``repo_id``."""

    def __init__(self, message: str, *, repo_id: str = ""):
        super().__init__(message)
        self.repo_id = repo_id


class SecretLeakError(PublishError):
    """A file about to be uploaded holds a credential (the HF token, or a value the build redacted)."""


class HubAccessError(PublishError):
    """The Hub cannot be used: no token, an endpoint that cannot be reached, a token it refuses (401/403)..."""


class InteropError(HsDatasetError, ValueError):
    """A foreign layout is not as expected, or does not match the model / layers given."""
