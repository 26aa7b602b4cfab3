"""scripts/plot_kda_grid.py: the grid's series from bench JSON (CPU) and its PNG (skipped
without matplotlib)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import plot_kda_grid  # noqa: E402

COPY = 4.0  # TB/s


def row(H, B, T, us, fla_us=None, dtype="fp32"):
    state = B * H * (1 + T) * 128 * 128 * (4 if dtype == "fp32" else 2)
    tbs = state / (us * 1e-6) / 1e12
    r = dict(H=H, B=B, T=T, state_dtype=dtype, state_bytes=state, auto_us=us, state_tbs=tbs)
    return dict(r, pct_copy=100 * tbs / COPY, fla_us=fla_us)


ROWS = [
    dict(row(6, 32, 1, 20.0, 10.0), sglang_us=16.0, sglang_pct_copy=31.25),
    row(6, 1, 1, 5.0),
    row(96, 32, 1, 100.0, 200.0),
    row(6, 32, 4, 50.0),
    row(6, 32, 1, 10.0, dtype="bf16"),
]
REPLAY = [dict(H=6, B=32, T=1, R=4, pct_copy=50.0), dict(H=6, B=32, T=2, R=4, pct_copy=1.0)]


def test_series_by_tokens_and_heads():
    panels = plot_kda_grid.series(ROWS, REPLAY)
    assert list(panels) == [1, 4]
    one = panels[1]
    assert [x for x, _ in one["ours"][6]] == [6, 192]  # sorted by items
    assert one["ours"][96][0] == (3072, pytest.approx(ROWS[2]["pct_copy"]))
    # fla's % of copy: its time over our bytes, at the run's copy bandwidth
    assert one["fla"][6] == [(192, pytest.approx(2 * ROWS[0]["pct_copy"]))]
    assert one["fla"][96] == [(3072, pytest.approx(0.5 * ROWS[2]["pct_copy"]))]
    assert one["sglang"] == {6: [(192, 31.25)]}  # the peer where the run timed it
    assert one["replay"] == {(6, 4): [(192, 50.0)]}  # T 2 has no per-step panel: dropped
    bf16 = plot_kda_grid.series(ROWS, REPLAY, "bf16")
    assert list(bf16) == [1] and bf16[1]["ours"] == {6: [(192, ROWS[4]["pct_copy"])]}


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(dict(rows=ROWS, replay_rows=REPLAY)))
    out = tmp_path / "grid.png"
    plot_kda_grid.main([str(path), "--out", str(out)])
    assert out.stat().st_size > 1000
    fp32_only = tmp_path / "fp32.json"
    fp32_only.write_text(json.dumps(dict(rows=ROWS[:4])))
    with pytest.raises(SystemExit):  # no bf16 rows to plot
        plot_kda_grid.main([str(fp32_only), "--out", str(out), "--state-dtype", "bf16"])
