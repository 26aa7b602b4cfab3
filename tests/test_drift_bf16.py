"""scripts/drift_bf16.py on a tiny config: the JSON's schema, the committed study's schema,
and the first step's contract (zero state in: the bf16 run's first outputs are the fp32
run's; only the stored pages differ). CPU; the plot is skipped without matplotlib."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "drift_bf16.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import drift_bf16  # noqa: E402

SERIES = set(drift_bf16.SERIES)


def check_schema(data, steps):
    assert set(data) == {"command", "date", "parameters", "summary", "series"}
    assert data["command"].startswith("python scripts/drift_bf16.py")
    p = data["parameters"]
    assert p["steps"] == steps and p["tokens"] == 1 and p["lower_bound"] == -5.0
    assert {"heads", "requests", "seed", "initial_state", "layer", "torch"} <= set(p)
    series = data["series"]
    assert set(series) == SERIES | {"step"}
    assert series["step"] == list(range(1, steps + 1))
    for name in SERIES:
        values = series[name]
        assert len(values) == steps and all(v >= 0 and v == v for v in values), name
    assert set(data["summary"]["1"]) == SERIES and "max" in data["summary"]


def test_tiny_run_writes_the_schema(tmp_path):
    out, png = tmp_path / "drift.json", tmp_path / "drift.png"
    plot = str(png) if _has_matplotlib() else ""
    argv = ["--steps", "24", "--heads", "1", "--requests", "2", "--json", str(out), "--plot", plot]
    subprocess.run([sys.executable, SCRIPT, *argv], check=True, cwd=ROOT, capture_output=True)
    data = json.loads(out.read_text())
    check_schema(data, 24)
    first = data["summary"]["1"]
    assert first["out_max_abs"] == 0 and first["out_mismatch"] == 0  # zero pages read
    assert 0 < first["state_rel_fro"] < 2**-7  # one rounding of the stored pages
    assert max(data["series"]["out_max_abs"]) > 0  # later steps read rounded pages
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_study_has_the_schema():
    path = os.path.join(ROOT, "docs", "data", "drift_bf16.json")
    if not os.path.exists(path):
        pytest.skip("docs/data/drift_bf16.json not generated")
    with open(path) as f:
        data = json.load(f)
    check_schema(data, data["parameters"]["steps"])
    assert data["parameters"]["steps"] >= 4096


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
