"""Temporary probe (not committed): KdaPipe beside KdaStream at deployed shapes."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from bench_kda import ours, rotations_for, setup, time_graph  # noqa: E402

for H, B, T in [(6, 128, 1), (12, 32, 1), (12, 64, 1), (12, 256, 1), (24, 128, 1), (96, 32, 1),
                (6, 256, 1), (12, 128, 2), (96, 128, 2), (6, 128, 4), (24, 32, 1)]:
    rot, per = rotations_for(H, B, T)
    layer, steps = setup(H, B, T, rot)
    row = dict(H=H, B=B, T=T, bytes=per)
    for name, gm in (("stream", 3), ("pipe", 3), ("wide", 3), ("pipe", 0)):
        row[f"{name}{gm}"] = time_graph(ours(layer, steps, name, gm), inner=rot)
    print(json.dumps(row), flush=True)
    del layer, steps
