"""benchmarks/marginal_cost.py on two recorded H200 runs (4 and 32 Flash layers): the per-layer cost
docs/performance.md states (0.231 ms at batch 1, 3.8x its floor), computed here from the raw files by hand too."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import marginal_cost  # noqa: E402

SHALLOW = os.path.join(ROOT, "docs/bench/h200_2026-12-03_s8_flash4.json")
DEEP = os.path.join(ROOT, "docs/bench/h200_2026-12-03_s8_flash32_scan.json")


def _decode(path, batch):
    with open(path) as f:
        return next(d for d in json.load(f)["decode"] if d["batch"] == batch and d["context"] == 4096)


def test_per_layer_cost_of_the_recorded_depth_runs(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert marginal_cost.main([SHALLOW, DEEP, "--project", "43", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["layers"] == [4, 32] and result["program_options_differ"] == {"scan_layers": [False, True]}
    rows = {r["batch"]: r for r in result["decode"]}
    assert set(rows) == {1, 8}
    a, b = _decode(SHALLOW, 1), _decode(DEEP, 1)
    per_layer = (b["ms_per_step"] - a["ms_per_step"]) / 28
    assert rows[1]["ms_per_layer"] == pytest.approx(per_layer, rel=1e-12)
    assert round(rows[1]["ms_per_layer"], 3) == 0.231 and round(rows[1]["times_floor"], 1) == 3.8
    assert rows[1]["projected_ms"] == pytest.approx(a["ms_per_step"] + 39 * per_layer, rel=1e-12)
    assert "| 1 | 4096 | 1.229 | 7.704 | 0.231 |" in capsys.readouterr().out


def test_refuses_the_wrong_order_and_other_files(tmp_path):
    with pytest.raises(ValueError, match="more layers than the first"):
        marginal_cost.main([DEEP, SHALLOW])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a dsv4_jax.bench result"):
        marginal_cost.main([str(bad), DEEP])
