"""Plot the KDA-bandwidth grid: % of the copy bandwidth against (request, head) items, one
panel per T, a line per H for ours (the dispatcher's kernel) and fla's recurrence, and
the replay rows (ring size R) as markers, SGLang's fused kernel where the run timed it
(``--peers sglang``: dashed, its time over our row's state bytes); the targets as
horizontal lines.

    python3 scripts/bench_kda.py --heads 6 12 24 96 --requests 1 8 32 128 256 \\
        --tokens 1 2 4 8 --replay-sizes 4 8 --json docs/data/kda_grid_h200.json
    python3 scripts/plot_kda_grid.py docs/data/kda_grid_h200.json --out docs/kda_grid.png
    python3 scripts/bench_kda.py --peer-grid --peers fla sglang --pdl --json docs/data/kda_peer.json
    python3 scripts/plot_kda_grid.py docs/data/kda_peer.json --out docs/kda_peer.png

fla's % of copy counts the same state bytes as ours (its time, our bytes); a replay row's
counts its own bytes (``replay_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: _common

from _common import pyplot, save_figure  # noqa: E402

TARGETS = ((88, "88% (>= 700 items)"), (70, "70% (>= 192 items)"))
MARKERS = {4: "s", 8: "^", 16: "v"}


def series(rows, replay_rows, dtype="fp32"):
    """{T: {"ours": {H: [(items, pct)]}, "fla": {H: [...]}, "sglang": {H: [...]}, "replay":
    {(H, R): [...]}}}, points sorted by items; fla's and SGLang's % from their times over our
    row's state bytes."""
    out = {}
    copy = None
    for r in rows:
        if r.get("state_dtype", "fp32") != dtype or r.get("pct_copy") is None:
            continue
        panel = out.setdefault(r["T"], {"ours": {}, "fla": {}, "sglang": {}, "replay": {}})
        items = r["B"] * r["H"]
        panel["ours"].setdefault(r["H"], []).append((items, r["pct_copy"]))
        copy = r["state_tbs"] / (r["pct_copy"] / 100)  # the run's copy bandwidth
        if r.get("fla_us"):
            pct = 100 * r["state_bytes"] / (r["fla_us"] * 1e-6) / 1e12 / copy
            panel["fla"].setdefault(r["H"], []).append((items, pct))
        if r.get("sglang_pct_copy"):
            panel["sglang"].setdefault(r["H"], []).append((items, r["sglang_pct_copy"]))
    for r in replay_rows:
        if r.get("pct_copy") is None or r["T"] not in out:
            continue
        key = (r["H"], r["R"])
        out[r["T"]]["replay"].setdefault(key, []).append((r["B"] * r["H"], r["pct_copy"]))
    for panel in out.values():
        for group in panel.values():
            for points in group.values():
                points.sort()
    return dict(sorted(out.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="bench_kda.py --json output (a grid run)")
    parser.add_argument("--out", default="kda_grid.png")
    parser.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    panels = series(data["rows"], data.get("replay_rows", []), args.state_dtype)
    if not panels:
        parser.error(f"no {args.state_dtype} rows with a % of copy in {args.json}")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (T, panel) in zip(axes[0], panels.items(), strict=True):
        heads = sorted(panel["ours"])
        for i, H in enumerate(heads):
            color = colors[i % len(colors)]
            xs, ys = zip(*panel["ours"][H], strict=True)
            ax.plot(xs, ys, "-o", color=color, label=f"ours H {H}")
            if H in panel["fla"]:
                xs, ys = zip(*panel["fla"][H], strict=True)
                ax.plot(xs, ys, ":", color=color, label=f"fla rec H {H}")
            if H in panel["sglang"]:
                xs, ys = zip(*panel["sglang"][H], strict=True)
                ax.plot(xs, ys, "--x", color=color, label=f"SGLang H {H}")
            for (h, R), points in sorted(panel["replay"].items()):
                if h == H:
                    xs, ys = zip(*points, strict=True)
                    marker = MARKERS.get(R, "x")
                    label = f"replay R {R} H {H}"
                    ax.plot(xs, ys, marker, color=color, fillstyle="none", label=label)
        for level, label in TARGETS:
            ax.axhline(level, color="grey", lw=0.8, ls="--")
            ax.text(
                0.01, level + 1, label, color="grey", fontsize=7, transform=ax.get_yaxis_transform()
            )
        ax.set_xscale("log")
        ax.set_xlabel("(request, head) items per step")
        ax.set_ylabel("% of copy bandwidth")
        ax.set_title(f"T = {T}, {args.state_dtype} pages")
        ax.set_ylim(0, 110)
    axes[0][0].legend(fontsize=6, ncol=2)
    save_figure(fig, args.out, "KDA grid")


if __name__ == "__main__":
    main()
