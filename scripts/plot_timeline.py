"""A step's timeline per rank from a ``launch/decode.py --trace --json`` report.

    python scripts/plot_timeline.py report.json --out docs/timeline.png [--steps 3]

One lane per rank, the first ``--steps`` traced steps side by side on one time axis (us
from the first step's earliest stamp): a bar per stage (KDA, recover, producer, consumer;
each from the stamp before it to its own, so it includes one kernel boundary) and the
kernel-boundary calibration (``launch``: two stamps back to back); white space is the gap
between steps. ``%globaltimer`` is per GPU: lanes of different GPUs are aligned by the
driver's clock offsets (skew below ~1 us is not resolved).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

COLOURS = {
    "launch": "#bbbbbb",
    "kda": "#4c72b0",
    "recover": "#8172b2",
    "produce": "#dd8452",
    "consume": "#55a868",
}


def load(path, steps: int):
    """(timeline, bars): ``bars[rank]`` is a list of (stage, start us, length us) over the
    first ``steps`` traced steps. ValueError when the report has no timeline."""
    with open(path) as f:
        report = json.load(f)
    tl = report.get("timeline")
    if tl is None:
        raise ValueError(f"{path}: no timeline (run launch/decode.py with --trace --json)")
    shown = min(steps, tl["steps"])
    bars = []
    for lane in tl["ranks"]:
        mine = []
        for s in range(shown):
            at, e = tl["step_at_us"][s], lane[s]
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
    args = p.parse_args(argv)
    if args.steps < 1:
        print("--steps must be >= 1", file=sys.stderr)
        return 2
    try:
        tl, bars = load(args.report, args.steps)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    try:
        import matplotlib
    except ImportError:
        print("plot_timeline.py needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = len(bars)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.6 * ranks))
    for r, lane in enumerate(bars):
        for stage, start, length in lane:
            ax.broken_barh([(start, length)], (r - 0.35, 0.7), facecolors=COLOURS[stage],
                           edgecolors="white", linewidth=0.5)  # fmt: skip
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[s]) for s in ("launch", *tl["stages"])]
    ax.legend(handles, ["kernel boundary", *tl["stages"]], loc="upper right", fontsize=8,
              ncol=len(handles))  # fmt: skip
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5 - 0.6)  # rank 0 on top, room for the legend
    ax.set_xlabel("us (globaltimer, from the first step's earliest stamp)")
    s = tl["summary"]
    ax.set_title(f"{tl['kind']} steps back to back: median span {s['span_us']:.1f} us, "
                 f"skew {s['skew_us']:.2f} us", fontsize=10)  # fmt: skip
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    print(f"wrote {args.out} ({ranks} ranks, {min(args.steps, tl['steps'])} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
