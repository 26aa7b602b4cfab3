"""Step latency against rows per step (ours, the peer, the floor), one colour per TP,
from ``bench_decode.py --rows --json`` (one or more files, e.g. one per TP; a panel per
tokens count: decode steps T = 1, verify steps T = 4) and ``bench_oproj.py --rows --json``
(``--oproj``, one or more files: the o-projection alone in its own panel).

    python scripts/plot_rows.py docs/data/decode_rows_tp8.json docs/data/decode_rows_tp16.json \
        --oproj docs/data/oproj_rows_tp8.json docs/data/oproj_rows_tp16.json \
        --out docs/decode_rows.png
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: _common

from _common import finish_rows_panel, json_rows, pyplot, save_figure  # noqa: E402

SERIES = (
    ("ours_us", "-", "o", "ours"),
    ("peer_us", "--", "s", "peer"),
    ("floor_us", ":", None, "floor"),
)


def lines(rows, x="rows"):
    """{(tp, key): [(x, us), ...]} sorted by x, points without a value left out."""
    out: dict = {}
    for r in rows:
        for key, *_ in SERIES:
            if r.get(key) is not None:
                out.setdefault((r["tp"], key), []).append((r[x], r[key]))
    order = [key for key, *_ in SERIES]
    return {k: sorted(out[k]) for k in sorted(out, key=lambda k: (k[0], order.index(k[1])))}


def panels(decode, oproj=None):
    """[(title, rows, devices)]: the decode rows per tokens count (one panel when they
    name none), then the o-projection rows."""
    rows, devices = json_rows(decode)
    tokens = sorted({r.get("tokens") for r in rows}, key=lambda t: (t is None, t))
    out = []
    for t in tokens:
        mine = [r for r in rows if r.get("tokens") == t]
        if t is None:
            title = "decode step (KDA + o-projection), all ranks"
        elif t == 1:
            title = "decode step (T = 1: KDA + o-projection), all ranks"
        else:
            title = f"verify step (T = {t}, rows = requests x {t}), all ranks"
        if t is not None and t > 1 and all(r.get("peer_us") is None for r in mine):
            title += "; peer: T = 1 only"
        out.append((title, mine, devices))
    if oproj:
        rows, devices = json_rows(oproj)
        out.append(
            ("o-projection alone (producer + exchange + consumer), all ranks", rows, devices)
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("decode", nargs="+", help="JSON of bench_decode.py --rows (one or more)")
    p.add_argument(
        "--oproj", nargs="+", default=None, help="JSON of bench_oproj.py --rows (one or more)"
    )
    p.add_argument("--out", default="docs/decode_rows.png")
    args = p.parse_args(argv)
    shown = panels(args.decode, args.oproj)
    plt = pyplot()

    n = len(shown)
    fig, axes = plt.subplots(1, n, figsize=(5.6 * n, 4.8), squeeze=False)
    tps = sorted({r["tp"] for _, rows, _ in shown for r in rows})
    colours = {tp: f"C{i}" for i, tp in enumerate(tps)}
    count = 0
    for ax, (title, rows, devices) in zip(axes[0], shown, strict=True):
        ticks = set()
        for (tp, key), points in lines(rows).items():
            style, marker, name = next((s, m, n) for k, s, m, n in SERIES if k == key)
            ax.plot(
                [x for x, _ in points],
                [y for _, y in points],
                style,
                marker=marker,
                color=colours[tp],
                label=f"TP {tp} {name}",
                markersize=4,
            )
            ticks.update(x for x, _ in points)
            count += len(points)
        xlabel, ylabel = "rows per step (requests x tokens)", "latency, us (median)"
        finish_rows_panel(ax, ticks, xlabel, ylabel, f"{title}\n{', '.join(devices)}")
    save_figure(fig, args.out, f"{count} points, {n} panels")
    return 0 if count else 1


if __name__ == "__main__":
    sys.exit(main())
