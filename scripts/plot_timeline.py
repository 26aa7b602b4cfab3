"""A step's timeline per rank from a ``launch/decode.py --trace --json`` report.

    python scripts/plot_timeline.py report.json --out docs/timeline.png [--steps 3]

One lane per rank, the first ``--steps`` traced steps side by side on one time axis (us
from the first step's earliest stamp): a bar per stage (KDA, recover, producer, consumer;
each from the stamp before it to its own, so it includes one kernel boundary) and the
kernel-boundary calibration (``launch``: two stamps back to back); white space is the gap
between steps. ``%globaltimer`` is per GPU: lanes of different GPUs are aligned by the
driver's clock offsets (skew below ~1 us is not resolved), and that offset can be far
larger than a step (two H200s, 2026-11-30: 484 us). ``--align rank`` draws each lane
shifted by its rank's median skew (its clock's offset; what is left is the skew's spread);
``--align clock`` as stamped; ``auto`` (default) shifts when a rank's median skew exceeds
the median step period: no rank can start a step more than a step after another, since
each consumer waits for every rank's partial of the same step, so such a skew is a clock
offset, not a skew.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: _common

from _common import pyplot, save_figure  # noqa: E402

COLOURS = {
    "launch": "#bbbbbb",
    "kda": "#4c72b0",
    "recover": "#8172b2",
    "produce": "#dd8452",
    "consume": "#55a868",
}


def offsets(tl, align: str = "auto") -> list[float]:
    """Per rank the us its lane is shifted left: 0 with ``clock``; its median skew with
    ``rank``; ``auto``: ``rank`` when some rank's median skew exceeds the median step
    period (a clock offset between GPUs, see above), else ``clock``."""
    if align not in ("auto", "clock", "rank"):
        raise ValueError(f"align must be auto, clock or rank; got {align!r}")
    skews = [statistics.median(e["skew_us"] for e in lane) for lane in tl["ranks"]]
    at = tl["step_at_us"]
    periods = [b - a for a, b in zip(at, at[1:], strict=False)]
    period = statistics.median(periods) if periods else None
    if align == "auto":
        align = "rank" if period is not None and max(skews) > period else "clock"
    return [0.0] * len(skews) if align == "clock" else skews


def load(path, steps: int, align: str = "auto"):
    """(timeline, bars): ``bars[rank]`` is a list of (stage, start us, length us) over the
    first ``steps`` traced steps, each lane shifted by ``offsets(timeline, align)``.
    ValueError when the report has no timeline."""
    with open(path) as f:
        report = json.load(f)
    tl = report.get("timeline")
    if tl is None:
        raise ValueError(f"{path}: no timeline (run launch/decode.py with --trace --json)")
    shown = min(steps, tl["steps"])
    bars = []
    for lane, shift in zip(tl["ranks"], offsets(tl, align), strict=True):
        mine = []
        for s in range(shown):
            at, e = tl["step_at_us"][s] - shift, lane[s]
            mine.append(("launch", at + e["skew_us"], e["launch_us"]))
            for stage in tl["stages"]:
                start, end = e[stage]
                mine.append((stage, at + start, end - start))
        bars.append(mine)
    return tl, bars


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="JSON report of launch/decode.py --trace --json")
    p.add_argument("--out", default="timeline.png", help="image to write")
    p.add_argument("--steps", type=int, default=3, help="traced steps to draw (from the first)")
    p.add_argument(
        "--align",
        choices=("auto", "clock", "rank"),
        default="auto",
        help="lanes as stamped (clock), each shifted by its rank's median skew "
        "(rank), or rank where a skew exceeds a step (auto)",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        print("--steps must be >= 1", file=sys.stderr)
        return 2
    try:
        tl, bars = load(args.report, args.steps, args.align)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    shifts = offsets(tl, args.align)
    try:
        plt = pyplot()
    except ImportError:
        print("plot_timeline.py needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1

    ranks = len(bars)
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.6 * ranks))
    for r, lane in enumerate(bars):
        for stage, start, length in lane:
            ax.broken_barh(
                [(start, length)],
                (r - 0.35, 0.7),
                facecolors=COLOURS[stage],
                edgecolors="white",
                linewidth=0.5,
            )
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[s]) for s in ("launch", *tl["stages"])]
    ax.legend(
        handles,
        ["kernel boundary", *tl["stages"]],
        loc="upper right",
        fontsize=8,
        ncol=len(handles),
    )
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5 - 0.6)  # rank 0 on top, room for the legend
    s = tl["summary"]
    steps = [r["step_us"] for r in s["per_rank"]]
    gaps = [r["gap_us"] for r in s["per_rank"] if r.get("gap_us") is not None]
    title = (
        f"{tl['kind']} steps back to back: step {min(steps):.1f}-{max(steps):.1f} us per "
        f"rank (medians)"
    )
    if gaps:
        title += f", gap before a step {min(gaps):.1f}-{max(gaps):.1f} us"
    if any(shifts):
        ax.set_xlabel("us (globaltimer, each rank's lane shifted by its median skew)")
        title += (
            f"\nlanes aligned per rank: {max(shifts) - min(shifts):.1f} us of median "
            "skew removed (more than a step: the GPUs' globaltimer offset)"
        )
    else:
        ax.set_xlabel("us (globaltimer, from the first step's earliest stamp)")
        title += f"; median span {s['span_us']:.1f} us, skew {s['skew_us']:.2f} us"
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    save_figure(fig, args.out, f"{ranks} ranks, {min(args.steps, tl['steps'])} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
