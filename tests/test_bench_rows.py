"""CPU tests of the rows benchmark's plain parts: the measured crossovers it writes are
what ``choose`` reads, and the floor is the larger of the bandwidth and GEMM bounds; the
MoE copies' rows count the copies' bytes and the 1.1x target."""

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import oproj_rows  # noqa: E402
import oproj_xmoe  # noqa: E402

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
    oproj_rows.write_crossovers(rows, "H200 test", path=str(path), date="2026-11-30")
    data = plan.load_crossovers(str(path))
    assert data["twoshot_from_rows"] == {"8": 8, "16": 64} and "H200 test" in data["source"]
    assert "2026-11-30" in data["source"] and "per-rank launches" in data["source"]
    assert data["one_launch"]["twoshot"] is False  # no oneshot_1l measured: not "fastest"
    assert data["one_launch"]["fastest"]["8"] == dict(rows=[8, 64], fastest=False)
    assert json.loads(path.read_text())["expected_from_rows"] == {"8": 4, "16": 4}
    assert plan.choose(16, 64, 7168, crossovers=data).twoshot
    assert not plan.choose(16, 32, 7168, crossovers=data).twoshot


def test_one_launch_fastest_needs_every_row():
    rows = _rows(8, [(1, 5, 4), (32, 9, 10)]) + _rows(16, [(1, 5, 4), (32, 9, 10)])
    for r, ours in zip(rows, (3.0, 8.0, 3.0, 9.5), strict=True):  # TP 16 x 32: 9.5 > 9
        r["oneshot_1l_us"] = ours
    rows[1]["twoshot_chunks_us"] = None  # a variant that did not run is beaten
    got = oproj_rows.one_launch_fastest(rows)
    assert got == {"8": dict(rows=[1, 32], fastest=True), "16": dict(rows=[1, 32], fastest=False)}


def test_committed_crossovers_are_the_measured_rows():
    """tpcomm/oproj/crossovers.json is what write_crossovers makes of docs/data's H200 rows:
    twoshot (chunks) from TP 8 x 8 and TP 16 x 4 rows, and one launch (one-shot, the
    launcher's loopback path) faster than both chunked variants at every measured row."""
    root = os.path.dirname(os.path.dirname(__file__))
    rows = []
    for tp in (8, 16):
        with open(os.path.join(root, "docs", "data", f"oproj_rows_tp{tp}.json")) as f:
            rows += json.load(f)["rows"]
    data = plan.load_crossovers()
    assert data["twoshot_from_rows"] == oproj_rows.crossovers(rows) == {"8": 8, "16": 4}
    assert data["one_launch"]["fastest"] == oproj_rows.one_launch_fastest(rows)
    assert all(f["fastest"] for f in data["one_launch"]["fastest"].values())
    for r in rows:  # what the plan now picks per path is the faster measured option
        assert not plan.choose(r["tp"], r["rows"], r["hid"], one_launch=True).twoshot
        per_rank = plan.choose(r["tp"], r["rows"], r["hid"]).twoshot
        assert per_rank == (r["twoshot_chunks_us"] < r["oneshot_chunks_us"]), r["rows"]


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


def test_plot_rows_one_file_per_tp_and_a_panel_per_tokens(tmp_path):
    """bench_decode --rows files of TP 8 and TP 16 on one plot: a decode panel (T = 1) and a
    verify panel (T = 4, no peer), then the o-projection panel from two --oproj files."""
    import plot_rows

    paths, oproj = [], []
    for tp in (8, 16):
        rows = [dict(tp=tp, requests=b, tokens=t, rows=b * t, ours_us=float(b * t + tp),
                     peer_us=3.0 * b if t == 1 else None, floor_us=0.5 * b * t)
                for t in (1, 4) for b in (1, 8)]  # fmt: skip
        paths.append(tmp_path / f"dec{tp}.json")
        paths[-1].write_text(json.dumps({"device": "test", "rows": rows}))
        oproj.append(tmp_path / f"oproj{tp}.json")
        oproj[-1].write_text(json.dumps({"device": "test", "rows": [
            dict(tp=tp, rows=r, ours_us=2.0 * r, peer_us=5.0 * r, floor_us=1.0 * r)
            for r in (1, 32)]}))  # fmt: skip
    shown = plot_rows.panels([str(p) for p in paths], [str(p) for p in oproj])
    assert [len(rows) for _, rows, _ in shown] == [4, 4, 4]
    assert "T = 1" in shown[0][0] and "T = 4" in shown[1][0] and "peer: T = 1 only" in shown[1][0]
    assert {r["tp"] for r in shown[1][1]} == {8, 16} and "o-projection" in shown[2][0]
    got = plot_rows.lines(shown[0][1])
    assert list(got) == [(8, "ours_us"), (8, "peer_us"), (8, "floor_us"),
                         (16, "ours_us"), (16, "peer_us"), (16, "floor_us")]  # fmt: skip
    assert (8, "peer_us") not in plot_rows.lines(shown[1][1])
    out = tmp_path / "rows.png"
    argv = [*map(str, paths), "--oproj", *map(str, oproj), "--out", str(out)]
    assert plot_rows.main(argv) == 0 and out.stat().st_size > 0


def test_xmoe_rows_target(capsys):
    """The copies' bytes: the consumer's stores, the reader's loads and stores (TP 8, 128
    rows, 2 copies: 29.4 MB stored, as in issue 33); the target is 1.1 x (no copies + those
    bytes at the run's bandwidth), and a row past it prints MISSED."""
    assert oproj_xmoe.copy_bytes(8, 128, 7168, 2) == 3 * 29_360_128
    rows = []

    def fake_stage(tp, rows_, hid, nb, reps, iters, repeats, *, waiter=True):
        return (100.0 if reps == 0 else 130.0 if waiter else 108.0), 5.0, ""

    real, oproj_xmoe.stage_us = oproj_xmoe.stage_us, fake_stage
    try:
        out = oproj_xmoe.sweep([8], [128], 7168, 8, 2, 1, 1, 4.0, on_row=rows.append)
    finally:
        oproj_xmoe.stage_us = real
    (r,) = out
    assert r["copy_us"] == 3 * 29_360_128 / 4e6
    assert r["target_us"] == 1.1 * (100.0 + r["copy_us"])
    assert r["met"] == (r["target_us"] >= 130.0) and r["consumer_only_us"] == 108.0
    assert ("met" if r["met"] else "MISSED") in capsys.readouterr().out


def test_rows_sweep_times_cublas_beside_the_plans_producer(monkeypatch, capsys):
    """cuBLAS + publisher is timed beside the plan's producer where that is another one:
    mma.sync up to 8 rows, wgmma above on sm_90 (elsewhere the plan's is cuBLAS)."""
    kinds = []

    def fake_variant(tp, rows, hid, nb, a, iters, repeats, kind):
        kinds.append((rows, kind))
        return 10.0 + len(kind), rows

    monkeypatch.setattr(oproj_rows, "gemm_tflops", lambda: 800.0)
    monkeypatch.setattr(oproj_rows, "inputs", lambda *args: None)
    monkeypatch.setattr(oproj_rows, "_variant", fake_variant)
    monkeypatch.setattr(oproj_rows, "peer_us", lambda *args: 99.0)
    monkeypatch.setattr(oproj_rows.torch.cuda, "empty_cache", lambda: None)
    for sm90 in (True, False):
        kinds.clear()
        monkeypatch.setattr(oproj_rows, "wgmma_device", lambda sm90=sm90: sm90)
        out, _ = oproj_rows.sweep([8], [4, 64], 7168, 8, 96, 1, 1, 4.0)
        assert [k for r, k in kinds if r == 4] == [
            "oneshot_1l", "oneshot_1l_cublas", "oneshot_chunks", "twoshot_chunks"
        ]  # fmt: skip
        assert ("oneshot_1l_cublas" in [k for r, k in kinds if r == 64]) == sm90
        assert out[1]["plan"]["producer"] == ("wgmma" if sm90 else "cublas")
        assert out[1]["best_us"] == 10.0 + len("oneshot_1l")
    assert "cuBLAS 1l" in capsys.readouterr().out
