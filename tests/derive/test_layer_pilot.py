"""The layer pilot view: per captured layer, norm and similarities, against a direct computation."""

from __future__ import annotations

import pytest
import torch

from hs_dataset.cli import main
from hs_dataset.derive.layer_pilot import layer_pilot
from hs_dataset.read.iterate import iter_torch
from hs_dataset.read.open import open_dataset
from hs_dataset.write.driver import build
from tests.fixtures.builds import config

LAYERS = (0, 1, 2, 3)


def test_layer_statistics_of_a_pilot_build(tiny_model, tmp_path, capsys):
    out = tmp_path / "pilot"
    build(config(tiny_model, max_samples=6, layers=LAYERS), out, progress=False)
    got = layer_pilot(out, rows=32)
    assert [s.layer for s in got] == list(LAYERS) and got[0].cos_prev is None
    sums = {k: [0.0, 0.0, 0.0] for k in LAYERS}
    n = 0
    for row in iter_torch(open_dataset(out)):
        m = row["loss_mask"].bool()
        final = row["hidden_final"][m].float()
        n += int(m.sum())
        for j, k in enumerate(LAYERS):
            x = row[f"hidden_layer_{k}"][m].float()
            sums[k][0] += float(x.norm(dim=-1).sum())
            sums[k][1] += float(torch.cosine_similarity(x, final, dim=-1).sum())
            if j:
                prev = row[f"hidden_layer_{LAYERS[j - 1]}"][m].float()
                sums[k][2] += float(torch.cosine_similarity(x, prev, dim=-1).sum())
    for s in got:
        assert s.norm == pytest.approx(sums[s.layer][0] / n, rel=1e-5)
        assert s.cos_final == pytest.approx(sums[s.layer][1] / n, abs=1e-5)
        if s.cos_prev is not None:
            assert s.cos_prev == pytest.approx(sums[s.layer][2] / n, abs=1e-5)
    capsys.readouterr()
    assert main(["inspect", str(out), "--layers"]) == 0
    text = capsys.readouterr().out
    assert "cos to final" in text and "cos to previous" in text
