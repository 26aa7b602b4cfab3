"""``launch/decode.py --trace`` on the CPU: the timeline arithmetic on synthetic stamps, the
stamp points the runner enqueues around each stage, the options, and
``scripts/plot_timeline.py`` on a synthetic report (skipped without matplotlib). The GPU
runs are in ``test_launch_gpu.py`` and ``test_launch_nvshmem_gpu.py``."""

import importlib
import json
import os
import sys

import pytest

from launch import decode, trace
from launch.moe import MoeWaiters
from launch.runner import Runner
from launch.trace import SLOTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def _row(start, launch, kda, produce, consume, recover=0):
    """One step's stamps in ``SLOTS`` order (ns)."""
    values = dict(start=start, launch=launch, kda=kda, recover=recover, produce=produce,
                  consume=consume)  # fmt: skip
    return [values[s] for s in SLOTS]


# two ranks, a warm step and two traced steps, decode (no recover); ns on one clock
STAMPS = [
    [
        _row(1_000, 2_000, 14_000, 30_000, 40_000),  # warm
        _row(45_000, 46_000, 60_000, 77_000, 90_000),
        _row(95_000, 96_500, 110_000, 126_000, 139_000),
    ],
    [
        _row(1_500, 2_500, 15_000, 31_000, 40_500),
        _row(45_500, 46_500, 61_000, 77_500, 90_000),
        _row(94_000, 95_000, 109_000, 126_500, 139_500),
    ],
]


def check_timeline(tl, ranks, steps, stages):
    """What every GPU timeline must hold (``test_launch_gpu.py``, ``test_launch_nvshmem_gpu.py``
    call it): every stage on every rank and step, stages tiling the step from its launch
    stamp in stream order (non-negative, summing to the step), non-negative gaps and skews,
    one rank at skew 0 each step, and a summary row per rank with a polling estimate."""
    assert tl["steps"] == steps and tl["stages"] == list(stages), (tl["steps"], tl["stages"])
    assert len(tl["ranks"]) == ranks and len(tl["step_at_us"]) == steps
    assert tl["step_at_us"] == sorted(tl["step_at_us"]) and tl["step_at_us"][0] == 0.0
    for s in range(steps):
        assert min(lane[s]["skew_us"] for lane in tl["ranks"]) == 0.0
    for r, lane in enumerate(tl["ranks"]):
        assert len(lane) == steps
        for s, e in enumerate(lane):
            where = f"rank {r} step {s}: {e}"
            assert e["skew_us"] >= 0 and e["launch_us"] >= 0, where
            assert e["gap_us"] is not None and e["gap_us"] >= 0, where
            previous = e["skew_us"] + e["launch_us"]
            total = e["launch_us"]
            for stage in stages:
                start, end = e[stage]
                assert start == pytest.approx(previous, abs=2e-3) and end >= start, where
                total += end - start
                previous = end
            assert e["end_us"] == pytest.approx(previous, abs=2e-3), where
            assert total == pytest.approx(e["step_us"], abs=1e-2), where  # rounding only
    for row in tl["summary"]["per_rank"]:
        assert all(row[f"{stage}_us"] >= 0 for stage in stages)
        assert row["consume_alone_us"] > 0 and row["polling_us"] is not None
    assert tl["summary"]["span_us"] > 0 and tl["summary"]["skew_us"] >= 0


def test_timeline_arithmetic():
    tl = trace.timeline(STAMPS, ("kda", "produce", "consume"), consume_alone=[8.0, 8.5])
    assert tl["stages"] == ["kda", "produce", "consume"] and tl["steps"] == 2
    assert tl["step_at_us"] == [0.0, 49.0]  # earliest starts 45.0 and 94.0 us
    r0, r1 = tl["ranks"]
    assert r0[0] == {
        "skew_us": 0.0,
        "gap_us": 5.0,  # after the warm step's consumer stamp (40.0 us)
        "launch_us": 1.0,
        "kda": [1.0, 15.0],
        "produce": [15.0, 32.0],
        "consume": [32.0, 45.0],
        "end_us": 45.0,
        "step_us": 45.0,
    }
    assert r1[0]["skew_us"] == 0.5 and r1[0]["gap_us"] == 5.0
    assert r1[0]["consume"] == [32.5, 45.0]
    # step 2: rank 1 starts first, so rank 0's skew is 1.0 and times count from 94.0 us
    assert r0[1]["skew_us"] == 1.0 and r1[1]["skew_us"] == 0.0
    assert r0[1]["kda"] == [2.5, 16.0] and r1[1]["end_us"] == 45.5
    assert r0[1]["gap_us"] == 5.0 and r1[1]["gap_us"] == 4.0
    for lane in tl["ranks"]:  # the stages tile the step from the launch stamp to the end
        for e in lane:
            assert e["launch_us"] + sum(e[s][1] - e[s][0] for s in tl["stages"]) == pytest.approx(
                e["step_us"]
            )
    s = tl["summary"]
    one = s["per_rank"][0]
    assert one["kda_us"] == pytest.approx(13.75) and one["consume_us"] == pytest.approx(13.0)
    assert one["step_us"] == pytest.approx(44.5) and one["gap_us"] == 5.0
    assert one["launch_us"] == pytest.approx(1.25) and one["skew_us"] == pytest.approx(0.5)
    assert one["consume_alone_us"] == 8.0 and one["polling_us"] == pytest.approx(5.0)
    two = s["per_rank"][1]
    assert two["consume_us"] == pytest.approx(12.75) and two["polling_us"] == pytest.approx(4.25)
    assert two["skew_us"] == pytest.approx(0.25) and two["gap_us"] == pytest.approx(4.5)
    assert s["skew_us"] == pytest.approx(0.75)  # median of the latest start: 0.5 and 1.0
    assert s["span_us"] == pytest.approx(45.25)  # median of the latest end: 45.0 and 45.5


def test_check_timeline_accepts_the_synthetic_one_and_catches_a_bad_one():
    tl = trace.report([(STAMPS[0], 8.0), (STAMPS[1], 8.5)], "decode", record=False)
    check_timeline(tl, 2, 2, ("kda", "produce", "consume"))
    bad = json.loads(json.dumps(STAMPS))
    bad[0][1][SLOTS.index("produce")] = 59_000  # the producer's stamp before KDA's
    tl = trace.report([(bad[0], 8.0), (bad[1], 8.5)], "decode", record=False)
    with pytest.raises(AssertionError):
        check_timeline(tl, 2, 2, ("kda", "produce", "consume"))


def test_timeline_with_recover_and_no_warm_step():
    stamps = [[_row(0 + 1, 1_001, 5_001, 9_001, 12_001, recover=7_001)]]
    tl = trace.timeline(stamps, trace.stage_names(True), warm=0)
    (e,) = tl["ranks"][0]
    assert e["gap_us"] is None and e["recover"] == [5.0, 7.0] and e["produce"] == [7.0, 9.0]
    assert tl["summary"]["per_rank"][0]["gap_us"] is None
    assert tl["summary"]["per_rank"][0]["polling_us"] is None  # no stage-pass time given


def test_timeline_refusals():
    stages = ("kda", "produce", "consume")
    missing = json.loads(json.dumps(STAMPS))
    missing[1][2][SLOTS.index("produce")] = 0
    with pytest.raises(ValueError, match="rank 1 step 2 produce was never written"):
        trace.timeline(missing, stages)
    with pytest.raises(ValueError, match="more than warm=1 rows"):
        trace.timeline([lane[:1] for lane in STAMPS], stages)
    with pytest.raises(ValueError, match="rank 1 is not"):
        trace.timeline([STAMPS[0], STAMPS[1][:2]], stages)
    with pytest.raises(ValueError, match="ending in consume"):
        trace.timeline(STAMPS, ("kda", "produce"))
    with pytest.raises(ValueError, match="stages must be"):
        trace.timeline(STAMPS, ("kda", "oproj", "consume"))
    # a recover slot left empty is fine on a decode step, missing on a recorded one
    with pytest.raises(ValueError, match="recover was never written"):
        trace.timeline(STAMPS, trace.stage_names(True))


def test_report_and_summary_print(capsys):
    traced = [(STAMPS[0], 8.0), (STAMPS[1], None)]
    tl = trace.report(traced, "decode", record=False)
    assert tl["kind"] == "decode" and "globaltimer is per GPU" in tl["note"]
    assert tl["summary"]["per_rank"][1]["polling_us"] is None
    json.dumps(tl)  # JSON-able
    trace.print_timeline(tl)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("timeline (decode, 2 traced steps back to back")
    assert out[1].startswith(
        "  rank 0   step 44.50: boundary 1.25, kda 13.75, produce 16.50, "
        "consume 13.00 (alone 8.00: polling ~5.00); gap before 5.00, skew 0.50"
    )
    assert "polling" not in out[2]
    assert "skew 0.75" in out[3] and "not resolved" in out[3]


class _Stub(Runner):
    """A runner without a GPU: stage launches and stamps recorded in order."""

    def __init__(self, ranks, oproj_launch):
        self.ranks, self.local = ranks, {r: i for i, r in enumerate(ranks)}
        self.oproj_launch, self.multiprocess, self.calls = oproj_launch, False, []
        self.moe = MoeWaiters(0, "cpu", ranks, every_rank=oproj_launch == "both")  # none

    def _on_ranks(self, ranks, *phases, join=False):
        for phase in phases:
            for r in ranks:
                phase(r)

    def _kda(self, bk, r):
        self.calls.append(("kda", r))

    def _recover(self, bk, r):
        self.calls.append(("recover", r))

    def _produce(self, bk, r, parity):
        self.calls.append(("produce", r))

    def _consume(self, bk, r, parity):
        self.calls.append(("consume", r))

    def _produce_all(self, bk, parity):
        self.calls.append(("produce", "all"))

    def _consume_all(self, bk, parity):
        self.calls.append(("consume", "all"))


class _Bucket:
    def __init__(self, record):
        self.record = record


def _enqueue(ranks, mode, record):
    stub = _Stub(ranks, mode)
    stub.enqueue(_Bucket(record), 0, stamp=lambda r, p: stub.calls.append(("stamp " + p, r)))
    return stub.calls


@pytest.mark.parametrize("record", [False, True])
def test_stamps_around_each_stage(record):
    calls = _enqueue((3,), "per-rank", record)
    points = ["stamp start", "stamp launch", "kda", "stamp kda"]
    points += ["recover", "stamp recover"] if record else []
    points += ["produce", "stamp produce", "consume", "stamp consume"]
    assert calls == [(p, 3) for p in points]
    assert [p for p, _ in calls if p.startswith("stamp ")][2:] == [
        "stamp " + s for s in trace.stage_names(record)
    ]


def test_stamps_of_launches_for_every_rank():
    calls = _enqueue((0, 1), "both", record=False)
    per_rank = ["stamp start", "stamp launch", "kda", "stamp kda"]
    assert calls == [(p, r) for r in (0, 1) for p in per_rank] + [
        ("produce", "all"),
        ("stamp produce", None),
        ("consume", "all"),
        ("stamp consume", None),
    ]


def test_enqueue_without_stamps_is_unchanged():
    stub = _Stub((0,), "per-rank")
    stub.enqueue(_Bucket(True), 1)
    assert stub.calls == [("kda", 0), ("recover", 0), ("produce", 0), ("consume", 0)]


def test_trace_options(capsys):
    args = decode.parse_args(["--trace"])
    assert args.trace == decode.DEFAULT_TRACE and args.pdl is False
    args = decode.parse_args(["--trace", "7", "--no-pdl"])
    assert args.trace == 7 and args.pdl is False
    args = decode.parse_args([])
    assert args.trace == 0 and args.pdl is True
    assert decode.parse_args(["--no-pdl"]).pdl is False
    for argv, message in (
        (["--trace", "--pdl"], "--trace runs without PDL"),
        (["--trace", "0"], "must be in 1 .. 500; got 0"),
    ):
        with pytest.raises(SystemExit) as e:
            decode.parse_args(argv)
        assert e.value.code == 2
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith("DECODE FAILED: ") and message in last, last


def test_host_backend_refuses_trace(capsys):
    assert decode.main(["--backend", "host", "--trace"]) == 2
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        "DECODE FAILED: --trace stamps the GPU kernels (globaltimer); the host backend "
        "runs none: use --backend loopback or nvshmem"
    )


def _plot_script():
    """``scripts/plot_timeline.py`` imported as the other script tests do (scripts/ on
    the path; it imports matplotlib only to draw)."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    return importlib.import_module("plot_timeline")


def test_plot_timeline(tmp_path):
    plot = _plot_script()
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"ok": True, "timeline": trace.report(
        [(STAMPS[0], 8.0), (STAMPS[1], 8.5)], "decode", record=False)}))  # fmt: skip
    tl, bars = plot.load(path, steps=1)
    assert [len(lane) for lane in bars] == [4, 4]  # the boundary and three stages
    assert bars[1][0] == ("launch", 0.5, 1.0) and bars[1][3] == ("consume", 32.5, 12.5)
    _, bars = plot.load(path, steps=5)  # as many as there are
    assert bars[0][4] == ("launch", 50.0, 1.5)  # step 2 at 49.0 us, rank 0's skew 1.0
    pytest.importorskip("matplotlib")
    out = tmp_path / "docs" / "timeline.png"
    assert plot.main([str(path), "--out", str(out), "--steps", "2"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_aligns_a_clock_offset_between_gpus(tmp_path):
    """Rank 1's globaltimer 1000 us ahead (two GPUs; 484 us on two H200s): its median skew
    exceeds a step, which no real skew can (each consumer waits for every rank's partial
    of the step), so ``auto`` shifts each lane by its median skew, like ``rank``."""
    plot = _plot_script()
    ahead = [[[v + 1_000_000 if v else 0 for v in row] for row in STAMPS[1]]]
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"ok": True, "timeline": trace.report(
        [(STAMPS[0], 8.0), (ahead[0], 8.5)], "decode", record=False)}))  # fmt: skip
    tl, clock = plot.load(path, steps=2, align="clock")
    assert [e["skew_us"] for e in tl["ranks"][1]] == [1000.5, 999.0]
    assert clock[1][0] == ("launch", 1000.5, 1.0)
    assert plot.offsets(tl, "auto") == plot.offsets(tl, "rank") == [0.0, 999.75]
    _, bars = plot.load(path, steps=2)
    assert bars[0][0] == ("launch", 0.0, 1.0) and bars[0][4] == ("launch", 50.0, 1.5)
    assert bars[1][0] == ("launch", 0.75, 1.0) and bars[1][4] == ("launch", 49.25, 1.0)
    same = tmp_path / "same.json"  # one clock (STAMPS): auto leaves the lanes as stamped
    same.write_text(json.dumps({"ok": True, "timeline": trace.report(
        [(STAMPS[0], 8.0), (STAMPS[1], 8.5)], "decode", record=False)}))  # fmt: skip
    assert plot.offsets(plot.load(same, 1)[0]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="align"):
        plot.offsets(tl, "drift")
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    assert plot.main([str(path), "--out", str(out)]) == 0 and out.stat().st_size > 0


def test_plot_timeline_without_a_timeline(tmp_path, capsys):
    plot = _plot_script()
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"ok": True}))
    assert plot.main([str(path), "--out", str(tmp_path / "x.png")]) == 1
    assert "no timeline (run launch/decode.py with --trace --json)" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
