"""CPU tests of ``scripts/bench_step.py``'s plain parts: the options it refuses (before
any CUDA), the per-rank floor, the slowest-rank statistics and the table."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import bench_step  # noqa: E402


def _args(*argv):
    return bench_step.parse_args(list(argv))


def test_defaults():
    a = _args()
    assert (a.heads, a.hidden, a.blocks, a.requests, a.tokens, a.replays, a.json) == (
        96, 7168, 8, [1, 8, 32], 1, 50, None
    )  # fmt: skip
    bench_step.check_args(a, 2)
    bench_step.check_args(_args("--heads", "4", "--hidden", "2048", "--requests", "2"), 2)


@pytest.mark.parametrize(
    "argv,world,names",
    [
        ((), 1, "at least 2"),
        (("--heads", "6"), 4, "heads (6)"),
        (("--hidden", "1000"), 2, "hidden (1000)"),
        (("--tokens", "9"), 2, "tokens"),
        (("--blocks", "9"), 2, "blocks"),
        (("--requests", "8", "0"), 2, "requests"),
        (("--requests", "1024", "--tokens", "8"), 2, "--requests x --tokens"),
        (("--replays", "0"), 2, "--replays"),
    ],
)
def test_refusals(argv, world, names):
    with pytest.raises(ValueError) as e:
        bench_step.check_args(_args(*argv), world)
    assert names in str(e.value)


def test_main_refuses_before_cuda(monkeypatch, capsys):
    for var in bench_step.NO_MULTICAST:  # main sets them; restored after the test
        monkeypatch.setenv(var, "")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert bench_step.main(["--heads", "5"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("BENCH FAILED: heads (5)")
    assert all(os.environ[k] == v for k, v in bench_step.NO_MULTICAST.items())


def test_rank_floor():
    a = _args("--requests", "8")
    page, w_o_rank = 128 * 128 * 4, 7168 * 48 * 128 * 2  # 96 heads / TP 2 = 48 per rank
    nbytes, us = bench_step.rank_floor(bench_step.config(a, 2, 8), 4.0)
    assert nbytes == 8 * 48 * 2 * page + w_o_rank  # decode: one page read, one written
    assert us == pytest.approx(nbytes / 4e6)
    a = _args("--requests", "8", "--tokens", "4")
    nbytes, _ = bench_step.rank_floor(bench_step.config(a, 4, 8), 2.0)
    assert nbytes == 8 * 24 * 5 * page + 7168 * 24 * 128 * 2  # verify: 1 read, 4 written


def test_summarize_takes_the_slowest_rank_per_step():
    s = bench_step.summarize([[1.0, 5.0, 3.0], [2.0, 4.0, 6.0]])
    assert s["median_us"] == 5.0 and s["p99_us"] == 6.0 and s["max_us"] == 6.0 and s["n"] == 3
    assert s["rank_median_max_us"] == 4.0


def test_table():
    meta = dict(tp=2, heads=24, hidden=7168, blocks=8, tokens=1, replays=50, copy_tbps=4.0)
    variants = {
        "ours": {"median_us": 30.0, "p99_us": 31.0, "how": "2 graphs"},
        "nccl": {"median_us": 90.0, "p99_us": 99.0, "how": "1 graph"},
        "symm": {"skipped": "RuntimeError: no symm"},
    }
    rows = [dict(requests=8, rank_bytes=12_000_000, floor_us=20.0, variants=variants)]
    lines = bench_step.format_table(meta, rows)
    assert "TP 2, 24 heads (12 per rank)" in lines[0] and "4.00 TB/s" in lines[1]
    body = {line[6:30].strip(): line[30:] for line in lines[3:]}  # label: the rest
    assert lines[3].startswith("   8  floor") and "12.0 MB per rank" in body["floor"]
    assert body["floor"].split()[:4] == ["20.00", "-", "-", "-"]
    assert body["ours (nvshmem)"].split()[:4] == ["30.00", "31.00", "1.50", "1.00"]
    assert body["fla + NCCL all_reduce"].split()[:4] == ["90.00", "99.00", "4.50", "3.00"]
    assert body["fla + symm one-shot"].split()[:4] == ["-", "-", "-", "-"]
    assert "skipped: RuntimeError: no symm" in body["fla + symm one-shot"]
    assert "skipped: not run" in body["fla + flashinfer fusion"]
