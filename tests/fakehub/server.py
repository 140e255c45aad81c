"""A local, Hub-compatible HTTP server for tests (no network needed).

It implements the subset of the Hugging Face Hub HTTP API that the real
``huggingface_hub`` client (``HfApi``, ``hf_hub_download``, ``HfFileSystem``) and
``datasets.load_dataset`` use, with ``HF_HUB_DISABLE_XET=1`` (plain Git LFS transfers):

* ``POST /api/repos/create`` (409 + ``url`` when it exists), ``DELETE /api/repos/delete``
* ``GET /api/{type}s/{repo}`` and ``GET /api/{type}s/{repo}/revision/{rev}`` (``sha``, ``siblings``,
  ``cardData``...; ``blobs=1`` adds sizes and LFS info; ``expand`` filters properties)
* ``POST /api/{type}s/{repo}/preupload/{rev}`` (``uploadMode``: "lfs" for files >= 10 MiB or
  matching an LFS rule of the revision's ``.gitattributes``; ``shouldIgnore`` from ``.gitignore``;
  ``oid`` of the file already at that path)
* ``POST /api/{type}s/{repo}/commit/{rev}`` (NDJSON: header / file / lfsFile / deletedFile /
  deletedFolder; ``parentCommit`` check -> 412; ``create_pr=1`` opens ``refs/pr/N``)
* Git LFS batch API ``POST /{prefix}{repo}.git/info/lfs/objects/batch`` (basic transfer;
  objects already stored return no ``actions``), upload ``PUT`` and ``verify``
* ``GET /api/{type}s/{repo}/refs``, ``POST|DELETE .../tag/...``, ``POST|DELETE .../branch/...``
* ``GET /api/{type}s/{repo}/tree/{rev}[/{path}]`` (``recursive``, ``expand``, Link-header pagination)
* ``POST /api/{type}s/{repo}/paths-info/{rev}``, ``GET /api/{type}s/{repo}/commits/{rev}``
* ``GET|HEAD /{prefix}{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag``,
  ``X-Linked-Etag``, ``X-Linked-Size``, ``Content-Length`` and single-range requests (206 / 416)
* ``POST /api/validate-yaml``, ``GET /api/whoami-v2``, ``GET /api/agent-harnesses`` (empty registry)

Revisions may be branch names, tag names, full ``refs/...`` names, full or (>= 7 chars) abbreviated
commit shas; they arrive URL-quoted (``refs%2Fpr%2F1``, ``hs-dataset%2Fv1.0``).

Storage is content addressed: file contents live once in ``<root>/objects/<sha256>``; a commit is a
parent + the full ``{path: entry}`` map, and ids are real git ids (blob, tree and commit objects are
hashed as git does, LFS files as their pointer file), so a tag keeps pointing at exactly its commit.

Authorization: ``Authorization: Bearer <token>`` is accepted. The server only counts that a token
was sent (``auth_requests``); the value is never stored, logged or written anywhere. When
``write_token`` is set, write endpoints answer 401 unless exactly that token is sent.

Test hooks: ``lfs_uploads`` (Counter oid -> PUT count), ``commit_requests`` (count),
``fail_commit_requests`` ({n: status}: the n-th commit request fails with that status, before any
state change), ``commit_fault`` (callable (repo_id, revision, n) -> status or None, same effect),
``hold_commit_requests`` ({n}: the n-th commit request blocks (``held`` is set) until
``release`` is set, then is dropped unanswered and unapplied), ``tag_events`` (every tag creation with the exact file map it pointed at),
``request_log`` ((method, path, status) without query strings).

Usage::

    with running_hub(tmp_path) as hub:
        api = HfApi(endpoint=hub.endpoint, token="hf_x")
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

REGULAR_MAX_SIZE = 10 * 1024 * 1024  # the Hub refuses regular (non-LFS) files >= 10 MiB
TREE_PAGE_SIZE = 1000  # Hub: 1000 entries per tree page, 50 when expand=true
TREE_PAGE_SIZE_EXPANDED = 50
COMMITS_PAGE_SIZE = 50
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEXSHORT = re.compile(r"^[0-9a-f]{7,39}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REPO_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

# The .gitattributes the Hub writes in the initial commit of a new repository.
DEFAULT_GITATTRIBUTES = """\
*.7z filter=lfs diff=lfs merge=lfs -text
*.arrow filter=lfs diff=lfs merge=lfs -text
*.bin filter=lfs diff=lfs merge=lfs -text
*.bz2 filter=lfs diff=lfs merge=lfs -text
*.ckpt filter=lfs diff=lfs merge=lfs -text
*.ftz filter=lfs diff=lfs merge=lfs -text
*.gz filter=lfs diff=lfs merge=lfs -text
*.h5 filter=lfs diff=lfs merge=lfs -text
*.joblib filter=lfs diff=lfs merge=lfs -text
*.lfs.* filter=lfs diff=lfs merge=lfs -text
*.lz4 filter=lfs diff=lfs merge=lfs -text
*.mds filter=lfs diff=lfs merge=lfs -text
*.mlmodel filter=lfs diff=lfs merge=lfs -text
*.model filter=lfs diff=lfs merge=lfs -text
*.msgpack filter=lfs diff=lfs merge=lfs -text
*.npy filter=lfs diff=lfs merge=lfs -text
*.npz filter=lfs diff=lfs merge=lfs -text
*.onnx filter=lfs diff=lfs merge=lfs -text
*.ot filter=lfs diff=lfs merge=lfs -text
*.parquet filter=lfs diff=lfs merge=lfs -text
*.pb filter=lfs diff=lfs merge=lfs -text
*.pickle filter=lfs diff=lfs merge=lfs -text
*.pkl filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.pth filter=lfs diff=lfs merge=lfs -text
*.rar filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
saved_model/**/* filter=lfs diff=lfs merge=lfs -text
*.tar.* filter=lfs diff=lfs merge=lfs -text
*.tar filter=lfs diff=lfs merge=lfs -text
*.tflite filter=lfs diff=lfs merge=lfs -text
*.tgz filter=lfs diff=lfs merge=lfs -text
*.wasm filter=lfs diff=lfs merge=lfs -text
*.xz filter=lfs diff=lfs merge=lfs -text
*.zip filter=lfs diff=lfs merge=lfs -text
*.zst filter=lfs diff=lfs merge=lfs -text
*tfevents* filter=lfs diff=lfs merge=lfs -text
# Audio files - uncompressed
*.pcm filter=lfs diff=lfs merge=lfs -text
*.sam filter=lfs diff=lfs merge=lfs -text
*.raw filter=lfs diff=lfs merge=lfs -text
# Audio files - compressed
*.aac filter=lfs diff=lfs merge=lfs -text
*.flac filter=lfs diff=lfs merge=lfs -text
*.mp3 filter=lfs diff=lfs merge=lfs -text
*.ogg filter=lfs diff=lfs merge=lfs -text
*.wav filter=lfs diff=lfs merge=lfs -text
# Image files - uncompressed
*.bmp filter=lfs diff=lfs merge=lfs -text
*.gif filter=lfs diff=lfs merge=lfs -text
*.png filter=lfs diff=lfs merge=lfs -text
*.tiff filter=lfs diff=lfs merge=lfs -text
# Image files - compressed
*.jpg filter=lfs diff=lfs merge=lfs -text
*.jpeg filter=lfs diff=lfs merge=lfs -text
*.webp filter=lfs diff=lfs merge=lfs -text
# Video files - compressed
*.mp4 filter=lfs diff=lfs merge=lfs -text
*.webm filter=lfs diff=lfs merge=lfs -text
"""


# --------------------------------------------------------------------------------------------- git


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _glob_to_regex(pattern: str) -> re.Pattern:
    """gitattributes/gitignore glob (with ``**``) anchored at the repo root."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out += "/.*"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif c == "*":
            out += "[^/]*"
            i += 1
        elif c == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(c)
            i += 1
    return re.compile(out + r"\Z")


def path_matches(pattern: str, path: str) -> bool:
    pattern = pattern.strip()
    if not pattern:
        return False
    if pattern.endswith("/"):  # directory pattern: anything below it
        pattern = pattern + "**"
    if "/" not in pattern.rstrip("/"):  # no slash: matches the basename at any depth
        return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
    return bool(_glob_to_regex(pattern.lstrip("/")).match(path))


def lfs_patterns(gitattributes: str) -> list[tuple[str, bool]]:
    """(pattern, is_lfs) in file order; the last matching line wins, as in git."""
    rules = []
    for line in gitattributes.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        pattern, attrs = parts[0], parts[1:]
        if "filter=lfs" in attrs:
            rules.append((pattern, True))
        elif "-filter" in attrs or "!filter" in attrs or any(a.startswith("filter=") for a in attrs):
            rules.append((pattern, False))
    return rules


def is_lfs_path(rules: list[tuple[str, bool]], path: str) -> bool:
    result = False
    for pattern, lfs in rules:
        if path_matches(pattern, path):
            result = lfs
    return result


def is_ignored(gitignore: str | None, path: str) -> bool:
    if not gitignore:
        return False
    ignored = False
    for line in gitignore.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        if path_matches(pattern, path):
            ignored = not negate
    return ignored


# ------------------------------------------------------------------------------------------ model


@dataclass(frozen=True)
class FileEntry:
    sha256: str  # content address in the object store
    size: int
    lfs: bool
    git_oid: str  # git blob id (of the LFS pointer for LFS files)

    @property
    def pointer_size(self) -> int:
        return len(lfs_pointer(self.sha256, self.size))


@dataclass
class Commit:
    oid: str
    parents: tuple[str, ...]
    files: dict[str, FileEntry]
    title: str
    message: str
    date: float
    author: str


@dataclass
class Repo:
    type: str
    id: str
    private: bool
    created_at: float
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    prs: dict[int, str] = field(default_factory=dict)  # refs/pr/N -> commit
    lfs_objects: set[str] = field(default_factory=set)  # sha256 of LFS objects usable in this repo


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.extra, self.headers = extra or {}, headers or {}


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + ".000Z"


def _tree_oid(entries: list[tuple[str, str, bool]]) -> str:
    """Git tree id for (name, oid, is_dir) children, sorted as git sorts them."""
    body = b""
    for name, oid, is_dir in sorted(entries, key=lambda e: e[0] + ("/" if e[2] else "")):
        mode = b"40000" if is_dir else b"100644"
        body += mode + b" " + name.encode() + b"\0" + bytes.fromhex(oid)
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def _root_tree(files: dict[str, FileEntry]) -> tuple[str, dict[str, str]]:
    """Root tree id and the tree id of every folder."""
    children: dict[str, dict[str, tuple[str, bool]]] = {"": {}}
    for path in files:
        parts = path.split("/")
        for i in range(1, len(parts)):
            children.setdefault("/".join(parts[:i]), {})
    folder_oids: dict[str, str] = {}

    def build(folder: str) -> str:
        entries: list[tuple[str, str, bool]] = []
        prefix = folder + "/" if folder else ""
        for sub in children:
            if sub and sub.startswith(prefix) and "/" not in sub[len(prefix):]:
                entries.append((sub[len(prefix):], build(sub), True))
        for path, entry in files.items():
            if path.startswith(prefix) and "/" not in path[len(prefix):]:
                entries.append((path[len(prefix):], entry.git_oid, False))
        folder_oids[folder] = _tree_oid(entries)
        return folder_oids[folder]

    root = build("")
    return root, folder_oids


# ----------------------------------------------------------------------------------------- server


class HubServer:
    """State + HTTP front end. Use :func:`running_hub` to start/stop it around a test."""

    def __init__(self, root: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 0,
                 write_token: str | None = None, user: str = "hs-test-user"):
        self.root = Path(root)
        self.objects_dir = self.root / "objects"
        self.objects_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.user = user
        self._write_token_hash = hashlib.sha256(write_token.encode()).hexdigest() if write_token else None
        # test hooks
        self.lfs_uploads: Counter[str] = Counter()
        self.commit_requests = 0
        self.fail_commit_requests: dict[int, int] = {}
        self.hold_commit_requests: set[int] = set()
        # commit_fault(repo_id, revision, n) -> HTTP status to fail the n-th commit request with, or None
        self.commit_fault: Callable[[str, str, int], int | None] | None = None
        self.held = threading.Event()  # set when a held commit request has arrived
        self.release = threading.Event()  # set to let held requests go (they are then dropped)
        self.tag_events: list[dict[str, Any]] = []
        self.request_log: list[tuple[str, str, int]] = []
        self.auth_requests = 0
        self.tree_page_size = TREE_PAGE_SIZE
        self._commit_seq = 0
        self.httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def endpoint(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---------------------------------------------------------------- objects
    def _object_path(self, sha256: str) -> Path:
        return self.objects_dir / sha256

    def has_object(self, sha256: str) -> bool:
        return self._object_path(sha256).is_file()

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self._object_path(sha)
        if not path.exists():
            tmp = path.with_suffix(f".tmp{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def read_object(self, sha256: str, start: int = 0, length: int | None = None) -> bytes:
        with open(self._object_path(sha256), "rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    # ---------------------------------------------------------------- repos
    def _now(self) -> float:
        return time.time()

    def _make_commit(self, repo: Repo, parents: tuple[str, ...], files: dict[str, FileEntry], title: str,
                     message: str, author: str) -> Commit:
        date = self._now()
        with self.lock:
            self._commit_seq += 1
            seq = self._commit_seq
        tree, _ = _root_tree(files)
        text = f"tree {tree}\n"
        text += "".join(f"parent {p}\n" for p in parents)
        ident = f"{author} <{author}@users.noreply.localhost> {int(date)} +0000"
        # the sequence number keeps ids unique even for identical trees committed in the same second
        text += f"author {ident}\ncommitter {ident}\nx-local-seq {seq}\n\n{title}\n"
        if message:
            text += f"\n{message}\n"
        raw = text.encode()
        oid = hashlib.sha1(b"commit %d\0" % len(raw) + raw).hexdigest()
        commit = Commit(oid, parents, dict(files), title, message, date, author)
        repo.commits[oid] = commit
        return commit

    def create_repo(self, repo_type: str, repo_id: str, private: bool = False) -> Repo:
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                raise HubError(409, f"You already created this {repo_type} repo", extra={"url": None})
            repo = Repo(repo_type, repo_id, private, self._now())
            data = DEFAULT_GITATTRIBUTES.encode()
            sha = self.put_bytes(data)
            files = {".gitattributes": FileEntry(sha, len(data), False, git_blob_oid(data))}
            commit = self._make_commit(repo, (), files, "initial commit", "", "system")
            repo.branches["main"] = commit.oid
            self.repos[(repo_type, repo_id)] = repo
            return repo

    def get_repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    @staticmethod
    def resolve(repo: Repo, rev: str) -> tuple[str, str]:
        """-> (commit oid, kind) where kind is 'branch', 'tag', 'pr' or 'commit'."""
        if rev.startswith("refs/heads/") and rev.removeprefix("refs/heads/") in repo.branches:
            return repo.branches[rev.removeprefix("refs/heads/")], "branch"
        if rev.startswith("refs/tags/") and rev.removeprefix("refs/tags/") in repo.tags:
            return repo.tags[rev.removeprefix("refs/tags/")], "tag"
        m = re.fullmatch(r"refs/pr/(\d+)", rev)
        if m and int(m.group(1)) in repo.prs:
            return repo.prs[int(m.group(1))], "pr"
        if _HEX40.match(rev) and rev in repo.commits:
            return rev, "commit"
        # git rev-parse order for short names: refs/tags/<name> before refs/heads/<name>
        if rev in repo.tags:
            return repo.tags[rev], "tag"
        if rev in repo.branches:
            return repo.branches[rev], "branch"
        if _HEXSHORT.match(rev):
            matches = [oid for oid in repo.commits if oid.startswith(rev)]
            if len(matches) == 1:
                return matches[0], "commit"
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def commit_of(self, repo_type: str, repo_id: str, rev: str = "main") -> Commit:
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            return repo.commits[self.resolve(repo, rev)[0]]

    def files_at(self, repo_type: str, repo_id: str, rev: str = "main") -> dict[str, FileEntry]:
        return dict(self.commit_of(repo_type, repo_id, rev).files)

    def read_file(self, repo_type: str, repo_id: str, path: str, rev: str = "main") -> bytes:
        return self.read_object(self.files_at(repo_type, repo_id, rev)[path].sha256)

    def dump_state(self) -> dict:
        """JSON-able snapshot of every repo (for tests/inspection)."""
        with self.lock:
            return {
                f"{t}/{i}": {
                    "branches": dict(r.branches), "tags": dict(r.tags), "prs": dict(r.prs),
                    "commits": {
                        oid: {"parents": list(c.parents), "title": c.title, "message": c.message,
                              "files": {p: vars(e) for p, e in c.files.items()}}
                        for oid, c in r.commits.items()
                    },
                }
                for (t, i), r in self.repos.items()
            }


# ------------------------------------------------------------------------------------------ HTTP


def _make_handler(hub: HubServer):
    class Handler(_HubHandler):
        server_hub = hub

    return Handler


def _bool_param(values: list[str] | None) -> bool:
    return bool(values) and values[-1].lower() in ("1", "true", "yes", "on")


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hs-dataset-test-hub/1.0"
    server_hub: HubServer

    # never log anything (headers may carry tokens); the hub keeps a token-free request log
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    # ------------------------------------------------------------------ plumbing
    def _base_url(self) -> str:
        return f"http://{self.headers.get('Host') or '%s:%d' % self.server.server_address[:2]}"

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size_line = self.rfile.readline().strip()
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _iter_body(self, block: int = 1 << 20) -> Iterator[bytes]:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            yield self._read_body()
            return
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            data = self.rfile.read(min(block, remaining))
            if not data:
                break
            remaining -= len(data)
            yield data

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json",
              headers: dict[str, str] | None = None, head_only: bool = False,
              content_length: int | None = None) -> None:
        self._status = status
        self._log_request()  # before answering: a client may look at the log as soon as it has the answer
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v).encode("ascii", "backslashreplace").decode())
        self.end_headers()
        if body and not head_only and self.command != "HEAD":
            self.wfile.write(body)

    def _log_request(self) -> None:
        if not getattr(self, "_logged", False):
            self._logged = True
            with self.server_hub.lock:
                self.server_hub.request_log.append((self.command, urlsplit(self.path).path, self._status))

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self._send(status, json.dumps(obj).encode(), content_type, headers)

    def _error(self, err: HubError) -> None:
        headers = {"X-Error-Message": err.message.replace("\n", " ")[:500]}
        if err.code:
            headers["X-Error-Code"] = err.code
        headers.update(err.headers)
        body = {"error": err.message, **{k: v for k, v in err.extra.items() if v is not None}}
        self._json(err.status, body, headers)

    def _auth(self, write: bool) -> bool:
        """Record (not store) that a token was sent; enforce write_token when configured."""
        header = self.headers.get("Authorization") or ""
        has_token = header.startswith("Bearer ") and len(header) > 7
        hub = self.server_hub
        if has_token:
            with hub.lock:
                hub.auth_requests += 1
        if write and hub._write_token_hash is not None:
            sent = hashlib.sha256(header[7:].encode()).hexdigest() if has_token else None
            if sent != hub._write_token_hash:
                raise HubError(401, "Invalid credentials in Authorization header" if has_token
                               else "You must be authenticated to do this")
        return has_token

    def _check_read_access(self, repo: Repo) -> None:
        if repo.private and not (self.headers.get("Authorization") or "").startswith("Bearer "):
            raise HubError(401, "Repository not found", "RepoNotFound")

    def _dispatch(self) -> None:
        self._status = 0
        self._logged = False
        self._body_consumed = False
        split = urlsplit(self.path)
        self._query = parse_qs(split.query, keep_blank_values=True)
        segments = split.path.split("/")[1:]  # raw (still quoted) segments
        try:
            self._route(segments)
        except HubError as err:
            if self.command in ("POST", "PUT", "DELETE") and not getattr(self, "_body_consumed", False):
                with contextlib.suppress(Exception):
                    for _ in self._iter_body():
                        pass
            self._error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        except Exception as exc:  # pragma: no cover - a server bug: answer 500 instead of hanging
            self.close_connection = True
            with contextlib.suppress(Exception):
                self._error(HubError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            self._log_request()  # requests dropped without an answer (status -1)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch

    # ------------------------------------------------------------------ routing
    def _route(self, seg: list[str]) -> None:
        m = self.command
        hub = self.server_hub
        if seg[:1] == ["api"]:
            rest = seg[1:]
            if rest == ["repos", "create"] and m == "POST":
                return self._create_repo()
            if rest == ["repos", "delete"] and m == "DELETE":
                return self._delete_repo()
            if rest == ["whoami-v2"] and m == "GET":
                if not self._auth(write=False):
                    raise HubError(401, "Invalid credentials in Authorization header")
                return self._json(200, {"type": "user", "name": hub.user, "fullname": hub.user, "orgs": [],
                                        "auth": {"type": "access_token", "accessToken": {"role": "write"}}})
            if rest == ["agent-harnesses"] and m == "GET":
                return self._json(200, {"standardEnvVars": [], "harnesses": {}})
            if rest == ["validate-yaml"] and m == "POST":
                return self._validate_yaml()
            if len(rest) >= 3 and rest[0] in REPO_TYPES:
                repo_type = REPO_TYPES[rest[0]]
                repo_id = f"{unquote(rest[1])}/{unquote(rest[2])}"
                return self._repo_api(repo_type, repo_id, rest[3:])
            raise HubError(404, "Not found")
        if seg[:1] == ["_lfs"] and len(seg) == 6:  # /_lfs/{upload|objects}/{type}/{ns}/{name}/{oid}
            _, action, repo_type, ns, name, oid = seg
            return self._lfs_object(action, repo_type, f"{unquote(ns)}/{unquote(name)}", oid)
        # /{prefix}{ns}/{name}.git/info/lfs/objects/(batch|verify) and /{prefix}{ns}/{name}/resolve/...
        repo_type = "model"
        if seg and seg[0] in REPO_TYPES and seg[0] != "models":
            repo_type, seg = REPO_TYPES[seg[0]], seg[1:]
        if len(seg) >= 2 and seg[1].endswith(".git") and seg[2:5] == ["info", "lfs", "objects"] and m == "POST":
            repo_id = f"{unquote(seg[0])}/{unquote(seg[1][:-4])}"
            if seg[5:] == ["batch"]:
                return self._lfs_batch(repo_type, repo_id)
            if seg[5:] == ["verify"]:
                return self._lfs_verify(repo_type, repo_id)
        if len(seg) >= 5 and seg[2] == "resolve" and m in ("GET", "HEAD"):
            repo_id = f"{unquote(seg[0])}/{unquote(seg[1])}"
            return self._resolve_file(repo_type, repo_id, unquote(seg[3]), "/".join(unquote(s) for s in seg[4:]))
        raise HubError(404, "Not found")

    def _repo_api(self, repo_type: str, repo_id: str, rest: list[str]) -> None:
        m = self.command
        hub = self.server_hub
        op = rest[0] if rest else ""
        arg = unquote(rest[1]) if len(rest) > 1 else None
        tail = "/".join(unquote(s) for s in rest[2:])
        if op == "" and m == "GET":
            return self._repo_info(repo_type, repo_id, None)
        if op == "revision" and arg is not None and m == "GET":
            return self._repo_info(repo_type, repo_id, arg + ("/" + tail if tail else ""))
        if op == "preupload" and arg is not None and m == "POST":
            return self._preupload(repo_type, repo_id, arg)
        if op == "commit" and arg is not None and m == "POST":
            return self._commit(repo_type, repo_id, arg)
        if op == "refs" and m == "GET":
            return self._refs(repo_type, repo_id)
        if op == "tag" and arg is not None and m == "POST":
            return self._create_tag(repo_type, repo_id, arg)
        if op == "tag" and arg is not None and m == "DELETE":
            return self._delete_tag(repo_type, repo_id, arg)
        if op == "branch" and arg is not None and m == "POST":
            return self._create_branch(repo_type, repo_id, arg)
        if op == "branch" and arg is not None and m == "DELETE":
            return self._delete_branch(repo_type, repo_id, arg)
        if op == "tree" and arg is not None and m == "GET":
            return self._tree(repo_type, repo_id, arg, tail)
        if op == "paths-info" and arg is not None and m == "POST":
            return self._paths_info(repo_type, repo_id, arg)
        if op == "commits" and arg is not None and m == "GET":
            return self._commits(repo_type, repo_id, arg)
        with hub.lock:
            hub.get_repo(repo_type, repo_id)
        raise HubError(404, "Not found")

    # ------------------------------------------------------------------ helpers
    def _repo_for_read(self, repo_type: str, repo_id: str) -> Repo:
        self._auth(write=False)
        repo = self.server_hub.get_repo(repo_type, repo_id)
        self._check_read_access(repo)
        return repo

    def _repo_url(self, repo: Repo) -> str:
        return f"{self._base_url()}/{URL_PREFIX[repo.type]}{repo.id}"

    def _file_json(self, repo: Repo, path: str, entry: FileEntry, expand: bool, head: str) -> dict:
        out: dict[str, Any] = {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": path}
        if entry.lfs:
            out["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": entry.pointer_size}
        if expand:
            out["lastCommit"] = self._last_commit(repo, head, path)
            out["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False, "virusNames": None},
                                         "pickleImportScan": None}
        return out

    def _folder_json(self, repo: Repo, path: str, oid: str, expand: bool, head: str) -> dict:
        out: dict[str, Any] = {"type": "directory", "oid": oid, "size": 0, "path": path}
        if expand:
            out["lastCommit"] = self._last_commit(repo, head, path)
        return out

    @staticmethod
    def _touches(commit: Commit, parent: Commit | None, path: str) -> bool:
        def view(c: Commit | None) -> dict:
            if c is None:
                return {}
            return {p: e for p, e in c.files.items() if p == path or p.startswith(path + "/")}

        return view(commit) != view(parent)

    def _last_commit(self, repo: Repo, head: str, path: str) -> dict:
        oid = head
        while True:
            commit = repo.commits[oid]
            parent = repo.commits[commit.parents[0]] if commit.parents else None
            if parent is None or self._touches(commit, parent, path):
                return {"id": commit.oid, "title": commit.title, "date": _iso(commit.date)}
            oid = parent.oid

    # ------------------------------------------------------------------ endpoints: repos
    def _create_repo(self) -> None:
        self._auth(write=True)
        hub = self.server_hub
        payload = json.loads(self._read_body() or b"{}")
        self._body_consumed = True
        name, org = payload.get("name"), payload.get("organization")
        repo_type = payload.get("type") or "model"
        if repo_type not in URL_PREFIX:
            raise HubError(400, f"Invalid repo type: {repo_type}")
        if not name or not _REPO_NAME.match(name) or (org is not None and not _REPO_NAME.match(org)):
            raise HubError(400, "Invalid repo name")
        repo_id = f"{org or hub.user}/{name}"
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        url = f"{self._base_url()}/{URL_PREFIX[repo_type]}{repo_id}"
        try:
            hub.create_repo(repo_type, repo_id, private)
        except HubError as err:
            err.extra["url"] = url
            raise
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self) -> None:
        self._auth(write=True)
        hub = self.server_hub
        payload = json.loads(self._read_body() or b"{}")
        self._body_consumed = True
        repo_id = f"{payload.get('organization') or hub.user}/{payload.get('name')}"
        with hub.lock:
            hub.get_repo(payload.get("type") or "model", repo_id)
            del hub.repos[(payload.get("type") or "model", repo_id)]
        self._json(200, {})

    def _validate_yaml(self) -> None:
        payload = json.loads(self._read_body() or b"{}")
        self._body_consumed = True
        content = payload.get("content") or ""
        errors = []
        if content.startswith("---"):
            match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.S)
            if not match:
                errors.append({"message": "README.md metadata: unterminated YAML header"})
            else:
                try:
                    import yaml

                    data = yaml.safe_load(match.group(1))
                    if data is not None and not isinstance(data, dict):
                        errors.append({"message": "README.md metadata must be a YAML mapping"})
                except Exception as exc:
                    errors.append({"message": f"Invalid YAML: {exc}"})
        if errors:
            return self._json(400, {"errors": errors, "warnings": [], "error": errors[0]["message"]})
        self._json(200, {"errors": [], "warnings": []})

    def _repo_info(self, repo_type: str, repo_id: str, rev: str | None) -> None:
        hub = self.server_hub
        with hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            oid, _ = hub.resolve(repo, rev or "main")
            commit = repo.commits[oid]
            blobs = _bool_param(self._query.get("blobs"))
            siblings = []
            for path, entry in sorted(commit.files.items()):
                s: dict[str, Any] = {"rfilename": path}
                if blobs:
                    s.update(size=entry.size, blobId=entry.git_oid)
                    if entry.lfs:
                        s["lfs"] = {"size": entry.size, "sha256": entry.sha256, "pointerSize": entry.pointer_size}
                siblings.append(s)
            card_data = None
            if "README.md" in commit.files:
                card_data = _card_data(hub.read_object(commit.files["README.md"].sha256))
            info: dict[str, Any] = {
                "_id": hashlib.sha1(f"{repo_type}/{repo_id}".encode()).hexdigest()[:24],
                "id": repo_id,
                "author": repo_id.split("/")[0],
                "sha": oid,
                "lastModified": _iso(commit.date),
                "createdAt": _iso(repo.created_at),
                "private": repo.private,
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "usedStorage": sum(e.size for e in commit.files.values()),
            }
            if card_data is not None:
                info["cardData"] = card_data
        expand = (self._query.get("expand") or []) + (self._query.get("expand[]") or [])
        if expand:
            info = {k: v for k, v in info.items() if k in expand or k in ("_id", "id")}
        self._json(200, info)

    def _refs(self, repo_type: str, repo_id: str) -> None:
        hub = self.server_hub
        with hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            out = {
                "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": o}
                             for n, o in sorted(repo.branches.items())],
                "converts": [],
                "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": o} for n, o in sorted(repo.tags.items())],
            }
            if _bool_param(self._query.get("include_prs")):
                out["pullRequests"] = [{"name": f"refs/pr/{n}", "ref": f"refs/pr/{n}", "targetCommit": o}
                                       for n, o in sorted(repo.prs.items())]
        self._json(200, out)

    # ------------------------------------------------------------------ endpoints: refs
    @staticmethod
    def _check_ref_name(name: str, kind: str) -> None:
        bad = (not name or name.startswith(("-", "/", "refs/")) or name.endswith(("/", ".", ".lock"))
               or ".." in name or "//" in name or "@{" in name or name == "@" or re.search(r"[\x00-\x20~^:?*\[\\\x7f]", name))
        if bad:
            raise HubError(400, f"Invalid reference for a {kind}: {name}")

    def _create_tag(self, repo_type: str, repo_id: str, rev: str) -> None:
        self._auth(write=True)
        hub = self.server_hub
        payload = json.loads(self._read_body() or b"{}")
        self._body_consumed = True
        tag = payload.get("tag") or ""
        self._check_ref_name(tag, "tag")
        with hub.lock:
            repo = hub.get_repo(repo_type, repo_id)
            oid, _ = hub.resolve(repo, rev)
            if tag in repo.tags:
                raise HubError(409, f"Tag {tag} already exists")
            repo.tags[tag] = oid
            hub.tag_events.append({"repo": f"{repo_type}/{repo_id}", "tag": tag, "commit": oid,
                                   "files": {p: e.sha256 for p, e in repo.commits[oid].files.items()},
                                   "message": payload.get("message")})
        self._json(200, {"name": tag, "ref": f"refs/tags/{tag}", "targetCommit": oid})

    def _delete_tag(self, repo_type: str, repo_id: str, tag: str) -> None:
        self._delete_ref(repo_type, repo_id, tag.removeprefix("refs/tags/"), "tags")

    def _create_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        self._auth(write=True)
        hub = self.server_hub
        payload = json.loads(self._read_body() or b"{}")
        self._body_consumed = True
        self._check_ref_name(branch, "branch")
        with hub.lock:
            repo = hub.get_repo(repo_type, repo_id)
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            if payload.get("emptyBranch"):
                oid = hub._make_commit(repo, (), {}, "initial commit", "", hub.user).oid
            else:
                oid, _ = hub.resolve(repo, payload.get("startingPoint") or "main")
            repo.branches[branch] = oid
        self._json(200, {})

    def _delete_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        self._delete_ref(repo_type, repo_id, branch.removeprefix("refs/heads/"), "branches")

    def _delete_ref(self, repo_type: str, repo_id: str, name: str, kind: str) -> None:
        """Delete tag or branch ``name`` (``kind``: ``tags`` or ``branches``; main cannot go)."""
        self._auth(write=True)
        hub = self.server_hub
        with hub.lock:
            refs = getattr(hub.get_repo(repo_type, repo_id), kind)
            if kind == "branches" and name == "main":
                raise HubError(403, "Cannot delete the default branch")
            if name not in refs:
                raise HubError(404, f"Invalid rev id: {name}", "RevisionNotFound")
            del refs[name]
        self._json(200, {})

    # ------------------------------------------------------------------ endpoints: listing
    def _tree(self, repo_type: str, repo_id: str, rev: str, path: str) -> None:
        hub = self.server_hub
        recursive = _bool_param(self._query.get("recursive"))
        expand = _bool_param(self._query.get("expand"))
        with hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            oid, _ = hub.resolve(repo, rev)
            commit = repo.commits[oid]
            path = path.strip("/")
            _, folder_oids = _root_tree(commit.files)
            if path and path not in folder_oids:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound",
                               headers={"X-Repo-Commit": oid})
            prefix = path + "/" if path else ""
            entries: list[tuple[str, str]] = []  # (path, kind)
            for folder in folder_oids:
                if folder and folder.startswith(prefix) and (recursive or "/" not in folder[len(prefix):]):
                    entries.append((folder, "directory"))
            for fpath in commit.files:
                if fpath.startswith(prefix) and (recursive or "/" not in fpath[len(prefix):]):
                    entries.append((fpath, "file"))
            entries.sort(key=lambda e: (e[0].count("/") if not recursive else 0, e[1] != "directory", e[0]))
            page_size = TREE_PAGE_SIZE_EXPANDED if expand else hub.tree_page_size
            limit = self._query.get("limit")
            if limit:
                page_size = max(1, min(page_size, int(limit[-1])))
            start = int(base64.urlsafe_b64decode((self._query.get("cursor") or ["MA=="])[-1]).decode() or 0)
            page = entries[start:start + page_size]
            out = [
                self._file_json(repo, p, commit.files[p], expand, oid) if kind == "file"
                else self._folder_json(repo, p, folder_oids[p], expand, oid)
                for p, kind in page
            ]
        headers = {}
        if start + page_size < len(entries):
            query = {k: v[-1] for k, v in self._query.items()}
            query["cursor"] = base64.urlsafe_b64encode(str(start + page_size).encode()).decode()
            next_url = f"{self._base_url()}{urlsplit(self.path).path}?{urlencode(query)}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._json(200, out, headers)

    def _paths_info(self, repo_type: str, repo_id: str, rev: str) -> None:
        hub = self.server_hub
        body = self._read_body()
        self._body_consumed = True
        if (self.headers.get("Content-Type") or "").startswith("application/json"):
            payload = json.loads(body or b"{}")
            paths, expand = payload.get("paths") or [], bool(payload.get("expand"))
        else:
            form = parse_qs(body.decode(), keep_blank_values=True)
            paths, expand = form.get("paths", []), _bool_param(form.get("expand"))
        if isinstance(paths, str):
            paths = [paths]
        if len(paths) > 1000:
            raise HubError(413, "too many parameters")
        with hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            oid, _ = hub.resolve(repo, rev)
            commit = repo.commits[oid]
            _, folder_oids = _root_tree(commit.files)
            out = []
            for p in paths:
                p = p.strip("/")
                if p in commit.files:
                    out.append(self._file_json(repo, p, commit.files[p], expand, oid))
                elif p and p in folder_oids:
                    out.append(self._folder_json(repo, p, folder_oids[p], expand, oid))
        self._json(200, out)

    def _commits(self, repo_type: str, repo_id: str, rev: str) -> None:
        hub = self.server_hub
        with hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            oid, _ = hub.resolve(repo, rev)
            history = []
            cursor: str | None = oid
            while cursor is not None:
                c = repo.commits[cursor]
                history.append({"id": c.oid, "title": c.title, "message": c.message,
                                "authors": [{"user": c.author}], "date": _iso(c.date),
                                "formatted": {"title": c.title, "message": c.message}})
                cursor = c.parents[0] if c.parents else None
        page = int((self._query.get("p") or ["0"])[-1])
        chunk = history[page * COMMITS_PAGE_SIZE:(page + 1) * COMMITS_PAGE_SIZE]
        headers = {}
        if (page + 1) * COMMITS_PAGE_SIZE < len(history):
            query = {k: v[-1] for k, v in self._query.items()}
            query["p"] = str(page + 1)
            headers["Link"] = f'<{self._base_url()}{urlsplit(self.path).path}?{urlencode(query)}>; rel="next"'
        self._json(200, chunk, headers)

    # ------------------------------------------------------------------ endpoints: upload
    def _writable_head(self, repo, rev: str) -> tuple[str, str]:
        """The head commit of ``rev`` and its kind; it must be a branch (or a PR ref, or ``create_pr``)."""
        oid, kind = self.server_hub.resolve(repo, rev)
        if kind not in ("branch", "pr") and not _bool_param(self._query.get("create_pr")):
            raise HubError(400, f"Cannot commit to {rev}: only branches can be committed to")
        return oid, kind

    def _preupload(self, repo_type: str, repo_id: str, rev: str) -> None:
        self._auth(write=True)
        hub = self.server_hub
        payload = json.loads(self._read_body() or b"{}")
        self._body_consumed = True
        with hub.lock:
            repo = hub.get_repo(repo_type, repo_id)
            oid, _ = self._writable_head(repo, rev)
            commit = repo.commits[oid]
            rules = []
            if ".gitattributes" in commit.files:
                rules = lfs_patterns(hub.read_object(commit.files[".gitattributes"].sha256).decode("utf-8", "replace"))
            gitignore = payload.get("gitIgnore")
            if gitignore is None and ".gitignore" in commit.files:
                gitignore = hub.read_object(commit.files[".gitignore"].sha256).decode("utf-8", "replace")
            files_out = []
            for f in payload.get("files") or []:
                path, size = f["path"], int(f["size"])
                mode = "lfs" if size >= REGULAR_MAX_SIZE or is_lfs_path(rules, path) else "regular"
                item: dict[str, Any] = {"path": path, "uploadMode": mode, "shouldIgnore": is_ignored(gitignore, path)}
                existing = commit.files.get(path)
                if existing is not None:
                    item["oid"] = existing.sha256 if existing.lfs else existing.git_oid
                files_out.append(item)
        self._json(200, {"files": files_out, "commitOid": oid})

    def _commit(self, repo_type: str, repo_id: str, rev: str) -> None:
        self._auth(write=True)
        hub = self.server_hub
        body = self._read_body()
        self._body_consumed = True
        with hub.lock:
            hub.commit_requests += 1
            number = hub.commit_requests
            fault = hub.fail_commit_requests.get(number)
            if fault is None and hub.commit_fault is not None:
                fault = hub.commit_fault(repo_id, rev, number)
            hold = number in hub.hold_commit_requests
        if hold:
            # simulate a request that never completes: wait, then drop the connection unanswered
            hub.held.set()
            hub.release.wait(timeout=120)
            self.close_connection = True
            self._status = -1
            return
        if fault is not None:
            raise HubError(fault, f"injected failure of commit request #{hub.commit_requests}")
        try:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        except ValueError as exc:
            raise HubError(400, f"Invalid NDJSON payload: {exc}")
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first line of the payload must be the header")
        header = lines[0].get("value") or {}
        summary = (header.get("summary") or "").strip()
        if not summary:
            raise HubError(400, "Commit summary is required")
        with hub.lock:
            repo = hub.get_repo(repo_type, repo_id)
            head, kind = self._writable_head(repo, rev)
            create_pr = _bool_param(self._query.get("create_pr"))
            parent_commit = header.get("parentCommit")
            if parent_commit is not None and parent_commit != head:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(repo.commits[head].files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value") or {}
                path = (value.get("path") or "").strip("/")
                if key in ("file", "lfsFile") and (not path or any(p in ("", ".", "..", ".git") for p in path.split("/"))):
                    raise HubError(400, f"Invalid path: {value.get('path')!r}")
                if key == "file":
                    if value.get("encoding", "base64") != "base64":
                        raise HubError(400, f"Unsupported encoding {value.get('encoding')}")
                    data = base64.b64decode(value.get("content") or "")
                    if len(data) >= REGULAR_MAX_SIZE:
                        raise HubError(400, f"Your push was rejected because it contains files larger than 10 MiB"
                                            f" ({path}). Please use https://git-lfs.github.com/ to store large files.")
                    files[path] = FileEntry(hub.put_bytes(data), len(data), False, git_blob_oid(data))
                elif key == "lfsFile":
                    sha = value.get("oid") or ""
                    if value.get("algo", "sha256") != "sha256" or not _SHA256.match(sha):
                        raise HubError(400, f"Invalid LFS oid for {path}")
                    if sha not in repo.lfs_objects or not hub.has_object(sha):
                        raise HubError(422, f"LFS object {sha} for {path} was not uploaded to this repository")
                    size = hub._object_path(sha).stat().st_size
                    if value.get("size") is not None and int(value["size"]) != size:
                        raise HubError(422, f"Size mismatch for LFS object {sha}")
                    files[path] = FileEntry(sha, size, True, git_blob_oid(lfs_pointer(sha, size)))
                elif key == "deletedFile":
                    if path not in files:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del files[path]
                elif key == "deletedFolder":
                    doomed = [p for p in files if p.startswith(path + "/")]
                    if not doomed:
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    for p in doomed:
                        del files[p]
                else:
                    raise HubError(400, f"Unknown operation key: {key!r}")
            description = header.get("description") or ""
            commit = hub._make_commit(repo, (head,), files, summary, description, hub.user)
            pr_url = None
            if create_pr:
                num = max(repo.prs, default=0) + 1
                repo.prs[num] = commit.oid
                pr_url = f"{self._repo_url(repo)}/discussions/{num}"
            elif kind == "pr":
                repo.prs[int(rev.rsplit("/", 1)[1])] = commit.oid
            else:
                branch = rev.removeprefix("refs/heads/")
                repo.branches[branch] = commit.oid
        self._json(200, {"success": True, "commitOid": commit.oid, "commitMessage": summary,
                         "commitUrl": f"{self._repo_url(repo)}/commit/{commit.oid}", "pullRequestUrl": pr_url})

    # ------------------------------------------------------------------ endpoints: LFS
    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        hub = self.server_hub
        payload = json.loads(self._read_body() or b"{}")
        self._body_consumed = True
        operation = payload.get("operation")
        self._auth(write=operation == "upload")
        with hub.lock:
            repo = hub.get_repo(repo_type, repo_id)
            self._check_read_access(repo)
        base = self._base_url()
        objects = []
        for obj in payload.get("objects") or []:
            oid, size = obj.get("oid") or "", obj.get("size")
            item: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if not _SHA256.match(oid) or not isinstance(size, int) or size < 0:
                item["error"] = {"code": 422, "message": "Invalid object"}
            elif operation == "upload":
                with hub.lock:  # LFS objects are scoped to the repository, as on a git-lfs server
                    present = oid in repo.lfs_objects and hub.has_object(oid)
                if not present:
                    target = f"{repo_type}/{quote(repo_id.split('/')[0])}/{quote(repo_id.split('/')[1])}/{oid}"
                    item["actions"] = {
                        "upload": {"href": f"{base}/_lfs/upload/{target}", "expires_in": 86400},
                        "verify": {"href": f"{base}/{URL_PREFIX[repo_type]}{repo_id}.git/info/lfs/objects/verify",
                                   "expires_in": 86400},
                    }
            elif operation == "download":
                with hub.lock:
                    present = oid in repo.lfs_objects and hub.has_object(oid)
                if present:
                    target = f"{repo_type}/{quote(repo_id.split('/')[0])}/{quote(repo_id.split('/')[1])}/{oid}"
                    item["actions"] = {"download": {"href": f"{base}/_lfs/objects/{target}", "expires_in": 86400}}
                else:
                    item["error"] = {"code": 404, "message": "Object does not exist"}
            else:
                raise HubError(422, f"Unknown LFS operation {operation!r}")
            objects.append(item)
        self._json(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                   content_type="application/vnd.git-lfs+json")

    def _lfs_object(self, action: str, repo_type: str, repo_id: str, oid: str) -> None:
        hub = self.server_hub
        if not _SHA256.match(oid):
            raise HubError(404, "Not found")
        with hub.lock:
            repo = hub.get_repo(repo_type, repo_id)
        if action == "upload" and self.command == "PUT":
            tmp = hub.objects_dir / f".incoming-{oid}-{threading.get_ident()}"
            digest, size = hashlib.sha256(), 0
            with open(tmp, "wb") as f:
                for chunk in self._iter_body():
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
            self._body_consumed = True
            if digest.hexdigest() != oid:
                tmp.unlink()
                raise HubError(400, "Uploaded content does not match the announced sha256")
            os.replace(tmp, hub._object_path(oid))
            with hub.lock:
                repo.lfs_objects.add(oid)
                hub.lfs_uploads[oid] += 1
            return self._send(200, b"")
        if action == "objects" and self.command == "GET":
            with hub.lock:
                if oid not in repo.lfs_objects:
                    raise HubError(404, "Object does not exist")
            data = hub.read_object(oid)
            return self._send(200, data, "application/octet-stream")
        raise HubError(405, "Method not allowed")

    def _lfs_verify(self, repo_type: str, repo_id: str) -> None:
        self._auth(write=True)
        hub = self.server_hub
        payload = json.loads(self._read_body() or b"{}")
        self._body_consumed = True
        oid, size = payload.get("oid") or "", payload.get("size")
        with hub.lock:
            repo = hub.get_repo(repo_type, repo_id)
            ok = _SHA256.match(oid) and oid in repo.lfs_objects and hub.has_object(oid)
            if ok and size is not None and hub._object_path(oid).stat().st_size != int(size):
                raise HubError(422, "Size mismatch")
        if not ok:
            raise HubError(404, "Object does not exist")
        self._json(200, {}, content_type="application/vnd.git-lfs+json")

    # ------------------------------------------------------------------ endpoints: download
    def _resolve_file(self, repo_type: str, repo_id: str, rev: str, path: str) -> None:
        hub = self.server_hub
        with hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            oid, _ = hub.resolve(repo, rev)
            entry = repo.commits[oid].files.get(path)
        if entry is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": oid})
        # ETag: the git blob id (of the pointer file for LFS files); LFS files also carry the content's
        # sha256 and size in X-Linked-Etag / X-Linked-Size, which the client prefers. LFS content is
        # served inline (the Hub redirects to a CDN instead).
        headers = {"X-Repo-Commit": oid, "Accept-Ranges": "bytes", "ETag": f'"{entry.git_oid}"',
                   "Content-Disposition": f"inline; filename*=UTF-8''{quote(path.rsplit('/', 1)[-1])}"}
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
        start, end = 0, entry.size - 1
        status = 200
        range_header = self.headers.get("Range")
        if range_header and entry.size >= 0:
            m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", range_header)
            if m and (m.group(1) or m.group(2)):
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), entry.size - 1) if m.group(2) else entry.size - 1
                else:  # suffix range: last N bytes
                    start, end = max(entry.size - int(m.group(2)), 0), entry.size - 1
                if start >= entry.size or end < start:
                    headers["Content-Range"] = f"bytes */{entry.size}"
                    raise HubError(416, "Range Not Satisfiable", headers=headers)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
            # other forms (multiple ranges...) are ignored: a full 200 is a valid answer
        length = max(end - start + 1, 0)
        if self.command == "HEAD":
            return self._send(status, b"", "application/octet-stream", headers, head_only=True, content_length=length)
        data = hub.read_object(entry.sha256, start, length) if length else b""
        self._send(status, data, "application/octet-stream", headers)


def _card_data(readme: bytes) -> dict | None:
    text = readme.decode("utf-8", "replace")
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not match:
        return None
    try:
        import yaml

        data = yaml.safe_load(match.group(1))
    except Exception:
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def running_hub(tmp_path: str | os.PathLike | None = None, **kwargs: Any) -> Iterator[HubServer]:
    """Start a :class:`HubServer` on 127.0.0.1 (free port) in a thread; stop it and clean up after."""
    own_dir = tmp_path is None
    root = Path(tempfile.mkdtemp(prefix="hub-store-")) if own_dir else Path(tmp_path) / "hub-store"
    hub = HubServer(root, **kwargs).start()
    try:
        yield hub
    finally:
        hub.stop()
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
