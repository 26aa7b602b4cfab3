"""scripts/plot_decode.py on two synthetic reports (CPU; skipped without matplotlib)."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location(
        "plot_decode", os.path.join(ROOT, "scripts", "plot_decode.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(path, tp, requests, median, backend="loopback"):
    config = dict(backend=backend, tp=tp, hidden=7168, heads=96, tokens=1, requests=requests)
    if backend == "host":
        latency = {"step": {"median_ms": median / 1e3, "p99_ms": median * 1.2 / 1e3}}
    else:
        latency = {"step": {"median_us": median, "p99_us": median * 1.1, "max_us": median * 2}}
    path.write_text(json.dumps({"config": config, "latency": latency, "ok": True}))
    return str(path)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _script()
    a = _report(tmp_path / "a.json", 8, 4, 30.0)
    b = _report(tmp_path / "b.json", 16, 8, 25.0)
    c = _report(tmp_path / "c.json", 2, 4, 900.0, backend="host")
    series = plot.load([a, b, c])
    assert series[("loopback", 16, 7168, 96, 1)] == [(8, 25.0, 25.0 * 1.1)]
    assert series[("host", 2, 7168, 96, 1)][0][1] == pytest.approx(900.0)
    out = tmp_path / "plots" / "latency.png"
    assert plot.main([a, b, c, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_the_row_fails(tmp_path):
    plot = _script()
    a = _report(tmp_path / "a.json", 8, 4, 30.0)
    assert plot.main([a, "--kind", "verify", "--out", str(tmp_path / "x.png")]) == 1
