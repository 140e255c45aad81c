"""Credentials never reach anything written or published: redaction, and the scan before a push.

What is redacted (replaced by ``***``), wherever it appears in ``hs_dataset.json``, the card and the
recorded build command:

* the value of every key that names a credential, at any depth of any options dict: a key whose
  words (split at ``_``, ``-``, ``.`` and camelCase) include ``apikey``, ``secret``, ``password``,
  ``passwd``, ``pwd``, ``passphrase``, ``auth``, ``oauth``, ``authorization``, ``bearer``,
  ``cookie(s)`` or ``credential(s)``, or whose last word is ``token`` or ``key`` or ends in
  ``token``/``secret``/``password`` (``hf_token``, ``api_key``, ``engine_args.admin_api_key``,
  ``accessToken``; not ``batch_tokens``, ``max_new_tokens``, ``token_offsets`` or ``tokenizer``). Every string
  under such a key is redacted; numbers,
  booleans and null are kept;
* the user-info of a URL (``http://user:password@host`` -> ``http://***@host``), URL query values
  with such names (``?api_key=...``) and ``NAME=value`` with such a name anywhere in a string (a path
  component ``/models/tok_password=.../``), in any string;
* strings shaped like a Hugging Face token (``hf_`` + 20 or more letters/digits), whatever stands before or
  after them (``export_hf_<token>.jsonl``);
* in a command line: ``--set a.b.api_key=...``, ``KEY=...`` and ``--some-token VALUE`` /
  ``--some-token=VALUE`` arguments, and JSON values holding any of the above.

The build keeps salted sha256 digests of the values it redacted in ``.hs_build/redacted.json``
(local, never published, never the values themselves); ``push`` scans every file it uploads for
them (and for the HF token, any value given to it and any token-shaped string), and refuses a file that holds one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from base64 import b64encode
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import unquote, urlsplit, urlunsplit

from hs_dataset.atomic import atomic_write
from hs_dataset.errors import SecretLeakError
from hs_dataset.layout import REDACTED_FILE

__all__ = ["REDACTED", "check_uploads", "find_secret", "is_secret_key", "load_redacted", "record_redacted", "redact",
           "redact_command", "redact_text", "split_url_auth"]

REDACTED = "***"
MIN_SCAN_LEN = 6  # shorter redacted values are redacted but not scanned for (they match everywhere)
_WORDS = {"apikey", "secret", "password", "passwd", "pwd", "passphrase", "auth", "oauth",
          "authorization", "bearer", "cookie", "cookies", "credential", "credentials"}
# "token" and "key" name a credential only as the key's last word (api_key, hf_token), never as a qualifier
# (token_offsets, key_file) or in plural (max_new_tokens, tokens_written).
_LAST_WORDS = {"token", "key"}
_SUFFIXES = ("token", "secret", "password", "apikey")
_WORD_RE = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_URL_USER = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^/\s:@?#'\"]*)(?::([^/\s@?#'\"]*))?@")
_QUERY = re.compile(r"([?&;])([^=&#\s'\"]+)=([^&#\s'\"]*)")
# wherever it stands: a file name export_hf_<token>.jsonl or hf_<token>2 holds one too
_HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{20,}")
_HF_TOKEN_BYTES = re.compile(_HF_TOKEN.pattern.encode())
# NAME=value anywhere in a string (a path component /models/tok_password=x/, an environment assignment)
_KEY_VALUE = re.compile(r"(?<![\w.\-])([A-Za-z_][\w.\-]*)=([^\s/&;'\"#?,]+)")
_ARG_KEY = re.compile(r"[A-Za-z_][\w.\-]*")

Found = list[tuple[str, str]]  # (where, value)


def is_secret_key(key: str) -> bool:
    """Whether an option or argument name names a credential (see the module docstring)."""
    words = [w.lower() for w in _WORD_RE.findall(key)]
    if not words:
        return False
    return any(w in _WORDS for w in words) or words[-1] in _LAST_WORDS or words[-1].endswith(_SUFFIXES)


def redact_text(text: str, where: str = "text") -> tuple[str, Found]:
    """``text`` with URL user-info, credential query values and HF-token-shaped strings redacted."""
    found: Found = []

    def user(m: re.Match) -> str:
        secret = m.group(3) if m.group(3) else m.group(2)
        if not secret:
            return m.group(0)
        found.append((where + " (URL user-info)", secret))
        return m.group(1) + REDACTED + "@"

    def query(m: re.Match) -> str:
        if not is_secret_key(m.group(2)) or not m.group(3) or m.group(3) == REDACTED:
            return m.group(0)
        found.append((f"{where} (URL parameter {m.group(2)})", m.group(3)))
        return f"{m.group(1)}{m.group(2)}={REDACTED}"

    def token(m: re.Match) -> str:
        found.append((where + " (an hf_ token)", m.group(0)))
        return "hf_" + REDACTED

    def key_value(m: re.Match) -> str:
        if not is_secret_key(m.group(1)) or m.group(2) == REDACTED:
            return m.group(0)
        found.append((f"{where} ({m.group(1)}=...)", m.group(2)))
        return f"{m.group(1)}={REDACTED}"

    text = _URL_USER.sub(user, text)
    text = _QUERY.sub(query, text)
    text = _KEY_VALUE.sub(key_value, text)
    return _HF_TOKEN.sub(token, text), found


def split_url_auth(url: str) -> tuple[str, str | None]:
    """``(url without its user-info, an HTTP Basic ``Authorization`` value or None)``: a URL that
    carries ``user:password@`` is requested without it (so no error message or log shows it)."""

    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    return urlunsplit(parts._replace(netloc=host)), f"Basic {token}"


def _redact_all(value: Any, where: str, found: Found) -> Any:
    if isinstance(value, str):
        if value and value != REDACTED:
            found.append((where, value))
            return REDACTED
        return value
    if isinstance(value, dict):
        return {k: _redact_all(v, f"{where}.{k}", found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_all(v, f"{where}[{i}]", found) for i, v in enumerate(value)]
    return value  # numbers, booleans, null are not credentials


def redact(obj: Any, where: str = "") -> tuple[Any, Found]:
    """A copy of a JSON-like ``obj`` with every credential redacted, and what was redacted.

    Returns ``(clean, found)``; ``found`` lists ``(where, value)`` (``where``: the key path).
    """
    found: Found = []

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                out[k] = _redact_all(x, p, found) if isinstance(k, str) and is_secret_key(k) else walk(x, p)
            return out
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, str):
            text, f = redact_text(v, path or "value")
            found.extend(f)
            return text
        return v

    return walk(obj, where), found


def _redact_arg(arg: str, found: Found) -> str:
    key, eq, value = arg.lstrip("-").partition("=")
    if eq and _ARG_KEY.fullmatch(key):  # --set a.b=v, KEY=v, --flag=v
        prefix = arg[: len(arg) - len(value)]
        if any(is_secret_key(k) for k in key.split(".")):
            if value and value != REDACTED:
                found.append((f"command line {key}", value))
                return shlex.quote(prefix) + REDACTED
            return shlex.quote(arg)
        if "=" in value and _ARG_KEY.fullmatch(value.partition("=")[0]):  # --set=a.b=v
            return shlex.quote(prefix) + _redact_arg(value, found)
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, (dict, list)):
            clean, f = redact(parsed, f"command line {key}")
            if f:
                found.extend(f)
                return shlex.quote(prefix + json.dumps(clean))
    text, f = redact_text(arg, "command line")
    found.extend(f)
    return shlex.quote(text)


def redact_command(command: str) -> tuple[str, Found]:
    """A recorded command line with its credentials redacted (see the module docstring)."""
    try:
        args = shlex.split(command)
    except ValueError:  # unbalanced quotes: redact what the text shows
        return redact_text(command, "command line")
    found: Found = []
    out: list[str] = []
    value_next = False
    for arg in args:
        if value_next and not arg.startswith("-"):
            found.append(("command line " + out[-1].lstrip("-"), arg))
            out.append(REDACTED)
            value_next = False
            continue
        value_next = arg.startswith("-") and "=" not in arg and is_secret_key(arg.lstrip("-"))
        out.append(shlex.quote(arg) if value_next else _redact_arg(arg, found))
    return " ".join(out), found


# -- the scan before a push --------------------------------------------------------------------------


def _digest(salt: bytes, value: bytes) -> str:
    return hashlib.sha256(salt + value).hexdigest()


def record_redacted(state: Path, found: Found) -> None:
    """Add salted digests of the redacted values to ``state/redacted.json`` (values never stored)."""

    path = state / REDACTED_FILE
    reg = load_redacted(state) or {"salt": os.urandom(16).hex(), "values": []}
    salt = bytes.fromhex(reg["salt"])
    have = {v["sha256"] for v in reg["values"]}
    added = False
    for where, value in found:
        raw = value.encode("utf-8", "surrogatepass")
        d = _digest(salt, raw)
        if len(raw) >= MIN_SCAN_LEN and d not in have:
            reg["values"].append({"where": where, "bytes": len(raw), "sha256": d})
            have.add(d)
            added = True
    if added or not path.exists():
        atomic_write(path, json.dumps(reg, indent=1))


def load_redacted(state: Path) -> dict[str, Any] | None:
    """The registry :func:`record_redacted` wrote (None when there is none or it is unreadable)."""
    try:
        reg = json.loads((state / REDACTED_FILE).read_text(encoding="utf-8"))
        bytes.fromhex(reg["salt"])
        return reg if isinstance(reg.get("values"), list) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def find_secret(data: bytes, plain: Iterable[tuple[str, str]], registry: dict[str, Any] | None) -> str | None:
    """Where the credential held by ``data`` came from, or None when it holds none.

    ``plain``: ``(where, value)`` pairs searched for as they are; ``registry``: salted digests
    (:func:`record_redacted`), matched against every substring of their length that starts at the
    beginning or after a character that is not a letter or digit.
    """
    for where, value in plain:
        if value and value.encode("utf-8", "surrogatepass") in data:
            return where
    if not registry or not registry["values"]:
        return None
    salt = bytes.fromhex(registry["salt"])
    by_len: dict[int, dict[str, str]] = {}
    for v in registry["values"]:
        by_len.setdefault(int(v["bytes"]), {})[v["sha256"]] = v["where"]
    starts = [0] + [m.end() for m in re.finditer(rb"[^A-Za-z0-9]", data)]
    for n, digests in by_len.items():
        for i in starts:
            if i + n <= len(data):
                found = digests.get(_digest(salt, data[i:i + n]))
                if found is not None:
                    return found
    return None


def check_uploads(files: Iterable[tuple[str, Path, int]], token: str | None, state: Path, secrets: Iterable[str] = (),
                  *, max_bytes: int) -> None:
    """Refuse (:class:`~hs_dataset.errors.SecretLeakError`) a file about to be uploaded that holds the
    HF ``token``, a value of ``secrets``, a string shaped like a Hugging Face token (wherever it stands), or a
    value the build redacted (the digests in ``state``, matched in every file but the data shards).
    ``files``: ``(path in the repo, local path, bytes)``;
    data shards of ``max_bytes`` or more (stored with LFS) are not read; every other file is, whatever its
    size (a large ``rejects.jsonl`` too).
    """

    plain = [("your Hugging Face token", token)] if token else []
    plain += [("a credential given to push", v) for v in secrets if v]
    registry = load_redacted(state)
    for rel, path, size in files:
        if size >= max_bytes and rel.startswith("data/"):
            continue
        data = path.read_bytes()
        where = find_secret(data, plain, None if rel.startswith("data/") else registry)
        if where is None and _HF_TOKEN_BYTES.search(data):
            where = "a string shaped like a Hugging Face token (hf_...)"
        if where is not None:
            what = where if where == "your Hugging Face token" else f"a credential ({where})"
            raise SecretLeakError(f"refusing to upload {rel}: it contains {what}. Remove it from the file (or "
                                  "rebuild: hs_dataset redacts credentials in what it writes) and push again")
