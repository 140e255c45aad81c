"""The dataset card says where the data came from, under which license, and which layer ids a drafter's
config needs on each engine (each counts the layers its own way)."""

from __future__ import annotations

import yaml

from hs_dataset.integrity.verify import verify_build
from hs_dataset.write.card import readme_header, render_card, split_readme
from hs_dataset.write.driver import build
from tests.fixtures.builds import config

KIMI = {"model": {"path": "/models/Kimi-K2.5", "architecture": "KimiK25ForConditionalGeneration", "hidden_size": 7168,
                  "num_layers": 61, "vocab_size": 163840},
        "layers": [3, 31, 59], "source": "/data/conversations.jsonl", "sample_ids": "conversations:<row index>",
        "counts": {"written": 10}, "config": {"license": "other", "file_format": "arrow"}}


def _front(card: str) -> dict:
    return yaml.safe_load(split_readme(card)[0].strip().strip("-"))


def test_the_card_names_the_source_the_license_and_each_engines_layer_ids():
    card = render_card(KIMI, {"repo_id": "org/kimi-eagle3-hs", "version": "v1.0"})
    assert _front(card)["license"] == "other"
    assert "| source | `/data/conversations.jsonl` (sample ids: conversations:<row index>) |" in card
    assert "| license | `other` |" in card
    assert "| SGLang | `eagle_config.eagle_aux_hidden_state_layer_ids` | `[4, 32, 60]` |" in card
    assert "| vLLM, speculators (`--target-layer-ids`) | `eagle_aux_hidden_state_layer_ids` | `[4, 32, 60]` |" in card
    assert "| SpecForge | `aux_hidden_state_layer_ids` | `[4, 32, 60]` |" in card
    assert "| ModelOpt | `eagle_aux_hidden_state_layer_ids` | `[3, 31, 59]` |" in card
    llama = dict(KIMI, model=dict(KIMI["model"], architecture="LlamaForCausalLM"))
    assert "| SGLang | `eagle_config.eagle_aux_hidden_state_layer_ids` | `[3, 31, 59]` |" in render_card(llama, {})


def test_a_build_made_before_the_license_field_keeps_its_front_matter():
    old = dict(KIMI, config={"file_format": "arrow"})
    assert "license" not in _front(readme_header(old, 10, 0, "arrow"))  # what such a build wrote: it still verifies
    assert "| license | `not recorded` |" in render_card(old, {})


def test_a_build_records_its_license_and_its_card_verifies(tiny_model, tmp_path):
    out = tmp_path / "out"
    build(config(tiny_model, max_samples=4, license="apache-2.0"), out, progress=False)
    readme = (out / "README.md").read_text()
    assert _front(readme)["license"] == "apache-2.0" and "| license | `apache-2.0` |" in readme
    assert "| ModelOpt | `eagle_aux_hidden_state_layer_ids` | `[0, 1, 2]` |" in readme
    assert verify_build(out).ok
