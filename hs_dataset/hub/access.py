"""Can the Hub be used, and what a failed Hub request means, in one line with the fix.

:func:`check_hub` runs before any work of ``push`` / ``versions`` / ``verify REPO`` (a push hashes
the whole build first): a missing token, an endpoint that cannot be reached and a token the Hub
refuses are each one :class:`~hs_dataset.errors.HubAccessError`. :func:`hub_error` is the one place that
turns what ``huggingface_hub`` raises (401, 403, 404, 5xx, a dropped connection, a malformed repo id) into
that error, as ``huggingface_hub``'s own ``utils/_http.py`` turns HTTP answers into its errors; every
public function of :mod:`hs_dataset.hub` (``push_dataset``, ``list_versions``, ``download_version``,
``verify_repo``) and :func:`~hs_dataset.read.open_dataset` raise it (:func:`hub_call`,
:func:`hub_errors`); the command line only prints it. The token is never part of a message.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, TypeVar

import huggingface_hub.constants as hconst
from huggingface_hub import HfApi, get_token
from huggingface_hub import errors as herr
from huggingface_hub.utils import get_session

from hs_dataset.errors import HubAccessError

__all__ = ["check_hub", "endpoint_of", "hub_call", "hub_error", "hub_errors", "require_token"]

LOGIN = "set HF_TOKEN or run `hf auth login`"


def endpoint_of(endpoint: str | None = None) -> str:
    """The Hub endpoint used: ``endpoint``, else ``HF_ENDPOINT``, else huggingface.co."""

    return (endpoint or hconst.ENDPOINT).rstrip("/")


def hub_error(e: BaseException, endpoint: str | None = None, repo_id: str | None = None) -> HubAccessError | None:
    """The one-line :class:`HubAccessError` for an error of a Hub request (None: not one)."""

    ep = endpoint_of(endpoint)
    what = f"{repo_id} on {ep}" if repo_id else ep
    if isinstance(e, herr.HfHubHTTPError):
        status = e.response.status_code if e.response is not None else None
        server = (getattr(e, "server_message", None) or "").strip().replace("\n", " ")[:200]
        said = f" ({server})" if server else ""
        if isinstance(e, herr.RevisionNotFoundError):
            return HubAccessError(f"{what}: no such version or revision{said}: `hs-dataset versions {repo_id}` "
                                  "lists them")
        if status == 401:
            return HubAccessError(f"{what} refused the token (401 Unauthorized){said}: {LOGIN} with a valid token "
                                  "(or, for a private repo, one that may read it)")
        if status == 403:
            return HubAccessError(f"{what}: the token may not do this (403 Forbidden){said}: use a token with "
                                  "write access to the repo (or its organization)")
        if status == 404 or isinstance(e, herr.RepositoryNotFoundError):
            return HubAccessError(f"{what}: not found (404){said}: check the repo id; a private repo needs a "
                                  f"token ({LOGIN})")
        if status == 412:  # a commit's parent_commit is no longer the branch's head: another writer moved it
            return HubAccessError(f"{what}: another push changed the repo while this one ran (412: the branch it "
                                  f"committed to moved){said}; this push published nothing. Run the same command "
                                  "again: it starts from what is there now")
        if status is not None and status >= 500:
            return HubAccessError(f"{ep} answered {status}{said}: the Hub has a problem; run the same command "
                                  "again later (a push resumes)")
        return HubAccessError(f"{what}: the Hub answered {status}{said}")
    if isinstance(e, herr.HFValidationError):
        return HubAccessError(f"{repo_id!r} is not a Hub repo id ({str(e).splitlines()[0]}): give `org/name`, or "
                              "the path of a build directory")
    if isinstance(e, herr.HTTPError):  # no answer at all: connection refused, DNS, timeout...
        return HubAccessError(f"cannot reach {ep} ({type(e).__name__}: {str(e)[:120]}): check HF_ENDPOINT and "
                              "the network, then run the same command again")
    return None


@contextlib.contextmanager
def hub_errors(endpoint: str | None = None, repo_id: str | None = None) -> Iterator[None]:
    """Raise what a Hub request raises inside as :func:`hub_error` (errors of other kinds pass through)."""
    try:
        yield
    except Exception as e:
        err = hub_error(e, endpoint, repo_id)
        if err is None:
            raise
        raise err from e


F = TypeVar("F", bound=Callable[..., Any])


def hub_call(fn: F) -> F:
    """``fn`` raising Hub failures as :func:`hub_error` names them, with its ``repo_id`` and ``endpoint`` arguments."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs).arguments
        with hub_errors(bound.get("endpoint"), bound.get("repo_id")):
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]


def require_token(*, token: str | None = None, endpoint: str | None = None) -> str:
    """The token a push will use (``token``, else huggingface_hub's ``HF_TOKEN`` / stored login), looked up
    without any request.

    Raises:
        HubAccessError: there is none (the message says how to set one).
    """
    tok = token or get_token()
    if tok is None:
        raise HubAccessError(f"no Hugging Face token: {LOGIN} (a push to {endpoint_of(endpoint)} needs one that may "
                             "write)")
    return tok


def check_hub(*, token: str | None = None, endpoint: str | None = None, need_token: bool = True) -> str | None:
    """Check, before any work, that the Hub can be used; return the token's user name (None: no token).

    Args:
        token: the token to use (default: huggingface_hub's ``HF_TOKEN`` / stored login).
        endpoint: the Hub (default ``HF_ENDPOINT``).
        need_token: a missing token is an error (a push); else only the endpoint is checked.

    Raises:
        HubAccessError: no token (``need_token``), the endpoint cannot be reached, or it refuses the token.
    """

    ep = endpoint_of(endpoint)
    tok = require_token(token=token, endpoint=ep) if need_token else (token or get_token())
    if tok is None:
        with hub_errors(ep):
            get_session().get(f"{ep}/api/whoami-v2", timeout=30)  # any answer will do: it is reachable
        return None
    with hub_errors(ep):
        info = HfApi(endpoint=ep, token=tok).whoami()
    return str(info.get("name")) if isinstance(info, dict) else None
