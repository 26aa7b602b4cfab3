"""scripts/plot_kda.py draws a PNG from bench JSON (CPU; skipped without matplotlib)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plot_from_bench_json(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import plot_kda

    rows = [
        dict(H=H, B=B, T=T, auto_us=5.0 + B, wide_us=6.0 + B, stream_us=7.0 + B,
             split2_us=4.0 + B, split4_us=None, split8_us=3.5 + B, fla_us=10.0 + B,
             composed_us=15.0 + B if T == 1 else None)
        for H in (6, 12) for T in (1, 4) for B in (1, 2, 4, 8)
    ]  # fmt: skip
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"copy_tbs": 4.16, "rows": rows}))
    out = tmp_path / "plot.png"
    assert plot_kda.main([str(src), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(plot_kda.panels(rows)) == {(6, 1), (6, 4), (12, 1), (12, 4)}
