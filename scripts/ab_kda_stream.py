"""A/B timing of KdaStream trace-time switches (CUDA graphs, same run): each named class
attribute of ``kda.stream.KdaStream`` set to each value, compiled afresh.

    python scripts/ab_kda_stream.py [--attr STAGED_GATE] [--values 1 0]
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from bench_kda import ours, setup, time_graph  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attr", default="STAGED_GATE")
    p.add_argument("--values", type=int, nargs="+", default=[1, 0])
    p.add_argument("--shapes", default="96x128x1,12x128x1,96x128x4")
    args = p.parse_args(argv)
    import kda.ops
    from kda.stream import KdaStream

    for shape in args.shapes.split(","):
        H, B, T = (int(v) for v in shape.split("x"))
        layer, steps = setup(H, B, T, rotations=4)
        cells = []
        for v in args.values:
            setattr(KdaStream, args.attr, bool(v))
            kda.ops._CACHE.clear()
            us = time_graph(ours(layer, steps, "stream"), replays=7) / len(steps)
            cells.append(f"{args.attr}={v}: {us:8.1f} us")
        print(f"H {H:3d} B {B:3d} T {T}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
