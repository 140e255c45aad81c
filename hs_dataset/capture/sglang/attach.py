"""The SGLang backend attached to a running server: requests over its HTTP ``/generate`` endpoint.

The server was started with the plugin's settings (``HS_DATASET_CAPTURE`` naming a ring folder both
sides reach); ``user:password@`` in its URL is sent as HTTP basic auth and kept out of the URL (and of
every message).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.error
import urllib.request
from typing import Any

from hs_dataset.errors import BackendError
from hs_dataset.redact import split_url_auth

__all__ = ["AttachedServer"]


class AttachedServer:
    """A running SGLang server at ``url``, at most ``max_inflight`` requests at once, each within ``timeout`` s."""

    remote = True
    manifest_wait_s = 5.0  # a server that answers has loaded its model: its plugin wrote the manifest then

    def __init__(self, url: str, *, max_inflight: int, timeout: float):
        self.url, self._auth = split_url_auth(url.rstrip("/"))
        self.timeout = timeout
        self._pool: cf.ThreadPoolExecutor | None = None
        self.check_reachable()
        self._pool = cf.ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="hs_dataset-http")

    def check_reachable(self, timeout: float = 10.0) -> None:
        """Raise :class:`BackendError` in one line when nothing answers at the server's URL.

        Any HTTP answer will do (``/health`` of an SGLang server, a 404 of something else: the manifest
        check that follows tells the two apart)."""
        req = urllib.request.Request(self.url + "/health", headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise BackendError(f"cannot reach the SGLang server at {self.url} ({reason}): start it with the plugin's "
                               "settings (docs/sglang.md, attach mode), or fix backend_options.sglang_url") from None

    def not_ready(self, ring_dir: str) -> BackendError:
        """The error for a server that answers but whose plugin never wrote its manifest into ``ring_dir``."""
        return BackendError(
            f"the SGLang server at {self.url} answers, but no hs_dataset plugin reported ready in {ring_dir}: start "
            f"the server with HS_DATASET_CAPTURE='{{\"layers\": [...], \"dir\": \"{ring_dir}\"}}' and hs_dataset "
            "installed in its Python environment (SGLANG_PLUGINS, if set, allowing hs_dataset_capture)")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._auth} if self._auth else {}

    def submit(self, rid: str, ids: list[int], params: dict[str, Any]) -> cf.Future:
        """POST one request; its future gives the server's output dict (or raises ``urllib.error.HTTPError``)."""
        body = json.dumps({"input_ids": ids, "sampling_params": params, "rid": rid}).encode()
        headers = {"Content-Type": "application/json", **self._headers()}

        def post() -> dict:
            req = urllib.request.Request(self.url + "/generate", data=body, headers=headers)
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())

        assert self._pool is not None
        return self._pool.submit(post)

    def alive(self) -> None:
        """Nothing to watch here: a dead server shows as failed requests and a silent ring."""

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
