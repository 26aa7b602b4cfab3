"""One rank's o-projection producer alone, at 1..1024 rows (issue 33): OprojGemmProducer
(TMA + wgmma, publishing from its epilogue) at each CTA tile, beside the plan's producers
and the cuBLAS GEMM alone, one H200, loopback backend.

Per (TP, rows, path): rank 0's producer publishing one-shot into every rank's mailbox or,
``--twoshot``, into the owners' receive views (no consumer runs: the stores land on armed
or stale words alike, the time is the producer's). ``w_o`` rotates over copies past L2
(``ROTATE_BYTES``) so every launch reads it from HBM, as a decode step does. Columns:

- ``gemm``: the cuBLAS GEMM alone (``attn @ w_o^T`` into a staging partial, same shape);
- ``cublas+pub``: that GEMM then ``PartialPublisher`` (the plan above 8 rows);
- ``mma``: ``OprojProducer`` (mma.sync, the plan up to 8 rows);
- ``wgmma MxN``: ``OprojGemmProducer`` at tile M x N (``--tiles``), the plan's tile marked;
- ``floor``: max(``w_o`` + ``attn`` + the partial's stores at the copy bandwidth, the
  GEMM's FLOPs at a large cuBLAS GEMM's rate), both measured in the run; the issue's
  target is ``<= 1.1 x max(gemm, bytes)``.

    python3 scripts/probe_gemm.py --tp 8 16 --rows 9 32 128 256 1024 --json gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from oproj_rows import gemm_tflops, graph_us

ROTATE_BYTES = 256 << 20
TILES = ("64x64", "64x128", "128x128", "128x256")
TARGET = 1.1
REPEATS = 5  # replays of each graph (the median)


def parse_tiles(texts):
    """``MxN`` strings -> [(M, N)]; ValueError naming ``--tiles`` for anything else."""
    out = []
    for t in texts:
        try:
            m, n = (int(v) for v in t.split("x"))
        except ValueError:
            raise ValueError(f"--tiles: {t!r} is not MxN") from None
        out.append((m, n))
    return out


def floor_us(tp, rows, hid, d_local, twoshot, tbps, tflops):
    """The producer's floor (us): w_o, attn and the stores (one-shot: TP copies of the
    partial; twoshot: one) at the copy bandwidth, or its FLOPs at the GEMM rate."""
    copies = 1 if twoshot else tp
    nbytes = hid * d_local * 2 + rows * d_local * 2 + copies * rows * hid * 2
    return max(nbytes / (tbps * 1e6), 2.0 * rows * hid * d_local / (tflops * 1e6))


def measure(tp, rows, hid, d_local, twoshot, tiles):
    """{column: us} for one (TP, rows, path)."""
    from tpcomm.backends.loopback import LoopbackBackend
    from tpcomm.oproj import launcher
    from tpcomm.oproj.allreduce import OprojAllReduce
    from tpcomm.oproj.gemm import gemm
    from tpcomm.oproj.kernels.gemm import compiled_gemm_producer
    from tpcomm.oproj.plan import MAX_TOKENS, gemm_tile

    backend = LoopbackBackend(tp)
    backend.check_coresident = lambda *args: None  # no consumer runs
    try:
        comm = OprojAllReduce(backend, rows, hid, 0, twoshot=twoshot, producer="cublas")
        copies = max(2, -(-ROTATE_BYTES // (hid * d_local * 2)))
        ws = torch.randn(copies, hid, d_local, device="cuda").mul_(d_local**-0.5)
        ws = ws.to(torch.bfloat16)
        attn = torch.randn(rows, d_local, device="cuda").to(torch.bfloat16)
        partial = torch.empty(rows, hid, dtype=torch.bfloat16, device="cuda")
        out = {"gemm": graph_us(lambda i: gemm(attn, ws[i % copies].t(), partial), copies, REPEATS)}

        def cublas_pub(i):
            gemm(attn, ws[i % copies].t(), partial)
            launcher.launch_partial(comm, launcher.publisher(comm), (partial,), 0, i)

        out["cublas+pub"] = graph_us(cublas_pub, copies, REPEATS)

        def producing(fn):
            return lambda i: launcher.launch_partial(comm, fn, (attn, ws[i % copies]), 0, i)

        if rows <= MAX_TOKENS:
            comm.producer = "mma"
            out["mma"] = graph_us(producing(launcher.producer(comm, d_local)), copies, REPEATS)
        for m, n in tiles:
            fn = compiled_gemm_producer(tp, hid, d_local, tile_m=m, tile_n=n, twoshot=twoshot)
            out[f"wgmma {m}x{n}"] = graph_us(producing(fn), copies, REPEATS)
        out["plan_tile"] = "{}x{}".format(*gemm_tile(rows))
        return out
    finally:
        backend.teardown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 9, 32, 64, 128, 256, 1024])
    p.add_argument("--tiles", nargs="+", default=list(TILES))
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--twoshot", action="store_true", help="publish twoshot (per-rank plan)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    tiles = parse_tiles(args.tiles)
    from bench_kda import copy_bandwidth

    tbps, tflops = copy_bandwidth(), gemm_tflops()
    print(f"{torch.cuda.get_device_name()}: copy {tbps:.2f} TB/s, cuBLAS {tflops:.0f} TFLOP/s")
    rows_out = []
    for tp in args.tp:
        d_local = args.heads * 128 // tp
        for rows in args.rows:
            us = measure(tp, rows, args.hidden, d_local, args.twoshot, tiles)
            floor = floor_us(tp, rows, args.hidden, d_local, args.twoshot, tbps, tflops)
            bytes_us = floor_us(tp, rows, args.hidden, d_local, args.twoshot, tbps, float("inf"))
            ref = max(us["gemm"], bytes_us)
            best = min(v for k, v in us.items() if k.startswith("wgmma"))
            row = dict(tp=tp, rows=rows, d_local=d_local, twoshot=args.twoshot, us=us)
            row.update(floor_us=floor, target_ref_us=ref, wgmma_best_x_ref=best / ref)
            rows_out.append(row)
            cells = " ".join(f"{k} {v:.1f}" for k, v in us.items() if k != "plan_tile")
            verdict = f"best wgmma x max(gemm, bytes) {best / ref:.2f} (target <= {TARGET})"
            print(
                f"TP{tp:>3} rows {rows:>5}: {cells} | floor {floor:.1f} | {verdict}; "
                f"plan tile {us['plan_tile']}",
                flush=True,
            )
            if args.json:
                head = dict(copy_tbps=tbps, gemm_tflops=tflops, command=" ".join(sys.argv))
                with open(args.json, "w") as f:
                    json.dump(dict(head, rows=rows_out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
