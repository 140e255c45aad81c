"""Shared test helpers for the Hub publishing tests.

* :func:`hub_client_env` points the real ``huggingface_hub`` / ``datasets`` clients of *this*
  process at a local :class:`tests.fakehub.server.HubServer` (and at throw-away caches).
* :func:`client_subprocess_env` gives the environment for a client running in a subprocess.
* :func:`write_built_dataset` writes a directory laid out like the builder's output
  (README.md with ``configs:``/``dataset_info:``, hs_dataset.json with the shards' checksums,
  data/*.arrow, rejects.jsonl, .hs_build/), with ``datasets``' own ArrowWriter.
* :func:`build_with_real_builder` is the hook for the end-to-end test once the builder lands.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

HIDDEN = 8
LAYERS = (3, 31, 59)


# ------------------------------------------------------------------------------- client wiring


def run_killed_client(hub, home: str | os.PathLike, script: str, token: str | None = None) -> None:
    """Run ``script`` (Python that kills itself with SIGKILL part-way) as a client of ``hub`` in a subprocess
    that imports this checkout, and check that it died by SIGKILL."""
    import signal
    import subprocess
    import sys

    env = client_subprocess_env(hub, home, token)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()[-2000:]


def client_subprocess_env(hub, home: str | os.PathLike, token: str | None = None) -> dict[str, str]:
    """Environment for a subprocess whose huggingface_hub/datasets must talk to ``hub`` only."""
    home = Path(home)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HUB_DISABLE_XET="1",
        HF_HOME=str(home),
        HF_HUB_CACHE=str(home / "hub"),
        HF_DATASETS_CACHE=str(home / "datasets"),
        HF_TOKEN_PATH=str(home / "token"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="0",
        HF_HUB_OFFLINE="0",
        HF_DATASETS_OFFLINE="0",
        NO_PROXY="127.0.0.1,localhost",
    )
    if token is not None:
        env["HF_TOKEN"] = token
    return env


@contextlib.contextmanager
def hub_client_env(hub, home: str | os.PathLike, token: str | None = None) -> Iterator[None]:
    """Point this process's huggingface_hub + datasets at ``hub`` and at caches under ``home``.

    ``huggingface_hub.constants`` and ``datasets.config`` read ``HF_ENDPOINT``/cache paths at
    import time, so besides the environment (for code that reads it later and for subprocesses)
    the derived module attributes are patched, and restored on exit.
    """
    import datasets.config as dconfig
    import huggingface_hub.constants as hconst
    from huggingface_hub import HfFileSystem

    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    env = client_subprocess_env(hub, home, token)
    endpoint = hub.endpoint
    patches: list[tuple[Any, str, Any]] = [
        (hconst, "ENDPOINT", endpoint),
        (hconst, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"),
        (hconst, "HF_URL_HOSTS", frozenset(set(hconst.HF_URL_HOSTS) | {"127.0.0.1"})),
        (hconst, "HF_HUB_DISABLE_XET", True),
        (hconst, "HF_HOME", str(home)),
        (hconst, "HF_HUB_CACHE", str(home / "hub")),
        (hconst, "HUGGINGFACE_HUB_CACHE", str(home / "hub")),
        (hconst, "HF_ASSETS_CACHE", str(home / "assets")),
        (hconst, "HF_XET_CACHE", str(home / "xet")),
        (hconst, "HF_TOKEN_PATH", str(home / "token")),
        (hconst, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens")),
        (hconst, "HF_HUB_OFFLINE", False),
        (hconst, "HF_HUB_DISABLE_PROGRESS_BARS", True),
        (hconst, "AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json")),
        (dconfig, "HF_ENDPOINT", endpoint),
        (dconfig, "HUB_DATASETS_URL", endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}"),
        (dconfig, "HF_CACHE_HOME", str(home)),
        (dconfig, "HF_DATASETS_CACHE", home / "datasets"),
        (dconfig, "HF_MODULES_CACHE", home / "modules"),
        (dconfig, "DOWNLOADED_DATASETS_PATH", home / "datasets" / "downloads"),
        (dconfig, "EXTRACTED_DATASETS_PATH", home / "datasets" / "downloads" / "extracted"),
        (dconfig, "HF_HUB_OFFLINE", False),
        (dconfig, "HF_DATASETS_OFFLINE", False),
    ]
    saved_attrs = [(mod, name, getattr(mod, name, None), hasattr(mod, name)) for mod, name, _ in patches]
    env_keys = set(env) | {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}
    saved_env = {k: os.environ.get(k) for k in env_keys}
    try:
        for mod, name, value in patches:
            setattr(mod, name, value)
        for k in env_keys:
            if k in env:
                os.environ[k] = env[k]
            else:
                os.environ.pop(k, None)
        HfFileSystem.clear_instance_cache()
        yield
    finally:
        for mod, name, value, existed in saved_attrs:
            if existed:
                setattr(mod, name, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        HfFileSystem.clear_instance_cache()


# ------------------------------------------------------------------------------ built datasets


def features():
    """The builder's own schema for LAYERS at HIDDEN in bf16 (hs_dataset.codec.encode.make_features)."""
    from hs_dataset.codec.encode import make_features

    return make_features(LAYERS, HIDDEN)


def make_rows(n: int, *, start: int = 0, seed: int = 0) -> list[dict]:
    """Deterministic rows: row ``i`` depends only on (i, seed); lengths vary from 3 to 9 tokens."""
    rows = []
    for i in range(start, start + n):
        rng = np.random.default_rng([seed, i])
        length = 3 + (i * 7 + seed) % 7
        row: dict[str, Any] = {
            "id": f"sample-{i:06d}",
            "input_ids": rng.integers(0, 50_000, size=length, dtype=np.int32).tolist(),
            "loss_mask": rng.integers(0, 2, size=length, dtype=np.uint8).tolist(),
            "num_tokens": length,
        }
        for column in [f"hidden_layer_{layer}" for layer in LAYERS] + ["hidden_final"]:
            # any uint16 bit pattern, including NaN/inf bfloat16 encodings: must survive bit-exactly
            row[column] = rng.integers(0, 65536, size=(length, HIDDEN), dtype=np.uint16)
        rows.append(row)
    return rows


def _readme(metadata: dict, n_rows: int, num_bytes: int) -> str:
    from hs_dataset.write.card import readme_header

    return readme_header(metadata, n_rows, num_bytes, "arrow") + "\n# Hidden states (built locally)\n\nBuilt by hs_dataset.\n"


def write_built_dataset(
    out_dir: str | os.PathLike,
    rows: list[dict],
    *,
    shard_rows: int = 8,
    rejected: int = 1,
    build_command: str = "hs-dataset build --model /models/tiny --layers 3,31,59 --out DIR",
    model_path: str = "/models/tiny-llama",
    extra_metadata: dict | None = None,
) -> Path:
    """Write a finished build directory with ``rows`` split into shards of ``shard_rows``."""
    from datasets.arrow_writer import ArrowWriter

    from hs_dataset.integrity.checksums import shard_entry

    out = Path(out_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
    (out / ".hs_build").mkdir(exist_ok=True)
    feats = features()
    shards = [rows[i:i + shard_rows] for i in range(0, len(rows), shard_rows)] or [[]]
    total_bytes = 0
    entries = []
    for k, shard in enumerate(shards):
        path = out / "data" / f"train-{k:05d}-{len(shards):05d}.arrow"
        with ArrowWriter(features=feats, path=str(path)) as writer:
            batch = {name: [r[name] for r in shard] for name in feats}
            writer.write_batch(batch)
            writer.finalize()
        total_bytes += path.stat().st_size
        entries.append(shard_entry(path))  # what the builder records: size, rows, content hash
    tokens = sum(len(r["input_ids"]) for r in rows)
    metadata = {
        "format_version": 1,
        "model": {"path": model_path, "revision": "0123456789abcdef0123456789abcdef01234567",
                  "architecture": "LlamaForCausalLM", "hidden_size": HIDDEN, "num_layers": 64},
        "layers": list(LAYERS),
        "layer_convention": "index i = output of decoder layer i (0-based); embeddings are not included",
        "storage_dtype": "bfloat16",
        "stored_as": "uint16 bits",
        "decode": "hs_dataset.read.decode_hidden(row['hidden_layer_3'])",
        "tokenizer": {"path": model_path, "chat_template_sha256": "ab" * 32},
        "max_length": 2048,
        "counts": {"samples_in": len(rows) + rejected, "written": len(rows), "rejected": rejected,
                   "tokens_written": tokens},
        "bytes": total_bytes,
        "backend": {"name": "sglang", "versions": {"sglang": "0.5.11", "torch": "2.13.0", "datasets": "5.2.0"}},
        "build_command": build_command,
        "columns": [c for c in feats if c.startswith("hidden_")],
        "shards": entries,
    }
    metadata.update(extra_metadata or {})
    (out / "hs_dataset.json").write_text(json.dumps(metadata, indent=2) + "\n")
    (out / "README.md").write_text(_readme(metadata, len(rows), total_bytes))
    with open(out / "rejects.jsonl", "w") as f:
        for j in range(rejected):
            f.write(json.dumps({"id": f"rejected-{j}", "reason": "too_long", "length": 4096}) + "\n")
    (out / ".hs_build" / "state.json").write_text(json.dumps({"done": True, "next_shard": len(shards)}))
    return out


def expected_table(rows: list[dict]):
    """The Arrow table ``datasets`` should hand back for ``rows`` (same features, one chunk)."""
    from datasets import Dataset

    return Dataset.from_dict({k: [r[k] for r in rows] for k in features()}, features=features()).data.table


def build_with_real_builder(out_dir: str | os.PathLike, *, max_samples: int = 12, layers: tuple[int, ...] = (0, 1, 2),
                            source: str | os.PathLike | None = None, model_dir: str | os.PathLike | None = None,
                            build_command: str = "hs-dataset build (e2e test)", **config: Any) -> Path:
    """End-to-end hook: build ``out_dir`` with the project's real builder (tiny random Llama, CPU)."""
    from hs_dataset.write.driver import build
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.demo.tiny import make_tiny_model_dir

    root = Path(__file__).resolve().parents[2]
    source = Path(source or root / "builder_scripts" / "data" / "demo_conversations.jsonl")
    out = Path(out_dir)
    model = make_tiny_model_dir(Path(model_dir or out.parent / "tiny-model"), template="chatml", seed=0)
    cfg = HiddenStatesConfig(model=str(model), layers=tuple(layers), source=str(source), max_length=256, part_size=8,
                             max_samples=max_samples, backend_options={"device": "cpu", "batch_tokens": 2048}, **config)
    build(cfg, out, progress=False, build_command=build_command)
    return out
