"""The SGLang backend attached to a running server: requests over its HTTP ``/generate`` endpoint.

The server was started with the plugin's settings (``HS_DATASET_CAPTURE`` naming a ring folder both
sides reach); ``user:password@`` in its URL is sent as HTTP basic auth and kept out of the URL (and of
every message).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.request
from typing import Any

from hs_dataset.integrity.redact import split_url_auth

__all__ = ["AttachedServer"]


class AttachedServer:
    """A running SGLang server at ``url``, at most ``max_inflight`` requests at once, each within ``timeout`` s."""

    remote = True
    manifest_wait_s = 60.0  # the server maps the ring at its first request of ours

    def __init__(self, url: str, *, max_inflight: int, timeout: float):
        self.url, self._auth = split_url_auth(url.rstrip("/"))
        self.timeout = timeout
        self._pool: cf.ThreadPoolExecutor | None = cf.ThreadPoolExecutor(max_workers=max_inflight,
                                                                          thread_name_prefix="hs_dataset-http")

    def submit(self, rid: str, ids: list[int], params: dict[str, Any]) -> cf.Future:
        """POST one request; its future gives the server's output dict (or raises ``urllib.error.HTTPError``)."""
        body = json.dumps({"input_ids": ids, "sampling_params": params, "rid": rid}).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": self._auth} if self._auth else {})}

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
