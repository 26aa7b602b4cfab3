"""CPU tests of the rows benchmark's plain parts: the measured crossovers it writes are
what ``choose`` reads, and the floor is the larger of the bandwidth and GEMM bounds."""

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import oproj_rows  # noqa: E402

from tpcomm.oproj import plan  # noqa: E402


def _rows(tp, points):
    return [dict(tp=tp, rows=r, twoshot_chunks_us=t, oneshot_chunks_us=o) for r, t, o in points]


def test_crossovers_need_twoshot_faster_from_there_on():
    rows = _rows(8, [(1, 5, 4), (32, 9, 10), (128, 20, 30), (1024, 50, 90)])
    rows += _rows(16, [(1, 5, 4), (32, 11, 10), (128, 20, None)])  # one side did not run
    rows += _rows(4, [(1, 3, 4), (32, 12, 10)])  # faster at 1 row only: no crossover
    assert oproj_rows.crossovers(rows) == {"4": None, "8": 32, "16": None}


def test_written_crossovers_drive_choose(tmp_path):
    path = tmp_path / "crossovers.json"
    shutil.copy(plan.CROSSOVERS, path)
    rows = _rows(8, [(8, 9, 10), (64, 5, 9)]) + _rows(16, [(8, 12, 10), (64, 5, 9)])
    oproj_rows.write_crossovers(rows, "H200 test", path=str(path))
    data = plan.load_crossovers(str(path))
    assert data["twoshot_from_rows"] == {"8": 8, "16": 64} and "H200 test" in data["source"]
    assert json.loads(path.read_text())["expected_from_rows"] == {"8": 4, "16": 4}
    assert plan.choose(16, 64, 7168, crossovers=data).twoshot
    assert not plan.choose(16, 32, 7168, crossovers=data).twoshot


def test_floor_is_the_larger_bound():
    bw = oproj_rows.floor_us(8, 1, 7168, 8, 1536, 0, 4.0, 1e9)  # GEMM rate unbounded
    assert abs(bw - 8 * (7168 * 1536 * 2 + 1536 * 2 + 11 * 7168 * 2) / 4e6) < 1e-9
    flops = oproj_rows.floor_us(8, 1024, 7168, 8, 1536, 0, 1e9, 1.0)  # bandwidth unbounded
    assert abs(flops - 2 * 8 * 1024 * 7168 * 1536 / 1e6) < 1e-6


def test_plot_rows(tmp_path):
    import plot_rows

    rows = [dict(tp=tp, rows=r, ours_us=10.0 * r, peer_us=None if r > 8 else 30.0 * r,
                 floor_us=5.0 * r) for tp in (8, 16) for r in (1, 8, 32)]  # fmt: skip
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"device": "test", "rows": rows}))
    got = plot_rows.lines(rows)
    assert got[(8, "peer_us")] == [(1, 30.0), (8, 240.0)] and len(got[(16, "ours_us")]) == 3
    out = tmp_path / "rows.png"
    assert plot_rows.main([str(path), "--oproj", str(path), "--out", str(out)]) == 0
    assert out.stat().st_size > 0
