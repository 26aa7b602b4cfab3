"""One GPU's share of the decode step at serving batch: rank 0's chain, KDA ->
producer -> consumer, with the o-projection plan of one rank per GPU, stage by stage
against each stage's floor, on one GPU.

Per (TP, requests B, tokens T), Kimi-K3 shapes (96 heads, HID 7168, nb 8), every request
live, T = 4 a verify step (not recorded):

- the plan: ``launch.bucket.oproj_plan(..., "per-rank")``, what the launcher's per-rank
  launches and a rank per GPU run (twoshot past the measured crossovers,
  ``tpcomm/oproj/crossovers.json``; mma.sync producer <= 8 rows, else wgmma on sm_90),
  with the sys fence before each publish a rank per GPU has (``--no-fence``: loopback's);
- ``alone``: rank 0 of a loopback backend as one rank of a multi-GPU run: the other ranks'
  partials (twoshot: also the other owners' reduced shards in rank 0's gather row) are
  published just before by an untimed graph; rank 0's KDA kernel is the whole GPU's;
- ``chain``: rank 0's step as one graph; ``stages``: KDA, producer, consumer each its own
  graph, replayed in order with events between (the runner's stage pass, one rank);
  ``gemm``: the producer's cuBLAS GEMM alone (``attn @ w_o^T``, same shape);
- before every sample an untimed L2 flush and the publish graph: by default 256 MB zeroed,
  which leaves L2 full of dirty lines, so the timed kernels' first misses also write them
  back (as after a KDA stage that wrote its pages); ``--clean-flush``: the 256 MB read
  instead (L2 left clean: only the kernels' own bytes move); ``--no-flush``: none (one
  rank's ``w_o`` fits L2); medians of ``--replays`` samples, GPU time.

Floors, from the copy bandwidth (read + write) and a large cuBLAS GEMM's rate, both
measured in the run (``stage_bytes``): KDA = the rank's state pages read + written, its
conv windows and activations; producer = max(``w_o`` + ``attn`` + the partial's stores
(one-shot: into every rank's mailbox; twoshot: each column once), its GEMM FLOPs at the
GEMM rate); consumer = the exchange it reads (one-shot: every rank's slot; twoshot: its
shard's receive slots, the reduced shard's stores, the gather row) + prefix read and
written, blocks, output. Targets printed: chain <= 1.3 x the sum of its stage floors;
TP 16 B 8 T 1 chain <= 12 us; producer <= 1.1 x max(GEMM alone, its bytes at the copy
bandwidth). The KDA stage and the o-projection (producer + consumer) are reported apart.

    python scripts/bench_rank.py [--tp 8 16] [--requests 1 8 32 128 256] [--tokens 1 4]
                                 [--replays 30] [--json rank.json] [--no-fence]
                                 [--no-flush | --clean-flush]

Plot: ``python scripts/plot_rank.py rank8.json rank16.json --out docs/rank_rows.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts

import torch  # noqa: E402
from _common import HOST_AHEAD_CYCLES, captured, cell, median_replays  # noqa: E402
from bench_decode import BUDGET_NS, ROWS_REQUESTS, ROWS_TOKENS, _config  # noqa: E402

from engine.layer import DEFAULT_RING  # noqa: E402
from kda.validate import CONV_TAPS, HEAD_DIM  # noqa: E402
from launch.bucket import oproj_plan  # noqa: E402
from launch.layer import EPS, OUT_EPS, step_kind  # noqa: E402
from launch.report import step_bytes  # noqa: E402

CHAIN_TARGET = 1.3  # chain <= 1.3 x the sum of its stage floors
PRODUCER_TARGET = 1.1  # producer <= 1.1 x max(GEMM alone, its bytes at the copy bandwidth)
ALONE_TARGET_US = 12.0  # TP 16, B 8, T 1
L2_FLUSH_BYTES = 256 << 20  # > the H200's 50 MB L2
FLUSHES = ("write", "clean", "none")


# --- plain arithmetic (CPU-tested) --------------------------------------------------------


def stage_bytes(tp, requests, tokens, heads, hidden, blocks, twoshot, state_bytes) -> dict:
    """HBM bytes of rank 0's stages. ``state_bytes``: the whole layer's state pages read and
    written (``launch.report.step_bytes``), a rank's share its 1 / TP."""
    d_local, rows = heads // tp * HEAD_DIM, requests * tokens
    row = rows * hidden * 2  # one [rows, HID] bf16 tensor
    conv = requests * 3 * d_local * (CONV_TAPS - 1) * 2 * 2  # windows read + written
    kda = state_bytes // tp + conv + rows * d_local * 2 * 5  # x (q | k | v), gate, output
    stores = row if twoshot else tp * row  # twoshot: each column to its owner once
    producer = hidden * d_local * 2 + rows * d_local * 2 + stores
    exchange = 3 * row if twoshot else tp * row  # receive slots, shard stores, gather row
    consumer = exchange + (3 + blocks) * row  # prefix read + written, output, blocks
    return dict(kda=kda, producer=producer, consumer=consumer)


def rank_row(cfg, plan, tbps, tflops, us) -> dict:
    """One row of the table and JSON: bytes, floors, ratios and targets of the timings
    ``us`` (``kda``, ``produce``, ``consume``, ``chain``, ``gemm``; None: not measured)."""
    rows = cfg.requests * cfg.tokens
    kind = step_kind(cfg.tokens, False, False)
    state = step_bytes(cfg, kind, cfg.tokens)["state"]
    b = stage_bytes(
        cfg.tp, cfg.requests, cfg.tokens, cfg.heads, cfg.hidden, cfg.blocks, plan.twoshot, state
    )
    flops = 2 * rows * cfg.hidden * cfg.heads_per_rank * HEAD_DIM
    at_bw = {k: v / (tbps * 1e6) for k, v in b.items()}
    gemm_floor = flops / (tflops * 1e6)
    floors = dict(kda=at_bw["kda"], producer=max(at_bw["producer"], gemm_floor))
    floors["consumer"] = at_bw["consumer"]
    floors["oproj"] = floors["producer"] + floors["consumer"]
    floors["chain"] = floors["kda"] + floors["oproj"]

    def ratio(a, b):
        return None if a is None or b is None or not b else a / b

    stages = dict(kda=us.get("kda"), produce=us.get("produce"), consume=us.get("consume"))
    parts = (stages["produce"], stages["consume"])
    oproj = None if None in parts else sum(parts)
    chain, kda_us = us.get("chain"), stages["kda"]
    producer_ref = None if us.get("gemm") is None else max(us["gemm"], at_bw["producer"])
    x = dict(
        kda=ratio(kda_us, floors["kda"]),
        producer=ratio(stages["produce"], floors["producer"]),
        producer_target=ratio(stages["produce"], producer_ref),
        consumer=ratio(stages["consume"], floors["consumer"]),
        oproj=ratio(oproj, floors["oproj"]),
        chain=ratio(chain, floors["chain"]),
    )
    targets = dict(
        chain=None if x["chain"] is None else x["chain"] <= CHAIN_TARGET,
        producer=None if x["producer_target"] is None else x["producer_target"] <= PRODUCER_TARGET,
    )
    if cfg.tp == 16 and cfg.requests == 8 and cfg.tokens == 1:
        targets["alone_12us"] = None if chain is None else chain <= ALONE_TARGET_US
    out = dict(tp=cfg.tp, requests=cfg.requests, tokens=cfg.tokens, rows=rows)
    out.update(heads=cfg.heads, hidden=cfg.hidden, blocks=cfg.blocks, state_dtype=cfg.state_dtype)
    how = dict(twoshot=plan.twoshot, producer=plan.producer, groups=plan.groups)
    out.update(plan=dict(how, reason=plan.reason), bytes=b, gemm_flops=flops)
    out.update(floors_us=dict(floors, producer_bytes=at_bw["producer"], producer_gemm=gemm_floor))
    out.update(stages_us=stages, chain_us=chain, gemm_us=us.get("gemm"), oproj_us=oproj)
    out["chain_oproj_us"] = None if chain is None or kda_us is None else chain - kda_us
    out.update(x_floor=x, targets=targets)
    return out


def print_table(rows, tbps, tflops) -> None:
    """The rows as one table, then the targets missed."""
    print(
        f"\nrank 0 alone, one rank per GPU's plan; floors at {tbps:.2f} TB/s copy and "
        f"{tflops:.0f} TFLOP/s cuBLAS; us (x its floor)"
    )
    head = f"{'TP':>3}{'B':>5}{'T':>3}{'rows':>6} {'path':<13}"
    head += f"{'KDA':>16}{'producer':>16}{'GEMM':>8}{'consumer':>16}{'o-proj':>16}"
    print(head + f"{'chain':>9}{'floors':>8}{'x':>6}")
    for r in rows:
        path = f"{'twoshot' if r['plan']['twoshot'] else 'one-shot'} {r['plan']['producer']}"
        s, x = r["stages_us"], r["x_floor"]

        def both(us, ratio):
            return f"{cell(us, 8, 1)} ({cell(ratio, 5, 2).strip():>5})"

        print(
            f"{r['tp']:>3}{r['requests']:>5}{r['tokens']:>3}{r['rows']:>6} {path:<13}"
            f"{both(s['kda'], x['kda'])}{both(s['produce'], x['producer'])}"
            f"{cell(r['gemm_us'], 8, 1)}{both(s['consume'], x['consumer'])}"
            f"{both(r['oproj_us'], x['oproj'])}{cell(r['chain_us'], digits=1)}"
            f"{cell(r['floors_us']['chain'], 8, 1)}{cell(x['chain'], 6, 2)}"
        )
    print(
        f"targets: chain <= {CHAIN_TARGET} x the sum of its stage floors; TP 16 B 8 T 1 chain "
        f"<= {ALONE_TARGET_US:g} us; producer <= {PRODUCER_TARGET} x max(GEMM alone, its bytes "
        "at the copy bandwidth)"
    )
    for r in rows:
        missed = [k for k, ok in r["targets"].items() if ok is False]
        if missed:
            x = r["x_floor"]
            print(
                f"  TP {r['tp']} B {r['requests']} T {r['tokens']}: missed {', '.join(missed)} "
                f"(chain x floors {cell(x['chain'], 0, 2)}, producer x its reference "
                f"{cell(x['producer_target'], 0, 2)}, chain {cell(r['chain_us'], 0, 1)}"
                f" us, of which KDA {cell(r['stages_us']['kda'], 0, 1)} us)"
            )


# --- the GPU measurement ----------------------------------------------------------------


def stage_us(graphs, replays, before):
    """Median us of each graph, replayed in order behind ``before()`` and a GPU sleep (the
    host enqueues them meanwhile), an event after each."""
    samples = [[] for _ in graphs]
    for _ in range(replays):
        before()
        torch.cuda._sleep(HOST_AHEAD_CYCLES)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)]
        events[0].record()
        for g, e in zip(graphs, events[1:], strict=True):
            g.replay()
            e.record()
        events[-1].synchronize()
        for i, s in enumerate(samples):
            s.append(events[i].elapsed_time(events[i + 1]) * 1e3)
    return [statistics.median(s) for s in samples]


@contextlib.contextmanager
def lone_rank(cfg, fence=True, producer=None):
    """Rank 0 of a loopback runner with the per-rank plan (``oproj_plan``) and, with
    ``fence``, the sys fence of a rank per GPU; yields ``(runner, bk, plan,
    publish_others)``: ``publish_others()`` publishes the other ranks' partials of parity
    0 and, twoshot, fills rank 0's gather row with the other owners' shards. ``producer``
    "cublas": cuBLAS + publisher at every rows count instead of the plan's producer (mma.sync
    up to 8 rows, above it ``OprojGemmProducer`` on sm_90): the path it replaced."""
    from step_peers import GRIDS, first_step

    from kda.decode import plan as plan_kda
    from launch.checks import exact_gate_weights
    from launch.layer import Model
    from launch.runner import Runner
    from tpcomm.backends.loopback import LoopbackBackend
    from tpcomm.oproj.allreduce import OprojAllReduce

    model = Model(cfg)
    if GRIDS:
        exact_gate_weights(model.kda)
    backend = LoopbackBackend(cfg.tp)
    backend.check_coresident = lambda *args: None  # one rank's consumer runs at a time
    try:
        runner = Runner(cfg, model, backend, budget_ns=BUDGET_NS, oproj_launch="per-rank")
        step_plan, step, prefix, blocks = first_step(cfg, model)
        rows = cfg.requests * step_plan.tokens
        plan = oproj_plan(cfg.tp, rows, cfg.hidden, "per-rank")
        kw = dict(groups=plan.groups, eps=EPS, out_eps=OUT_EPS, budget_ns=BUDGET_NS)
        if producer == "cublas":
            plan = dataclasses.replace(plan, producer="cublas")
            kw["producer"] = "cublas"
        runner.comms[rows] = OprojAllReduce(
            backend, rows, cfg.hidden, cfg.blocks, twoshot=plan.twoshot, fence=fence, **kw
        )
        bk = runner.bucket(step_plan.tokens, step_plan.record)
        bk.kda_choice = plan_kda(
            cfg.requests, cfg.heads_per_rank, bk.tokens, runner.device, records=bk.record
        )
        runner.fill(bk, step_plan, step, prefix, blocks)
        bf = dict(device=runner.device)
        partial = torch.randn(rows, cfg.hidden, **bf).to(torch.bfloat16)
        shard = cfg.hidden // cfg.tp
        others = torch.randn(rows, cfg.hidden - shard, **bf).to(torch.bfloat16)

        def publish_others():
            for r in range(1, cfg.tp):
                bk.comm.publish(partial, 0, rank=r)
            if bk.comm.twoshot:  # the other owners' hop 2 into rank 0's gather row
                bk.comm.rows.gather_row(0)[0, :, shard:].copy_(others)

        yield runner, bk, plan, publish_others
        if int(bk.comm.errors[0, 0]):
            raise RuntimeError(f"rank 0's consumer timed out: mask {int(bk.comm.errors[0, 0])}")
    finally:
        backend.teardown()


def l2_flusher(flush: str, device="cuda", nbytes: int = L2_FLUSH_BYTES):
    """The untimed L2 flush before each sample: "write" zeroes ``nbytes`` (L2 left dirty),
    "clean" reads them (L2 left clean), "none" does nothing."""
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}; got {flush!r}")
    scrub = torch.empty(nbytes // 4 if flush != "none" else 0, dtype=torch.int32, device=device)
    sink = torch.empty((), dtype=torch.int64, device=device)

    def flush_l2():
        if flush == "clean":
            torch.sum(scrub, 0, out=sink)  # reads every line; L2 left holding clean ones
        elif flush == "write":
            scrub.zero_()

    return flush_l2


def measure(cfg, replays, fence=True, flush="write", producer=None):
    """Rank 0 alone: ({kda, produce, consume, chain, gemm} us, plan, KDA kernel). ``flush``:
    "write" (zero 256 MB: L2 left dirty), "clean" (read them: L2 left clean) or "none"."""
    flush_l2 = l2_flusher(flush)
    with lone_rank(cfg, fence, producer) as (runner, bk, plan, publish_others):

        def on_rank0(fn):
            return lambda: runner._on_ranks([0], fn)

        def chain():
            runner.enqueue(bk, 0, ranks=[0])

        kda = on_rank0(lambda r: runner._kda(bk, r))
        produce = on_rank0(lambda r: runner._produce(bk, r, 0))
        consume = on_rank0(lambda r: runner._consume(bk, r, 0))
        attn, w_o = bk.attn[0], runner.w_o[0]
        out = torch.empty(bk.rows, cfg.hidden, dtype=torch.bfloat16, device=attn.device)

        def gemm():
            torch.mm(attn, w_o.t(), out=out)

        publish_others()
        chain()  # compiles every kernel of the chain
        gemm()
        torch.cuda.synchronize()
        g_pub = captured(publish_others)
        graphs = [captured(f) for f in (chain, kda, produce, consume, gemm)]
        g_chain, g_stages, g_gemm = graphs[0], graphs[1:4], graphs[4]

        def before():
            flush_l2()
            g_pub.replay()

        us = dict(chain=median_replays(g_chain.replay, replays, before=before))
        stages = stage_us(g_stages, replays, before)
        us.update(zip(("kda", "produce", "consume"), stages, strict=True))
        us["gemm"] = median_replays(g_gemm.replay, replays, before=flush_l2)
        kernel = bk.kda_choice.kernel
    return us, plan, kernel


# --- the sweep ----------------------------------------------------------------------------


def run(args, tps, requests, tokens) -> int:
    """Every (TP, tokens, requests) row, JSON after each (a cut run keeps what it measured)."""
    from _common import copy_bandwidth
    from oproj_rows import gemm_tflops

    if args.kda_state != "per-step":
        raise SystemExit("bench_rank: per-step KDA state only")
    tbps, tflops = copy_bandwidth(), gemm_tflops()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy {tbps:.2f} TB/s, cuBLAS bf16 GEMM {tflops:.0f} TFLOP/s", flush=True)
    fence = not getattr(args, "no_fence", False)
    flush = "none" if getattr(args, "no_flush", False) else "write"
    flush = "clean" if getattr(args, "clean_flush", False) else flush
    producer = getattr(args, "producer", "plan")
    head = dict(device=f"{device} (loopback, rank 0 alone)", copy_tbps=tbps, gemm_tflops=tflops)
    head.update(date=str(datetime.date.today()), command=" ".join(sys.argv), replays=args.replays)
    head.update(fence=fence, l2_flush=flush, producer=producer)
    out = []
    for tp in tps:
        for t in tokens:
            for b in requests:
                cfg = _config(tp, b, args, t)
                try:
                    us, plan, kernel = measure(cfg, args.replays, fence, flush, producer)
                except (ValueError, RuntimeError) as e:
                    plan = oproj_plan(tp, b * t, cfg.hidden, "per-rank")
                    row = rank_row(cfg, plan, tbps, tflops, {})
                    row["skipped"] = f"{type(e).__name__}: {e}"
                else:
                    row = rank_row(cfg, plan, tbps, tflops, us)
                    row["kda_kernel"] = kernel
                out.append(row)
                _line(row)
                torch.cuda.empty_cache()
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(dict(head, rows=out), f, indent=2)
    print_table(out, tbps, tflops)
    return 0


def _line(row) -> None:
    s = row["stages_us"]
    if "skipped" in row:
        print(f"TP {row['tp']} B {row['requests']} T {row['tokens']}: skipped: {row['skipped']}")
        return
    print(
        f"TP{row['tp']:>3} B{row['requests']:>4} T{row['tokens']}: chain "
        f"{cell(row['chain_us'], 0, 1)} us (x floors "
        f"{cell(row['x_floor']['chain'], 0, 2)}), KDA {cell(s['kda'], 0, 1)}, "
        f"producer {cell(s['produce'], 0, 1)}, consumer {cell(s['consume'], 0, 1)}",
        flush=True,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    p.add_argument("--requests", type=int, nargs="+", default=list(ROWS_REQUESTS))
    p.add_argument("--tokens", type=int, nargs="+", default=list(ROWS_TOKENS))
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32")
    about = "publish without the sys fence (loopback's default; a rank per GPU fences)"
    p.add_argument("--no-fence", action="store_true", help=about)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--no-flush", action="store_true", help="no L2 flush before each sample")
    about = "flush L2 by reading 256 MB (clean lines) instead of zeroing them (dirty lines)"
    how.add_argument("--clean-flush", action="store_true", help=about)
    about = "the plan's producer (mma.sync <= 8 rows, wgmma above on sm_90) or cuBLAS + publisher"
    p.add_argument("--producer", choices=("plan", "cublas"), default="plan", help=about)
    p.set_defaults(kda_state="per-step", ring=DEFAULT_RING)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return run(args, args.tp, args.requests, args.tokens)


if __name__ == "__main__":
    sys.exit(main())
