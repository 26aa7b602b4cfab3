"""Latency against requests, one line per TP, from ``launch/decode.py --json`` reports.

    python scripts/plot_decode.py reports/*.json --out decode_latency.png [--kind step]

Each report is one point: x = its ``config.requests``, y = the median latency of
``--kind`` (``step``: every step; or ``decode``, ``verify``, ``verify+record+recover``),
with the p99 as an error bar; points of one (backend, TP, hidden, heads, tokens) form a
line. GPU reports give microseconds, host reports milliseconds: both are drawn in us.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: _common

from _common import pyplot, save_figure  # noqa: E402


def load(paths, kind="step"):
    """{(backend, tp, hidden, heads, tokens): [(requests, median_us, p99_us), ...]}."""
    series: dict = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        c, lat = report["config"], report["latency"].get(kind)
        if lat is None:
            print(f"{path}: no '{kind}' latency; skipped", file=sys.stderr)
            continue
        if "median_us" in lat:
            median, p99 = lat["median_us"], lat["p99_us"]
        else:
            median, p99 = lat["median_ms"] * 1e3, lat["p99_ms"] * 1e3
        key = (c["backend"], c["tp"], c["hidden"], c["heads"], c["tokens"])
        series.setdefault(key, []).append((c["requests"], median, p99))
    return {k: sorted(v) for k, v in sorted(series.items())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="JSON reports of launch/decode.py --json")
    p.add_argument("--out", default="decode_latency.png", help="image to write")
    p.add_argument("--kind", default="step", help="latency row: step, decode, verify, ...")
    args = p.parse_args(argv)
    series = load(args.reports, args.kind)
    if not series:
        print("no report has that latency row", file=sys.stderr)
        return 1
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for (backend, tp, hidden, heads, tokens), points in series.items():
        x = [r for r, _, _ in points]
        y = [m for _, m, _ in points]
        up = [max(0.0, q - m) for _, m, q in points]
        label = f"TP {tp} ({backend}, {heads} heads, hidden {hidden}, T {tokens})"
        ax.errorbar(x, y, yerr=[[0.0] * len(up), up], marker="o", capsize=3, label=label)
    ax.set_xlabel("requests per step")
    ax.set_ylabel(f"{args.kind} latency, median (bar: p99), us")
    ax.set_title("KDA layer decode step: latency against requests")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, args.out, f"{sum(len(v) for v in series.values())} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
