"""Shard sizing for many nodes: the plan and the card say what a version's shards cost at several world sizes."""

from __future__ import annotations

from hs_dataset.write.card import render_card
from hs_dataset.write.shard_sizing import fetch_factor, many_nodes_section, shards_for, sizing_rows
from tests.fixtures.builds import DEMO
from tests.fixtures.cli import SCRIPT, run


def test_enough_shards_keep_an_epoch_within_five_percent_of_the_version():
    for w in (2, 8, 64, 256):
        s = shards_for(w)
        assert fetch_factor(s, w) <= 1.05 < fetch_factor(s - 1, w)
    assert fetch_factor(10, 1) == 1.0 and fetch_factor(4, 64) == 2.0  # more ranks than shards: each fetched twice
    rows = sizing_rows(1 << 40, 512 << 20, world_sizes=(8, 256))
    assert rows[0][1] == "<= 1.003x the version" and rows[1][2].endswith("MiB")


def test_the_card_and_the_plan_say_how_to_size_shards(tiny_model):
    meta = {"shards": [{"name": f"train-{i:05d}-000.arrow", "bytes": 100 << 20, "rows": 10} for i in range(40)]}
    section = many_nodes_section(meta, "org/name", "v1.0")
    assert "40 shards, the largest 100.0 MiB" in section and "| 64 | <= 2.000x the version |" in section
    assert "open_ranked(\"org/name\", revision=\"v1.0\"" in section
    card = render_card({**meta, "config": {}}, {"repo_id": "org/name", "version": "v1.0"})
    assert "### Training on many nodes" in card and section in card
    r = run("plan", SCRIPT, "--model", tiny_model, "--source", str(DEMO), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "many nodes (open_ranked" in r.stdout and "largest shard for <= 5%" in r.stdout
