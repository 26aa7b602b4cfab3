"""One rank's chain against rows per step, stage by stage with each stage's floor, from
``bench_rank.py --json`` (one or more files, e.g. one per TP): a panel per (TP, tokens), the
chain against the sum of its stage floors and the 1.3x target, KDA, producer, consumer and
the o-projection (producer + consumer) each beside its floor, and TP 16 B 8 T 1's 12 us target.

    python scripts/plot_rank.py docs/data/rank_rows_tp8.json docs/data/rank_rows_tp16.json \
        --out docs/rank_rows.png
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: _common

from _common import finish_rows_panel, json_rows, pyplot, save_figure  # noqa: E402

CHAIN_TARGET = 1.3
ALONE_TARGET_US = 12.0
# (name, measured us of a row, its floor us, colour)
SERIES = (
    ("chain", lambda r: r["chain_us"], lambda r: r["floors_us"]["chain"], "k"),
    ("KDA", lambda r: r["stages_us"]["kda"], lambda r: r["floors_us"]["kda"], "C0"),
    ("producer", lambda r: r["stages_us"]["produce"], lambda r: r["floors_us"]["producer"], "C1"),
    ("consumer", lambda r: r["stages_us"]["consume"], lambda r: r["floors_us"]["consumer"], "C2"),
    ("o-projection", lambda r: r["oproj_us"], lambda r: r["floors_us"]["oproj"], "C3"),
)


def panels(rows):
    """{(tp, tokens): {name: ([(rows, us)], [(rows, floor us)])}}, points sorted by rows,
    measured points without a value left out (their floors kept)."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: (r["tp"], r["tokens"], r["rows"])):
        panel = out.setdefault((r["tp"], r["tokens"]), {})
        for name, us, floor, _ in SERIES:
            got, floors = panel.setdefault(name, ([], []))
            if us(r) is not None:
                got.append((r["rows"], us(r)))
            floors.append((r["rows"], floor(r)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="JSON of bench_rank.py (one or more)")
    p.add_argument("--out", default="docs/rank_rows.png")
    args = p.parse_args(argv)
    rows, devices = json_rows(args.json)
    shown = panels(rows)
    if not shown:
        print("no rows to plot")
        return 1
    plt = pyplot()

    tps = sorted({tp for tp, _ in shown})
    tokens = sorted({t for _, t in shown})
    fig, axes = plt.subplots(
        len(tps), len(tokens), figsize=(6 * len(tokens), 4.6 * len(tps)), squeeze=False
    )
    count = 0
    for i, tp in enumerate(tps):
        for j, t in enumerate(tokens):
            ax = axes[i][j]
            series = shown.get((tp, t), {})
            ticks = set()
            for name, _, _, colour in SERIES:
                got, floors = series.get(name, ([], []))
                if got:
                    ax.plot(
                        *zip(*got, strict=True),
                        "-",
                        marker="o",
                        color=colour,
                        markersize=4,
                        label=name,
                    )
                if floors:
                    ax.plot(*zip(*floors, strict=True), ":", color=colour, label=f"{name} floor")
                ticks.update(x for x, _ in got + floors)
                count += len(got)
            floors = series.get("chain", ([], []))[1]
            if floors:
                xs, ys = zip(*floors, strict=True)
                ax.plot(
                    xs,
                    [CHAIN_TARGET * y for y in ys],
                    "--",
                    color="0.5",
                    label=f"{CHAIN_TARGET}x the chain's floors (target)",
                )
            if tp == 16 and t == 1:
                ax.plot(
                    [8],
                    [ALONE_TARGET_US],
                    "*",
                    color="r",
                    markersize=10,
                    label=f"B 8 target {ALONE_TARGET_US:g} us",
                )
            kind = "decode" if t == 1 else f"verify, T = {t}"
            title = f"TP {tp}, {kind}: rank 0 alone\n{', '.join(devices)}"
            finish_rows_panel(ax, ticks, f"rows per step (requests x {t})", "us (median)", title, 6)
    save_figure(fig, args.out, f"{count} points, {len(tps) * len(tokens)} panels")
    return 0 if count else 1


if __name__ == "__main__":
    sys.exit(main())
