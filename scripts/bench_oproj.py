"""Benchmark of the o-projection all-reduce consumer on the loopback backend (one GPU).

Modes, per (TP, tokens, nb), HID 7168:
- ``alone``: one rank's consumer, the other ranks' partials already in its mailbox (a
  copy refills the slots before each step; its time, measured alone, is subtracted): what
  one rank of a multi-GPU run spends, less the link latency;
- ``all``: every rank publishes (a ready partial) or produces (the GEMM) and consumes on
  its own stream (all share the GPU), per step; skipped where the ranks' CTAs cannot all
  be resident;
- ``torch``: the same math in torch ops (sum, residual, AttnRes, RMSNorm) on one GPU.
Each row shows its HBM floor: bytes moved / 4.16 TB/s (H200 copy bandwidth, H200.md).
CUDA graphs of ``--iters`` steps, median of ``--repeats`` replays.

Producer rows: one rank's ``OprojProducer`` (GEMM + fan-out publish into every mailbox,
8 weight copies cycled so that L2 does not hold them) and all ranks' producers +
consumers per step.

One-launch rows (``one launch, all ranks``; JSON ``*_1l_*``): every rank in one launch
per kernel (``run_ranks(..., mode="one-launch", pdl=True)``: one publisher or producer
launch covering all ranks, then one consumer launch covering all ranks, PDL-chained):
``cons`` the consumers alone (every mailbox refilled by a copy whose time is subtracted),
``pub+cons`` and ``prod+cons``; floors as the ``all`` columns.

Fused rows (``OprojFused``: producer + consumer in one launch, ``produce_consume``):
``fused 1`` is one rank's launch alone (the other ranks' slots refilled by a copy whose
time is subtracted; planned for one launch on the GPU, as with one rank per GPU), floor =
weights + fan-out stores + the consumer's bytes; ``fused all`` every rank's launch at
once (``run_ranks(mode="fused")``), skipped where the plan refuses them (co-residency),
floor as ``prod+cons all``. The plan's tiles per producer group (T) are reported.

    python scripts/bench_oproj.py [--quick] [--json PATH]

Rows sweep (``scripts/oproj_rows.py``: one-shot one launch, each producer, one-shot and
twoshot per-rank chunks, the torch peer, the floor, the plan's choice per bucket):

    python scripts/bench_oproj.py --rows [--tp 8 16] [--row-counts ...] [--json PATH]
                                  [--write-crossovers]

MoE copies at serving batch (``scripts/oproj_xmoe.py``: the consumer stage with 0 and
``--reps`` copies, the waiter and reader, against 1.1 x (no copies + the copies' bytes)):

    python scripts/bench_oproj.py --xmoe [--tp 8] [--row-counts 8 32 128 256 1024]
                                  [--reps 2] [--json PATH]
"""

import argparse
import json

import torch
from _common import graph_us
from oproj_rows import torch_epilogue  # the rows sweep's (this folder)

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce

COPY_TBPS = 4.16
BUDGET = 5_000_000  # ns: a rank that cannot be resident errors quickly instead of 50 ms
ROTATE = 8  # weight copies cycled through (more than the 50 MB L2 holds)
EPS = 1e-6


def _inputs(tp, tokens, hid, nb):
    bf = dict(dtype=torch.bfloat16, device="cuda")
    return dict(
        partials=(torch.randn(tp, tokens, hid, device="cuda") * 0.5).to(torch.bfloat16),
        prefix=torch.randn(tokens, hid, **bf),
        blocks=torch.randn(tokens, nb, hid, **bf) if nb else None,
        norm=(1 + 0.1 * torch.randn(hid, device="cuda")).to(torch.bfloat16),
        query=(0.2 * torch.randn(hid, device="cuda")).to(torch.bfloat16),
        out_norm=(1 + 0.1 * torch.randn(hid, device="cuda")).to(torch.bfloat16),
    )


def consumer_bytes(tp, tokens, hid, nb):
    row = tokens * hid * 2
    return 2 * tp * row + 2 * row + nb * row + row + 3 * hid * 2


def torch_consume(a, prefix, out):
    """fp32 torch ops: rank sum, residual, AttnRes softmax, RMSNorm."""
    attn = a["partials"].float().sum(0).to(torch.bfloat16)
    p = (prefix.float() + attn.float()).to(torch.bfloat16)
    prefix.copy_(p)
    torch_epilogue(p, a, out)


def bench_row(tp, tokens, nb, hid, iters, repeats):
    a = _inputs(tp, tokens, hid, nb)
    epilogue = a["blocks"], a["norm"], a["query"], a["out_norm"]  # the consumer's AttnRes inputs
    sizes = dict(eps=EPS, out_eps=EPS, budget_ns=BUDGET)
    row = dict(tp=tp, tokens=tokens, nb=nb, hid=hid)
    nbytes = consumer_bytes(tp, tokens, hid, nb)
    row["floor_alone_us"] = nbytes / COPY_TBPS / 1e6
    row["floor_all_us"] = tp * nbytes / COPY_TBPS / 1e6
    # one rank alone
    backend = LoopbackBackend(tp)
    backend.check_coresident = lambda *args: None  # one rank's launch only
    comm = OprojAllReduce(backend, tokens, hid, nb, eps=EPS, out_eps=EPS)
    prefix = a["prefix"].clone()
    out = torch.empty(tokens, hid, dtype=torch.bfloat16, device="cuda")
    box = comm.mailbox.local(0)

    def refill(i):
        box[i & 1].copy_(a["partials"])

    def alone(i):
        refill(i)
        comm.consume(prefix, *epilogue, out, i, rank=0)

    t_copy = graph_us(refill, iters, repeats)
    t_both = graph_us(alone, iters, repeats)
    row["consumer_alone_us"] = t_both - t_copy
    row["errors_alone"] = int(comm.errors.abs().sum())
    # the producer of one rank: GEMM + fan-out to every mailbox, weights rotated past L2
    d_local = 96 // tp * 128
    attn = torch.randn(tokens, d_local, device="cuda").to(torch.bfloat16)
    w_os = [
        (torch.randn(hid, d_local, device="cuda") * d_local**-0.5).to(torch.bfloat16)
        for _ in range(ROTATE)
    ]
    row["producer_alone_us"] = graph_us(
        lambda i: comm.produce(attn, w_os[i % ROTATE], i, rank=0), iters, repeats
    )
    w_bytes = hid * d_local * 2
    row["floor_producer_us"] = (w_bytes + tp * tokens * hid * 2) / COPY_TBPS / 1e6
    # one rank's fused producer + consumer: its own slot comes from its producer
    comm.mailbox.arm()  # the producer rows above left rank 0's own slots published
    others = a["partials"][1:]

    def refill_others(i):
        box[i & 1, 1:].copy_(others)

    def fused_alone(i):
        refill_others(i)
        comm.produce_consume(attn, w_os[i % ROTATE], prefix, *epilogue, out, i, rank=0, launches=1)

    try:
        row["fused_tiles_alone"] = comm.fused_plan(launches=1).tiles
        t_copy = graph_us(refill_others, iters, repeats)
        row["fused_alone_us"] = graph_us(fused_alone, iters, repeats) - t_copy
    except ValueError as e:
        row["fused_alone_us"] = None
        row["fused_alone_skipped"] = str(e)
    row["floor_fused_alone_us"] = row["floor_producer_us"] + row["floor_alone_us"]
    row["errors_alone"] += int(comm.errors.abs().sum())
    backend.teardown()
    # all ranks at once
    backend = LoopbackBackend(tp)
    prefixes = a["prefix"][None].repeat(tp, 1, 1)
    outs = torch.empty(tp, tokens, hid, dtype=torch.bfloat16, device="cuda")
    attns = torch.randn(tp, tokens, d_local, device="cuda").to(torch.bfloat16)
    w_all = (torch.randn(tp, hid, d_local, device="cuda") * d_local**-0.5).to(torch.bfloat16)
    try:
        comm = OprojAllReduce(backend, tokens, hid, nb, **sizes)

        def all_ranks(i):
            AllRanks(comm).run_ranks(a["partials"], prefixes, *epilogue, outs, i)

        row["publish_consume_all_us"] = graph_us(all_ranks, iters, repeats)

        def produce_all(i):
            AllRanks(comm).run_ranks(attns, prefixes, *epilogue, outs, i, w_os=w_all)

        row["produce_consume_all_us"] = graph_us(produce_all, iters, repeats)
        row["errors_all"] = int(comm.errors.abs().sum())

        def fused_all(i):
            AllRanks(comm).run_ranks(attns, prefixes, *epilogue, outs, i, w_os=w_all, mode="fused")

        try:
            try:
                row["fused_tiles_all"] = comm.fused_plan().tiles
            except ValueError:
                # the plan's groups do not fit 16 launches on one GPU: one polling group
                # (what a loopback deployment would run) before giving up
                backend.teardown()
                backend = LoopbackBackend(tp)
                comm = OprojAllReduce(backend, tokens, hid, nb, **sizes, groups=1)
                row["fused_tiles_all"] = comm.fused_plan().tiles
            row["fused_all_groups"] = comm.groups
            row["fused_all_us"] = graph_us(fused_all, iters, repeats)
            row["errors_all"] += int(comm.errors.abs().sum())
        except ValueError as e:
            row["fused_all_us"] = None
            row["fused_all_skipped"] = str(e)
    except ValueError as e:
        row["publish_consume_all_us"] = row["produce_consume_all_us"] = None
        row["fused_all_us"] = None
        row["all_skipped"] = str(e)
    # every rank in one launch (one publisher or producer launch, one consumer launch, PDL
    # between them): what a one-GPU deployment runs; consumers start after every partial,
    # so no co-residency rule (one_launch=True all-reduces), every token count runs
    one = OprojAllReduce(backend, tokens, hid, nb, **sizes, one_launch=True)
    boxes = one.mailbox.buffer.payload  # [TP ranks, 2, TP slots, tokens, HID]
    stacked = a["partials"][None].expand(tp, -1, -1, -1)

    def refill_all(i):
        boxes[:, i & 1].copy_(stacked)

    def consume_all(i):
        refill_all(i)
        AllRanks(one).consume_all(prefixes, *epilogue, outs, i)

    t_copy = graph_us(refill_all, iters, repeats)
    row["consumer_all_1l_us"] = graph_us(consume_all, iters, repeats) - t_copy
    row["groups_1l"] = one.groups
    for key, w in (("publish_consume_all_1l_us", None), ("produce_consume_all_1l_us", w_all)):

        def one_launch(i, w=w):
            inputs = a["partials"] if w is None else attns
            AllRanks(one).run_ranks(
                inputs, prefixes, *epilogue, outs, i, w_os=w, mode="one-launch", pdl=True
            )

        row[key] = graph_us(one_launch, iters, repeats)
    row["errors_1l"] = int(one.errors.abs().sum())
    row["floor_produce_consume_all_us"] = tp * (w_bytes + nbytes) / COPY_TBPS / 1e6
    backend.teardown()
    prefix = a["prefix"].clone()
    tout = torch.empty(tokens, hid, dtype=torch.bfloat16, device="cuda")
    row["torch_us"] = graph_us(lambda i: torch_consume(a, prefix, tout), iters, repeats)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", default="1,4,8", help="comma-separated token counts")
    parser.add_argument("--rows", action="store_true", help="the 1..1024 rows sweep")
    parser.add_argument("--xmoe", action="store_true", help="the MoE copies' rows sweep")
    parser.add_argument("--reps", type=int, default=2, help="--xmoe: copies per row")
    parser.add_argument("--tp", type=int, nargs="+", default=None, help="--rows: TP (8 16)")
    parser.add_argument(
        "--row-counts",
        type=int,
        nargs="+",
        default=None,
        help="--rows: rows per step (default 1 4 8 32 128 256 512 1024)",
    )
    parser.add_argument("--heads", type=int, default=96, help="--rows: heads of the layer")
    parser.add_argument(
        "--write-crossovers",
        action="store_true",
        help="--rows: rewrite tpcomm/oproj/crossovers.json from the sweep",
    )
    args = parser.parse_args()
    if args.xmoe:
        return xmoe_main(args)
    if args.rows:
        args.tp = [8, 16] if args.tp is None else args.tp
        return rows_main(args)
    hid = 7168
    tokens = [int(t) for t in args.tokens.split(",")]
    grid = [(tp, t, nb) for tp in (16, 8) for t in tokens for nb in (8, 0)]
    if args.quick:
        grid = [(16, 1, 8), (16, 1, 0), (8, 1, 8), (16, 8, 8)]
    rows = []
    head = f"{'TP':>3} {'T':>2} {'nb':>3} | {'cons 1':>7} {'floor':>5} | {'prod 1':>7} "
    head += f"{'floor':>5} | {'pub+cons all':>12} {'floor':>5} | "
    head += f"{'prod+cons all':>13} {'floor':>6} | "
    head += f"{'fused 1':>7} {'floor':>5} | {'fused all':>9} | {'torch':>6}"
    print(head)

    def cell(v, width, digits=2):
        return f"{v:{width}.{digits}f}" if v is not None else f"{'n/a':>{width}}"

    for tp, tokens, nb in grid:
        r = bench_row(tp, tokens, nb, hid, args.iters, args.repeats)
        rows.append(r)
        print(
            f"{tp:>3} {tokens:>2} {nb:>3} | {cell(r['consumer_alone_us'], 7)} "
            f"{cell(r['floor_alone_us'], 5)} | {cell(r['producer_alone_us'], 7)} "
            f"{cell(r['floor_producer_us'], 5)} | "
            f"{cell(r['publish_consume_all_us'], 12)} "
            f"{cell(r['floor_all_us'], 5)} | {cell(r['produce_consume_all_us'], 13)} "
            f"{cell(r.get('floor_produce_consume_all_us'), 6)} | "
            f"{cell(r['fused_alone_us'], 7)} {cell(r['floor_fused_alone_us'], 5)} | "
            f"{cell(r['fused_all_us'], 9)} | "
            f"{cell(r['torch_us'], 6)}",
            flush=True,
        )
        for key in ("fused_alone_skipped", "fused_all_skipped", "all_skipped"):
            if key in r:
                print(f"    {key}: {r[key]}", flush=True)
        print(
            f"    one launch, all ranks: cons {cell(r.get('consumer_all_1l_us'), 6)} | "
            f"pub+cons {cell(r.get('publish_consume_all_1l_us'), 6)} | "
            f"prod+cons {cell(r.get('produce_consume_all_1l_us'), 6)} | "
            f"floor {cell(r.get('floor_produce_consume_all_us'), 6)} | "
            f"groups {r.get('groups_1l')}",
            flush=True,
        )
        if r.get("fused_all_us") is not None:
            print(f"    fused all: groups {r['fused_all_groups']}, tiles {r['fused_tiles_all']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def rows_main(args):
    import oproj_rows
    from _common import copy_bandwidth

    tbps = copy_bandwidth()
    device = torch.cuda.get_device_name()
    iters = 10 if args.quick else args.iters
    rows = oproj_rows.ROWS if args.row_counts is None else tuple(args.row_counts)

    def dump(out, tflops):
        if args.json:
            with open(args.json, "w") as f:
                summary = dict(device=device, copy_tbps=tbps, gemm_tflops=tflops)
                summary["crossovers"] = oproj_rows.crossovers(out)
                json.dump(dict(summary, rows=out), f, indent=1)

    out, _ = oproj_rows.sweep(
        args.tp, rows, 7168, 8, args.heads, iters, args.repeats, tbps, on_row=dump
    )
    if args.write_crossovers:
        oproj_rows.write_crossovers(out, device)


def xmoe_main(args):
    import datetime

    import oproj_xmoe
    from _common import copy_bandwidth

    tbps = copy_bandwidth()
    device = torch.cuda.get_device_name()
    iters = 10 if args.quick else args.iters
    rows = oproj_xmoe.ROWS if args.row_counts is None else tuple(args.row_counts)
    tps = [8] if args.tp is None else args.tp
    print(f"copy {tbps:.2f} TB/s; consumer stage, every rank, one launch, us per step")
    date = datetime.date.today().isoformat()

    def dump(out):
        if args.json:
            with open(args.json, "w") as f:
                head = dict(device=device, date=date, copy_tbps=tbps, target=oproj_xmoe.TARGET)
                json.dump(dict(head, rows=out), f, indent=1)

    oproj_xmoe.sweep(tps, rows, 7168, 8, args.reps, iters, args.repeats, tbps, on_row=dump)


if __name__ == "__main__":
    main()
