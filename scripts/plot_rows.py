"""Step latency against rows per step (ours, the peer, the floor), one colour per TP,
from ``bench_decode.py --rows --json`` (and ``bench_oproj.py --rows --json`` for an
o-projection panel).

    python scripts/plot_rows.py docs/decode_rows.json [--oproj docs/oproj_rows.json]
                                --out docs/decode_rows.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SERIES = (("ours_us", "-", "o", "ours"), ("peer_us", "--", "s", "peer"),
          ("floor_us", ":", None, "floor"))  # fmt: skip


def lines(rows, x="rows"):
    """{(tp, key): [(x, us), ...]} sorted by x, points without a value left out."""
    out: dict = {}
    for r in rows:
        for key, *_ in SERIES:
            if r.get(key) is not None:
                out.setdefault((r["tp"], key), []).append((r[x], r[key]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("decode", help="JSON of bench_decode.py --rows")
    p.add_argument("--oproj", default=None, help="JSON of bench_oproj.py --rows")
    p.add_argument("--out", default="docs/decode_rows.png")
    args = p.parse_args(argv)
    panels = [("decode step (KDA + o-projection), all ranks", args.decode)]
    if args.oproj:
        panels.append(("o-projection alone, all ranks", args.oproj))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    count = 0
    for ax, (title, path) in zip(axes[0], panels, strict=True):
        with open(path) as f:
            data = json.load(f)
        colours = {}
        for (tp, key), points in lines(data["rows"]).items():
            style, marker, name = next((s, m, n) for k, s, m, n in SERIES if k == key)
            colour = colours.setdefault(tp, f"C{len(colours)}")
            ax.plot([x for x, _ in points], [y for _, y in points], style, marker=marker,
                    color=colour, label=f"TP {tp} {name}")  # fmt: skip
            count += len(points)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows per step (requests x tokens)")
        ax.set_ylabel("latency, us (median)")
        ax.set_title(f"{title}\n{data.get('device', '')}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    print(f"wrote {args.out} ({count} points)")
    return 0 if count else 1


if __name__ == "__main__":
    sys.exit(main())
