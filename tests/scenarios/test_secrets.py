"""No credential in anything written or published (issue 12): three credentials planted in the
backend options (a key at the top, one nested in engine_args, a URL's user-info) are redacted in
hs_dataset.json, the card, the recorded command and the logs, and appear in no uploaded file, no
stored Hub object, no cache, no stdout or stderr; push refuses a file that holds one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hs_dataset.errors import SecretLeakError
from hs_dataset.hub.publish import push_dataset
from hs_dataset.redact import is_secret_key, redact, redact_command, split_url_auth
from hs_dataset.hub.verify_remote import verify_repo
from tests.fakehub.server import running_hub
from tests.fakehub.tools import client_subprocess_env, hub_client_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "builder_scripts" / "tiny_demo.py"
REPO = "org/secret-free-hs"
TOKEN = "hf_SecretsTestToken0123456789ABCDEFGHIJ"
API_KEY = "sk-planted-top-level-0f3c9a"
ENGINE_KEY = "planted-engine-key-7d1e22"
URL_PASSWORD = "planted-url-pass-5b8c41"
PLANTED = (API_KEY, ENGINE_KEY, URL_PASSWORD)

# Runs the real CLI (`hs-dataset build ... --push`). The transformers backend takes none of the
# SGLang-style options planted here, so they are removed from what starts it and from the check of the
# backend's options (only from those).
DRIVER = """
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
import hs_dataset.cli.options as O
import hs_dataset.write.driver as W
PLANTED = ("api_key", "engine_args", "sglang_url")
real = W.make_backend
def make_backend(name, model, layers, *, revision=None, options=None, **kw):
    options = {k: v for k, v in (options or {}).items() if k not in PLANTED}
    return real(name, model, layers, revision=revision, options=options, **kw)
W.make_backend = make_backend
real_check = O.check_backend_options
O.check_backend_options = lambda name, options: real_check(name, {k: v for k, v in options.items() if k not in PLANTED})
from hs_dataset import cli
sys.argv = ["hs-dataset", *json.load(open(sys.argv[1]))]
sys.exit(cli.main(sys.argv[1:]))
"""


def test_planted_credentials_appear_nowhere(tiny_model, tmp_path):
    work, private = tmp_path / "work", tmp_path / "private"  # private: the driver and its argv (they hold them)
    work.mkdir()
    private.mkdir()
    out = work / "out"
    argv = ["build", str(SCRIPT), "-o", str(out), "--no-progress", "--set", f"model={tiny_model}",
            "--set", "max_samples=8", "--set", f"backend_options.api_key={API_KEY}",
            "--set", "backend_options.engine_args=" + json.dumps({"api_key": ENGINE_KEY, "tp_size": 1}),
            "--set", f"backend_options.sglang_url=http://hsuser:{URL_PASSWORD}@127.0.0.1:9/",
            "--push", REPO, "--version", "v1.0"]
    (private / "argv.json").write_text(json.dumps(argv))
    (private / "driver.py").write_text(DRIVER)
    with running_hub(work / "hub") as hub, hub_client_env(hub, work / "home", token=TOKEN):
        env = client_subprocess_env(hub, work / "subhome", token=TOKEN)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["HF_HUB_VERBOSITY"] = "debug"
        r = subprocess.run([sys.executable, str(private / "driver.py"), str(private / "argv.json")],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "DEBUG" in r.stderr  # the logs were on
        card = hub.read_file("dataset", REPO, "README.md", "v1.0").decode()
        remote_meta = json.loads(hub.read_file("dataset", REPO, "hs_dataset.json", "v1.0"))
        state = json.dumps(hub.dump_state()) + repr(hub.request_log)
        assert verify_repo(REPO, revision="v1.0", local_dir=work / "download").ok  # a downloaded copy, scanned too

    options = remote_meta["backend"]["options"]
    assert options["api_key"] == "***" and options["engine_args"] == {"api_key": "***", "tp_size": 1}
    assert options["sglang_url"] == "http://***@127.0.0.1:9/" and options["device"] == "cpu"
    assert remote_meta["config"]["backend_options"] == options
    assert "backend_options.api_key=***" in remote_meta["build_command"] and "api_key=***" in card
    texts = {"stdout": r.stdout, "stderr": r.stderr, "card": card, "hub state": state}
    scanned = 0
    for path in sorted(work.rglob("*")):  # the build (state included), the Hub's stored objects, every cache
        if path.is_file():
            texts[str(path)] = path.read_bytes().decode("latin-1")
            scanned += 1
    assert scanned > 20
    for where, text in texts.items():
        for secret in PLANTED:
            assert secret not in text, f"{secret} found in {where}"
    redacted = json.loads((out / ".hs_build" / "redacted.json").read_text())
    assert len(redacted["values"]) == 3 and all(len(v["sha256"]) == 64 for v in redacted["values"])


def test_push_refuses_a_file_holding_a_redacted_value(tiny_model, backend, tmp_path):
    """The build records salted digests of what it redacted; push finds such a value in any file it
    would upload (here pasted into rejects.jsonl by hand) without knowing the value itself."""
    from hs_dataset.write.driver import build
    from tests.fixtures.builds import config

    out = tmp_path / "out"
    build(config(tiny_model, max_samples=4, backend_options={"device": "cpu", "auth": {"password": URL_PASSWORD}}),
          out, backend=backend, progress=False)
    meta = json.loads((out / "hs_dataset.json").read_text())
    assert meta["backend"]["options"]["auth"] == {"password": "***"}
    # pasted into hs_dataset.json by hand: a key verify does not check, so the scan is what refuses it
    meta["notes"] = [f"login with pw {URL_PASSWORD}!"]
    (out / "hs_dataset.json").write_text(json.dumps(meta, indent=1))
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        with pytest.raises(SecretLeakError) as e:
            push_dataset(out, REPO, "v1.0")
        assert hub.dump_state() == {}
    assert "hs_dataset.json" in str(e.value) and "backend_options.auth.password" in str(e.value)
    assert URL_PASSWORD not in str(e.value)
    meta.pop("notes")
    (out / "hs_dataset.json").write_text(json.dumps(meta, indent=1))
    with running_hub(tmp_path / "again") as hub, hub_client_env(hub, tmp_path / "home2", token=TOKEN):
        with pytest.raises(SecretLeakError, match="given to push"):  # and values given to push directly
            push_dataset(out, REPO, "v1.0", secrets=[Path(tiny_model).name])  # in hs_dataset.json


NAME_TOKEN = "hf_" + "NameLooksLikeAToken0123456789AAAA1234"
TOK_PASSWORD = "tokpw-hunter2-91c3"
REV_PASSWORD = "revision-pw-44a0e1"
REV_KEY = "revision-key-7f2b90"


def test_credentials_in_names_and_paths_reach_no_file(tiny_model, backend, tmp_path):
    """A source file named like a token, a tokenizer path holding ``tok_password=...`` and a model revision
    URL with user-info and an ``api_key``: no published byte (shard ids included) and no local record
    holds any of them; the ids use a safe name, and the build says so."""
    import shutil

    from hs_dataset.write.driver import build
    from tests.fixtures.builds import DEMO, config

    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    source = work / "src" / f"{NAME_TOKEN}.jsonl"
    shutil.copy(DEMO, source)
    tokenizer = work / f"tok_password={TOK_PASSWORD}"
    shutil.copytree(tiny_model, tokenizer, ignore=shutil.ignore_patterns("*.safetensors"))
    revision = f"https://hsuser:{REV_PASSWORD}@models.example/m?api_key={REV_KEY}&v=1"
    out = work / "out"
    build(config(tiny_model, source=str(source), max_samples=6, tokenizer=str(tokenizer), model_revision=revision),
          out, backend=backend, progress=False, build_command=f"hs-dataset build demo --set tokenizer={tokenizer}")
    meta = json.loads((out / "hs_dataset.json").read_text())
    assert meta["sample_ids"].startswith("source-") and "credential" in meta["sample_ids"]
    with running_hub(work / "hub") as hub, hub_client_env(hub, work / "home", token=TOKEN):
        push_dataset(out, REPO, "v1.0")
        state = json.dumps(hub.dump_state()) + repr(hub.request_log)
        ids = set(__import__("datasets").load_dataset(REPO, revision="v1.0", split="train",
                                                      cache_dir=str(work / "cache"))["id"])
    assert ids and all(i.startswith("source-") for i in ids)
    texts = {"hub state": state}
    for path in sorted(work.rglob("*")):  # the build (its local records included), the Hub's objects, the caches
        if path.is_file() and path.name != "redacted.json" and not path.is_relative_to(work / "src") \
                and not path.is_relative_to(tokenizer):
            texts[str(path)] = path.read_bytes().decode("latin-1")
    assert len(texts) > 20
    for where, text in texts.items():
        for secret in (NAME_TOKEN, TOK_PASSWORD, REV_PASSWORD, REV_KEY):
            assert secret not in text, f"{secret} found in {where}"


def test_what_counts_as_a_credential():
    for key in ("api_key", "apiKey", "HF_TOKEN", "hf-token", "admin_api_key", "accessToken", "client_secret",
                "password", "db_passwd", "Authorization", "cookie", "credentials", "session_key"):
        assert is_secret_key(key), key
    for key in ("batch_tokens", "max_new_tokens", "token_offsets", "tokenizer", "tp_size", "author", "monkey", "ssl_keyfile",
                "keep_alive", "chunked_prefill_size"):
        assert not is_secret_key(key), key
    clean, found = redact({"a": [{"token": ["x1", {"deep": "x2"}], "n": 3}], "u": "https://x:y@h/p?api_key=z&q=1",
                           "ok": "plain", "auth": {"enabled": True, "count": 2}})
    assert clean == {"a": [{"token": ["***", {"deep": "***"}], "n": 3}], "u": "https://***@h/p?api_key=***&q=1",
                     "ok": "plain", "auth": {"enabled": True, "count": 2}}
    assert sorted(v for _, v in found) == ["x1", "x2", "y", "z"]
    cmd, found = redact_command("HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz hs-dataset build s.py --hf-token T1 "
                                "--set=backend_options.password=T2 --set 'backend_options.engine_args={\"api_key\": \"T3\"}' "
                                "--set backend_options.batch_tokens=8 --api-key=T4")
    assert cmd == ("HF_TOKEN=*** hs-dataset build s.py --hf-token *** --set=backend_options.password=*** --set "
                   "'backend_options.engine_args={\"api_key\": \"***\"}' --set backend_options.batch_tokens=8 "
                   "--api-key=***")
    assert sorted(v for _, v in found) == ["T1", "T2", "T3", "T4", "hf_abcdefghijklmnopqrstuvwxyz"]
    assert split_url_auth("http://u%40x:p%3Aw@127.0.0.1:30000/v1") == ("http://127.0.0.1:30000/v1", "Basic dUB4OnA6dw==")
    assert split_url_auth("http://127.0.0.1:30000") == ("http://127.0.0.1:30000", None)


GLUED_TOKEN = "hf_" + "GluedToAWordAndADigit0123456789abcd"


def test_tokens_next_to_underscores_letters_and_digits_are_redacted_and_never_pushed(tiny_model, backend, tmp_path):
    """A source named ``export_hf_<token>.jsonl``: the token reaches no file of the build; a token-shaped string
    pasted into a file next to other word characters (not a value the build redacted) stops the push."""
    import shutil

    from hs_dataset.redact import redact_text
    from hs_dataset.write.driver import build
    from tests.fixtures.builds import DEMO, config

    for text in (f"export_{GLUED_TOKEN}.jsonl", f"x{GLUED_TOKEN}", f"{GLUED_TOKEN}_v2", f"7{GLUED_TOKEN}"):
        assert GLUED_TOKEN not in redact_text(text)[0], text
    source = tmp_path / f"export_{GLUED_TOKEN}.jsonl"
    shutil.copy(DEMO, source)
    out = tmp_path / "out"
    build(config(tiny_model, source=str(source), max_samples=4), out, backend=backend, progress=False,
          build_command=f"hs-dataset build demo --source {source}")
    for path in sorted(out.rglob("*")):
        if path.is_file():
            assert GLUED_TOKEN.encode() not in path.read_bytes(), path
    pasted = "hf_" + "PastedByHandNextToWords0123456789xyz"
    meta = json.loads((out / "hs_dataset.json").read_text())
    meta["notes"] = [f"see run_{pasted}_final"]  # a key verify does not check: the scan is what refuses it
    (out / "hs_dataset.json").write_text(json.dumps(meta, indent=1))
    with running_hub(tmp_path / "hub") as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        with pytest.raises(SecretLeakError, match="refusing to upload hs_dataset.json: .*shaped like a Hugging Face token"):
            push_dataset(out, REPO, "v1.0")
        assert hub.dump_state() == {}
