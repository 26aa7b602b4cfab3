"""Plot us per step against requests (B) for each KDA kernel and peer, from bench JSON.

    python scripts/plot_kda.py bench_small.json [--out kda_small.png]

One panel per (H, T) of the JSON written by ``scripts/bench_kda.py --small --json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: _common

from _common import pyplot, save_figure  # noqa: E402

SERIES = (
    ("auto_us", "ours (auto)", "-"),
    ("wide_us", "KdaWide", "--"),
    ("stream_us", "KdaStream", "--"),
    ("split2_us", "KdaSplit c2", ":"),
    ("split4_us", "KdaSplit c4", ":"),
    ("split8_us", "KdaSplit c8", ":"),
    ("fla_us", "fla recurrence", "-."),
    ("composed_us", "fla composed", "-."),
)


def panels(rows):
    """{(H, T): [rows sorted by B]}."""
    out = {}
    for r in rows:
        out.setdefault((r["H"], r["T"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["B"]) for k, v in sorted(out.items())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="bench_kda.py --json output")
    parser.add_argument("--out", default="kda_small.png")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        rows = json.load(f)["rows"]
    groups = panels(rows)
    fig, axes = pyplot().subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, ((H, T), rs) in zip(axes[0], groups.items(), strict=True):
        bs = [r["B"] for r in rs]
        for key, label, style in SERIES:
            ys = [r.get(key) for r in rs]
            if any(y is not None for y in ys):
                ax.plot(
                    bs,
                    [float("nan") if y is None else y for y in ys],
                    style,
                    marker="o",
                    label=label,
                )
        ax.set_title(f"H = {H}, T = {T}")
        ax.set_xlabel("requests B")
        ax.set_ylabel("us per step (CUDA graph)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
