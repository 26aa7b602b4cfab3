"""CPU tests of ``scripts/bench_rank.py`` (one rank's chain alone, stage by stage) with
fake timings: the bytes and floors per stage, the targets, the sweep's JSON and table, the
options, and ``plot_rank.py`` on the
JSON (skipped without matplotlib)."""

import argparse
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import bench_decode  # noqa: E402
import bench_rank  # noqa: E402

from launch.bucket import oproj_plan  # noqa: E402

MB = 1 << 20
TBPS, TFLOPS = 4.0, 800.0


def _cfg(tp, requests, tokens=1):
    args = argparse.Namespace(
        heads=96, hidden=7168, blocks=8, kda_state="per-step", ring=4, state_dtype="fp32"
    )
    return bench_decode._config(tp, requests, args, tokens)


def test_stage_bytes_one_shot_and_twoshot():
    state = 8 * 96 * 2 * 128 * 128 * 4  # B 8 decode: every head's page read + written
    one = bench_rank.stage_bytes(8, 8, 1, 96, 7168, 8, False, state)
    two = bench_rank.stage_bytes(8, 8, 1, 96, 7168, 8, True, state)
    row, d = 8 * 7168 * 2, 1536
    assert one["kda"] == state // 8 + 8 * 3 * d * 3 * 4 + 8 * d * 2 * 5
    assert one["producer"] == 7168 * d * 2 + 8 * d * 2 + 8 * row  # into every mailbox
    assert two["producer"] == one["producer"] - 7 * row  # each column to its owner once
    assert one["consumer"] == 8 * row + 11 * row and two["consumer"] == 3 * row + 11 * row
    assert one["kda"] == two["kda"]


def test_row_floors_ratios_and_targets():
    """TP 16 B 8 T 1 (twoshot from 4 rows): floors from the bytes at the copy bandwidth, the
    producer's the larger of its bytes and its FLOPs; the targets from fake timings."""
    cfg = _cfg(16, 8)
    plan = oproj_plan(16, 8, 7168, "per-rank")
    assert plan.twoshot
    fl = bench_rank.rank_row(cfg, plan, TBPS, TFLOPS, {})["floors_us"]
    assert fl["chain"] == pytest.approx(fl["kda"] + fl["producer"] + fl["consumer"])
    assert fl["producer"] == max(fl["producer_bytes"], fl["producer_gemm"])
    assert fl["producer_gemm"] == pytest.approx(2 * 8 * 7168 * 768 / (TFLOPS * 1e6))
    us = dict(kda=4.0, produce=3.0, consume=2.0, chain=1.2 * fl["chain"], gemm=2.5)
    row = bench_rank.rank_row(cfg, plan, TBPS, TFLOPS, us)
    assert row["oproj_us"] == 5.0 and row["chain_oproj_us"] == pytest.approx(us["chain"] - 4.0)
    assert row["x_floor"]["chain"] == pytest.approx(1.2) and row["targets"]["chain"]
    assert row["x_floor"]["producer_target"] == pytest.approx(3.0 / max(2.5, fl["producer_bytes"]))
    assert row["targets"]["producer"] is (1.1 * max(2.5, fl["producer_bytes"]) >= 3.0)
    assert row["targets"]["alone_12us"] is (us["chain"] <= 12.0)
    assert row["plan"]["twoshot"] and row["stages_us"]["kda"] == 4.0
    slow = bench_rank.rank_row(cfg, plan, TBPS, TFLOPS, dict(us, chain=13.0, produce=9.0))
    assert slow["targets"]["alone_12us"] is False and slow["targets"]["producer"] is False
    other = bench_rank.rank_row(_cfg(8, 8), plan, TBPS, TFLOPS, us)
    assert "alone_12us" not in other["targets"]  # TP 16 B 8 T 1 only
    empty = bench_rank.rank_row(cfg, plan, TBPS, TFLOPS, {})
    assert empty["targets"] == dict(chain=None, producer=None, alone_12us=None)


def _fake_gpu(monkeypatch, measured, producers=None):
    producers = [] if producers is None else producers
    import _common
    import oproj_rows
    import torch

    monkeypatch.setattr(_common, "copy_bandwidth", lambda: TBPS)
    monkeypatch.setattr(oproj_rows, "gemm_tflops", lambda: TFLOPS)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def measure(cfg, replays, fence=True, flush="write", producer="plan"):
        measured.append((cfg.tp, cfg.requests, cfg.tokens, replays, fence, flush))
        producers.append(producer)
        if cfg.requests == 256:
            raise ValueError("does not fit")
        plan = oproj_plan(cfg.tp, cfg.requests * cfg.tokens, cfg.hidden, "per-rank")
        rows = cfg.requests * cfg.tokens
        us = dict(kda=2.0 * rows, produce=5.0 + rows, consume=3.0 + rows, gemm=4.0 + rows)
        us["chain"] = 0.9 * sum(us[k] for k in ("kda", "produce", "consume"))
        return us, plan, "wide"

    monkeypatch.setattr(bench_rank, "measure", measure)


def test_sweep_writes_json_and_table(tmp_path, monkeypatch, capsys):
    measured = []
    _fake_gpu(monkeypatch, measured)
    out = tmp_path / "rank.json"
    argv = ["--tp", "16", "--requests", "8", "256", "--tokens", "1", "4", "--replays", "7"]
    assert bench_rank.main([*argv, "--json", str(out), "--no-fence"]) == 0
    assert measured == [(16, b, t, 7, False, "write") for t in (1, 4) for b in (8, 256)]
    data = json.loads(out.read_text())
    assert data["fence"] is False and data["l2_flush"] == "write" and data["copy_tbps"] == TBPS
    assert "rank 0 alone" in data["device"] and data["replays"] == 7
    rows = data["rows"]
    assert [(r["requests"], r["tokens"]) for r in rows] == [(8, 1), (256, 1), (8, 4), (256, 4)]
    assert "does not fit" in rows[1]["skipped"] and rows[1]["chain_us"] is None
    assert rows[0]["kda_kernel"] == "wide" and rows[0]["plan"]["twoshot"]
    assert rows[0]["stages_us"] == dict(kda=16.0, produce=13.0, consume=11.0)
    text = capsys.readouterr().out
    assert "Fake GPU: copy 4.00 TB/s" in text and "skipped: ValueError: does not fit" in text
    assert "twoshot mma" in text and "targets: chain <= 1.3" in text


def test_producer_option_reaches_measure(tmp_path, monkeypatch):
    measured, producers = [], []
    _fake_gpu(monkeypatch, measured, producers)
    out = tmp_path / "rank.json"
    argv = ["--tp", "8", "--requests", "32", "--tokens", "1", "--producer", "cublas"]
    assert bench_rank.main([*argv, "--json", str(out)]) == 0
    assert producers == ["cublas"] and json.loads(out.read_text())["producer"] == "cublas"
    with pytest.raises(SystemExit):  # wgmma is the plan's above 8 rows; not forced below
        bench_rank.parser().parse_args(["--producer", "wgmma"])


def test_options():
    args = bench_rank.parser().parse_args([])
    assert args.producer == "plan"
    assert args.tp == [8, 16] and args.requests == [1, 8, 32, 128, 256] and args.tokens == [1, 4]
    assert args.kda_state == "per-step" and not args.no_fence and not args.no_flush
    assert not args.clean_flush
    with pytest.raises(SystemExit):  # one flush or none
        bench_rank.parser().parse_args(["--no-flush", "--clean-flush"])
    with pytest.raises(SystemExit):
        bench_rank.parser().parse_args(["--state-dtype", "fp16"])


def test_plot_rank_from_the_json(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import plot_rank

    measured = []
    _fake_gpu(monkeypatch, measured)
    paths = []
    for tp in (8, 16):
        paths.append(tmp_path / f"rank{tp}.json")
        argv = ["--tp", str(tp), "--requests", "1", "8", "256", "--json", str(paths[-1])]
        assert bench_rank.main(argv) == 0
    rows, devices = plot_rank.json_rows([str(p) for p in paths])
    shown = plot_rank.panels(rows)
    assert set(shown) == {(8, 1), (8, 4), (16, 1), (16, 4)}
    got, floors = shown[(16, 1)]["chain"]
    assert [x for x, _ in got] == [1, 8] and [x for x, _ in floors] == [1, 8, 256]  # 256 skipped
    out = tmp_path / "rank.png"
    assert plot_rank.main([*map(str, paths), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tp,requests,tokens,twoshot,flush",
    [
        (8, 1, 4, False, "write"),
        (8, 8, 1, True, "write"),
        (8, 8, 2, True, "write"),
        (16, 4, 1, True, "clean"),
    ],
    ids=["oneshot-4", "twoshot-8", "twoshot-gemm-16", "tp16-twoshot-4-clean"],
)
def test_measure_alone_on_the_gpu(tp, requests, tokens, twoshot, flush):
    """Rank 0 alone with the per-rank plan (one-shot, twoshot with the mma.sync producer
    and with the GEMM producer above 8 rows, wgmma on sm_90), both L2 flushes: every stage
    timed, no consumer timeout (``measure`` raises on one), HID 7168 with two heads per
    rank."""
    args = argparse.Namespace(
        heads=2 * tp, hidden=7168, blocks=8, kda_state="per-step", ring=4, state_dtype="fp32"
    )
    cfg = bench_decode._config(tp, requests, args, tokens)
    us, plan, kernel = bench_rank.measure(cfg, 3, flush=flush)
    assert plan.twoshot is twoshot and kernel
    assert set(us) == {"kda", "produce", "consume", "chain", "gemm"}
    assert all(v > 0 for v in us.values()), us


def test_clean_flush_reaches_measure(tmp_path, monkeypatch):
    measured = []
    _fake_gpu(monkeypatch, measured)
    out = tmp_path / "rank.json"
    argv = ["--tp", "8", "--requests", "32", "--tokens", "1", "--clean-flush", "--json", str(out)]
    assert bench_rank.main(argv) == 0
    assert measured[0][-1] == "clean" and json.loads(out.read_text())["l2_flush"] == "clean"
    argv = ["--tp", "8", "--requests", "32", "--tokens", "1", "--no-flush", "--json", str(out)]
    assert bench_rank.main(argv) == 0
    assert measured[1][-1] == "none" and json.loads(out.read_text())["l2_flush"] == "none"


def test_l2_flushers():
    for how in bench_rank.FLUSHES:
        bench_rank.l2_flusher(how, device="cpu", nbytes=1 << 12)()
    with pytest.raises(ValueError, match="flush"):
        bench_rank.l2_flusher("dirty", device="cpu")
