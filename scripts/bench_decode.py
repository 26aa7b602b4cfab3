"""Benchmark the whole decode step of one KDA layer on one GPU: ours on loopback beside
the same step composed from peers (T = 1, Kimi-K3 shapes, every request live).

- ``ours``: ``launch.runner.Runner``, all TP ranks on the GPU, the step's CUDA graph
  replayed (median of per-replay events) and its stage breakdown; the runner's other
  o-projection launch modes (``OPROJ_LAUNCHES``) as ``per_rank_us``.
- ``alone``: rank 0's chain only, the other ranks' partials published just before by an
  untimed graph: one rank of a multi-GPU run less the link latency. It reads one rank's
  ``w_o`` (11 MB at TP 16), which L2 may hold between replays; the others need no rotation.
- ``peer``: fla conv / ``fused_recurrent_kda`` / ``rms_norm_gated``, torch ``bmm``
  partials, their sum and the epilogue in torch, one stream, one graph (skipped without fla).
- every time is GPU time (the host enqueues each timed call while the GPU sleeps); the
  host's dispatch per call is reported for ``alone`` and ``compiled_alone``.
- ``floor``: (state pages read + written + every rank's ``w_o``) / the device-to-device
  copy bandwidth measured in this run.
- ``compiled`` (``--compiled``): the runner's own ``engine.DecodeLayer`` of each rank stepped
  by a ``torch.compile(fullgraph=True, mode="reduce-overhead")`` function (every rank's KDA
  and producer, then every consumer, on one stream), same shapes, one call per replay;
  ``compiled_alone``: rank 0's layer step compiled, set up as ``alone`` (the engine's case,
  one rank per GPU; its target: no slower than ``alone``).

    python scripts/bench_decode.py [--tp 8 16] [--requests 1 2 4 8] [--replays 50]
                                   [--json PATH] [--quick] [--compiled]

``--rows``: requests {1, 8, 32, 128, 256} x tokens {1, 4} (verify steps for 4, every
request live), ``ours`` (the default o-projection launches) and ``peer`` (T = 1 only: the
fla composition decodes one token) per (TP, requests, tokens); floor = max((state + w_o +
the exchange's mailbox bytes) / copy bandwidth, o-projection GEMM FLOPs / a large cuBLAS
GEMM's rate), both measured in the run; the plan of the runner's path per rows bucket
(one launch for every rank: one-shot). Plot (one file per TP, as in ``docs/data/``):
``python scripts/plot_rows.py dec8.json dec16.json --out docs/decode_rows.png``.

    python scripts/bench_decode.py --rows [--tp 8 16] [--json dec.json]

Rank 0's chain alone per (TP, requests, tokens), stage by stage against each stage's
floor, with the plan of a rank per GPU: ``scripts/bench_rank.py``.

``--kda-state replay [--ring R]``: ours with replay decode (each rank's ``DecodeLayer`` in
replay mode). The graph's replays advance the rings (empty at the start, so every request
folds in the same replay, one in R): each timing sample is the mean of R consecutive
replays, one fold per request in each; the stage breakdown is the first step's (no fold).
The state bytes and floor count the checkpoint page and the ring's entries
(``launch.report.step_bytes``: the fold's page write not counted).

    python scripts/bench_decode.py --rows --tp 8 --kda-state replay --ring 4 --json dec8r.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts

import torch  # noqa: E402
from _common import captured, cell, host_us, median_replays  # noqa: E402
from step_peers import GRIDS, first_step, fla_kda  # noqa: E402

from engine.layer import DEFAULT_RING, KDA_STATES  # noqa: E402
from kda import layer as kl  # noqa: E402
from kda.decode import plan as plan_kda  # noqa: E402
from launch.checks import exact_gate_weights  # noqa: E402
from launch.layer import EPS, OUT_EPS, Config, Model, step_kind  # noqa: E402
from launch.report import step_bytes  # noqa: E402
from launch.runner import DEFAULT_OPROJ_LAUNCH, OPROJ_LAUNCHES, Runner  # noqa: E402

BUDGET_NS = 5_000_000  # a rank that cannot be resident errors quickly instead of 50 ms


def _ring(cfg):
    """The replay ring's entries for the JSON rows (None in per-step mode)."""
    return cfg.ring if cfg.replay else None


def _ours_launching(mode):
    """``ours`` with the o-projection launches ``mode``: the microseconds alone."""
    return lambda cfg, model, replays: ours(cfg, model, replays, oproj_launch=mode)[0]


def _config(tp, requests, args, tokens=1):
    shape = dict(heads=args.heads, hidden=args.hidden, blocks=args.blocks)
    run = dict(steps=2, seed=tp * 100 + requests, groups=None, padding=0.0)
    state = dict(
        kda_state=args.kda_state, ring=args.ring, state_dtype=getattr(args, "state_dtype", "fp32")
    )
    cfg = Config(tp=tp, requests=requests, tokens=tokens, **shape, **run, **state)
    cfg.validate()
    return cfg


def _cycle(cfg) -> int:
    """Calls per timing sample: the ring size in replay mode (one fold per request per
    window), else 1."""
    return cfg.ring if cfg.replay else 1


def ours(cfg, model, replays, oproj_launch=None):
    """All ranks on loopback: (median us, stage breakdown, KDA kernel, consumer groups).
    ``oproj_launch``: one of ``OPROJ_LAUNCHES`` (None: the runner's loopback default)."""
    from tpcomm.backends.loopback import LoopbackBackend

    backend = LoopbackBackend(cfg.tp)
    try:
        runner = Runner(cfg, model, backend, budget_ns=BUDGET_NS, oproj_launch=oproj_launch)
        plan, step, prefix, blocks = first_step(cfg, model)
        bk = runner.bucket(plan.tokens, plan.record)
        runner.fill(bk, plan, step, prefix, blocks)
        graph, _, _ = runner.graph(bk, 0)
        us = median_replays(graph.replay, replays, cycle=_cycle(cfg))
        errors = bk.comm.errors[:, 0].tolist()
        if any(errors):
            raise RuntimeError(f"consumer timeouts during the replays: {errors}")
        return us, bk.stage_us, bk.kda_choice.kernel, bk.comm.groups
    finally:
        backend.teardown()


def layer_step(
    layers, xs, f_a, betas, gates, slots, prefixes, blocks, outputs, attns, choice, parity: int
):
    """Every rank's T = 1 step through its DecodeLayer on one stream (every partial lands
    before a consumer polls): the function ``compiled`` hands to torch.compile."""
    for r, L in enumerate(layers):
        L.attend(xs[r], f_a, betas[r], gates[r], slots, out=attns[r], choice=choice)
        L.produce(attns[r], parity)
    for r, L in enumerate(layers):
        L.consume(prefixes[r], blocks, outputs[r], parity)


def rank_step(layer, x, f_a, beta, gate, slots, prefix, blocks, output, attn, choice, parity: int):
    """One rank's T = 1 step through its DecodeLayer (KDA, producer, consumer): what an
    engine's process compiles with one rank per GPU."""
    layer.attend(x, f_a, beta, gate, slots, out=attn, choice=choice)
    layer.produce(attn, parity)
    layer.consume(prefix, blocks, output, parity)


def _compile_checked(step_fn, args, live, outputs, before=lambda: None):
    """``torch.compile(step_fn, fullgraph=True, mode="reduce-overhead")`` checked against
    the eager call of ``step_fn(*args)`` (each run after ``before()``, from the same
    ``live`` tensors: pools, prefixes): RuntimeError on a graph break, a CUDA-graph skip or
    ``outputs`` that differ from the eager call's. Returns the compiled function."""
    from torch._dynamo.utils import counters

    start = [t.clone() for t in live]

    def reset():
        for t, t0 in zip(live, start, strict=True):
            t.copy_(t0)
        before()

    reset()
    step_fn(*args)  # eager: compiles every kernel; the reference result
    torch.cuda.synchronize()
    want = [t.clone() for t in outputs]
    reset()
    explained = torch._dynamo.explain(step_fn)(*args)
    if explained.graph_break_count:
        raise RuntimeError(f"graph breaks: {explained.break_reasons}")
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(step_fn, fullgraph=True, mode="reduce-overhead", dynamic=False)
    for _ in range(3):  # warm-up, record, replay: each from the same pools and prefixes
        reset()
        fn(*args)
    torch.cuda.synchronize()
    if counters["inductor"]["cudagraph_skips"]:
        raise RuntimeError(f"CUDA graphs skipped: {dict(counters['inductor'])}")
    if not all(torch.equal(a, b) for a, b in zip(outputs, want, strict=True)):
        raise RuntimeError("the compiled step differs from the eager step")
    return fn


def _static(tensors):
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_static_address(t)
    return tensors


def compiled(cfg, model, replays):
    """The runner's DecodeLayers (``Runner.decode_layers``) stepped by ``layer_step`` under
    ``torch.compile(fullgraph=True, mode="reduce-overhead")``: median us per call. Refuses
    (RuntimeError) on a graph break, a CUDA-graph skip, a consumer timeout or a result
    that differs from the eager call's."""
    from tpcomm.backends.loopback import LoopbackBackend

    backend = LoopbackBackend(cfg.tp)
    try:
        runner = Runner(cfg, model, backend, budget_ns=BUDGET_NS)
        plan, step, prefix, blocks = first_step(cfg, model)
        bk = runner.bucket(1, False)
        runner.fill(bk, plan, step, prefix, blocks)
        n = len(runner.ranks)

        def ranks(t):  # each rank's own copy
            return [t[i].clone() for i in range(n)]

        bufs = dict(xs=ranks(bk.x), f_a=bk.f_a, betas=ranks(bk.beta), gates=ranks(bk.gate))
        bufs.update(slots=bk.slots, prefixes=ranks(bk.prefix), blocks=bk.blocks)
        bufs.update(outputs=ranks(bk.output), attns=ranks(bk.attn))
        for v in bufs.values():
            _static(v if isinstance(v, list) else [v])
        args = (runner.decode_layers, *bufs.values(), runner.kda_choice(bk), 0)
        live = [t for L in runner.decode_layers for t in (L.shard.state, L.shard.conv_state)]
        fn = _compile_checked(layer_step, args, live + bufs["prefixes"], bufs["outputs"])
        us = median_replays(lambda: fn(*args), replays, cycle=_cycle(cfg))  # the pools move on
        errors = bk.comm.errors[:, 0].tolist()
        if any(errors):
            raise RuntimeError(f"consumer timeouts during the replays: {errors}")
        return us
    finally:
        torch._dynamo.reset()
        backend.teardown()


@contextlib.contextmanager
def _lone_rank(cfg, model):
    """Rank 0 of a loopback backend as one rank of a multi-GPU run: its bucket filled, the
    KDA kernel a lone rank gets (the whole GPU), and ``publish_others()``, which publishes
    the other ranks' partials of parity 0. Yields ``(runner, bk, publish_others)``; raises
    RuntimeError afterwards if rank 0's consumer timed out."""
    from tpcomm.backends.loopback import LoopbackBackend

    backend = LoopbackBackend(cfg.tp)
    backend.check_coresident = lambda *args: None  # one rank's consumer runs at a time
    try:
        runner = Runner(cfg, model, backend, budget_ns=BUDGET_NS)
        plan, step, prefix, blocks = first_step(cfg, model)
        bk = runner.bucket(1, False)
        bk.kda_choice = plan_kda(
            cfg.requests, cfg.heads_per_rank, bk.tokens, runner.device, records=bk.record
        )
        runner.fill(bk, plan, step, prefix, blocks)
        partial = torch.randn(bk.rows, cfg.hidden, device=runner.device).to(torch.bfloat16)

        def publish_others():
            for r in range(1, cfg.tp):
                bk.comm.publish(partial, 0, rank=r)

        yield runner, bk, publish_others
        if int(bk.comm.errors[0, 0]):
            raise RuntimeError(f"rank 0's consumer timed out: mask {int(bk.comm.errors[0, 0])}")
    finally:
        backend.teardown()


def compiled_alone(cfg, model, replays):
    """Rank 0's DecodeLayer step (``rank_step``) under ``torch.compile(fullgraph=True,
    mode="reduce-overhead")``, the other ranks' partials published first by an untimed
    graph, as ``alone``: the engine's case (one rank per GPU), against ``alone``."""
    try:
        with _lone_rank(cfg, model) as (runner, bk, publish_others):
            layer = runner.decode_layers[0]
            rank0 = (bk.x, bk.beta, bk.gate, bk.prefix, bk.output, bk.attn)
            x, beta, gate, prefix, output, attn = (t[0].clone() for t in rank0)
            bufs = _static([x, bk.f_a, beta, gate, bk.slots, prefix, bk.blocks, output, attn])
            args = (layer, *bufs, runner.kda_choice(bk), 0)
            live = [layer.shard.state, layer.shard.conv_state, bufs[5]]
            fn = _compile_checked(rank_step, args, live, [bufs[7]], before=publish_others)
            g_pub = captured(publish_others)
            us = median_replays(lambda: fn(*args), replays, before=g_pub.replay, cycle=_cycle(cfg))
            host = host_us(lambda: fn(*args), replays, before=g_pub.replay)
        return us, host
    finally:
        torch._dynamo.reset()


def alone(cfg, model, replays):
    """Rank 0's chain with the other ranks' partials published first (untimed)."""
    with _lone_rank(cfg, model) as (runner, bk, publish_others):

        def rank0():
            runner.enqueue(bk, 0, ranks=[0])

        publish_others()
        rank0()  # compiles
        torch.cuda.synchronize()
        g_pub, g_one = captured(publish_others), captured(rank0)
        us = median_replays(g_one.replay, replays, before=g_pub.replay, cycle=_cycle(cfg))
        host = host_us(g_one.replay, replays, before=g_pub.replay)
    return us, host


def peer(cfg, model, replays, device="cuda"):
    """The torch / fla composition of the same step (all ranks, one stream, one graph)."""
    from _common import time_graph

    dev = torch.device(device)
    B, tp, hid = cfg.requests, cfg.tp, cfg.hidden
    Dl = cfg.heads_per_rank * 128
    layer = model.kda.clone().to(dev)
    _, step, prefix, blocks = first_step(cfg, model)
    s = kl.step_to(step, dev)
    kda = fla_kda(layer, s.x, s.f_a, s.beta, s.gate, s.slots)
    w_o = model.w_o.to(dev).view(hid, tp, Dl).permute(1, 2, 0).contiguous()  # [tp, Dl, HID]
    prefixes = prefix.to(dev)[None].repeat(tp, 1, 1)
    blocks = None if blocks is None else blocks.to(dev)
    w = model.norm.to(dev).float() * model.query.to(dev).float()
    out_norm = model.out_norm.to(dev).float()
    output = torch.empty(tp, B, hid, device=dev, dtype=torch.bfloat16)

    def fn():
        attn = kda().view(B, tp, Dl).transpose(0, 1)  # [tp, B, Dl]
        partials = torch.bmm(attn, w_o)  # [tp, B, HID] bf16, fp32 accumulation
        total = partials.float().sum(0).to(torch.bfloat16)
        p = (prefixes.float() + total.float()).to(torch.bfloat16)  # every rank's prefix_new
        prefixes.copy_(p)
        pf = p.float()
        if blocks is None:
            h, h_eps = pf, OUT_EPS
        else:
            v = torch.cat([blocks.float()[None].expand(tp, -1, -1, -1), pf[:, :, None]], dim=2)
            logits = (v @ w) * torch.rsqrt(v.pow(2).sum(-1) / hid + EPS)
            h, h_eps = (torch.softmax(logits, dim=2)[..., None] * v).sum(2), OUT_EPS
        output.copy_(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + h_eps) * out_norm)

    return time_graph(fn, replays=replays)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="requests 8 only, 20 replays")
    about = "also the compiled DecodeLayer step (column 'compiled')"
    p.add_argument("--compiled", action="store_true", help=about)
    about = "ours: per-step state pages or replay (checkpoint + ring); the fla peer is per-step "
    about += "either way"
    p.add_argument("--kda-state", choices=KDA_STATES, default=KDA_STATES[0], help=about)
    about = "state pages: fp32 or bf16 (bytes and floor with that page size)"
    p.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32", help=about)
    p.add_argument(
        "--ring",
        type=int,
        default=DEFAULT_RING,
        help="replay: ring entries per state page (>= the verify tokens)",
    )
    p.add_argument(
        "--rows",
        action="store_true",
        help="requests {1, 8, 32, 128, 256} x tokens {1, 4}: ours, peer, floor",
    )
    args = p.parse_args(argv)
    if args.rows:
        return rows_main(args)
    if args.quick:
        args.requests, args.replays = [8], 20
    from _common import copy_bandwidth

    tbps = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: device-to-device copy {tbps:.2f} TB/s (read + write)")
    rows = []
    for tp in args.tp:
        for requests in args.requests:
            cfg = _config(tp, requests, args)
            model = Model(cfg)
            if GRIDS:
                exact_gate_weights(model.kda)
            b = step_bytes(cfg, step_kind(1, False, cfg.replay), 1)
            row = dict(tp=tp, requests=requests, heads=cfg.heads, hidden=cfg.hidden)
            row.update(kda_state=cfg.kda_state, ring=_ring(cfg), blocks=cfg.blocks)
            row.update(state_dtype=cfg.state_dtype)
            row.update(state_bytes=b["state"], w_o_bytes=b["w_o"])
            row["floor_us"] = (b["state"] + b["w_o"]) / (tbps * 1e6)
            others = [m for m in OPROJ_LAUNCHES if m != DEFAULT_OPROJ_LAUNCH]
            variants = [(m.replace("-", "_"), _ours_launching(m)) for m in others]
            extra = []
            if args.compiled:
                extra = [("compiled", compiled), ("compiled_alone", compiled_alone)]
            for name, fn in [("ours", ours), *variants, *extra, ("alone", alone), ("peer", peer)]:
                try:
                    result = fn(cfg, model, args.replays)
                except (ImportError, ValueError, RuntimeError) as e:
                    row[f"{name}_us"], row[f"{name}_skipped"] = None, f"{type(e).__name__}: {e}"
                    continue
                if name == "ours":
                    us, row["stages_us"], row["kernel"], row["groups"] = result
                    row["ours_us"] = us
                elif name in ("alone", "compiled_alone"):  # GPU us, host us per call
                    row[f"{name}_us"], row[f"{name}_host_us"] = result
                else:
                    row[f"{name}_us"] = result
                torch.cuda.empty_cache()
            rows.append(row)
            _print_row(row)
    _print_table(rows, tbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "copy_tbps": tbps, "rows": rows}, f, indent=2)
    return 0


ROWS_REQUESTS = (1, 8, 32, 128, 256)
ROWS_TOKENS = (1, 4)


def rows_main(args) -> int:
    """The rows sweep: one line per (TP, requests, tokens), JSON for ``plot_rows.py``."""
    from _common import copy_bandwidth
    from oproj_rows import gemm_tflops

    from tpcomm.oproj.plan import choose

    tbps, tflops = copy_bandwidth(), gemm_tflops()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy {tbps:.2f} TB/s, cuBLAS bf16 GEMM {tflops:.0f} TFLOP/s")
    out = []
    for tp in args.tp:
        for tokens in ROWS_TOKENS:
            for requests in ROWS_REQUESTS:
                rows = requests * tokens
                cfg = _config(tp, requests, args, tokens)
                model = Model(cfg)
                if GRIDS:
                    exact_gate_weights(model.kda)
                b = step_bytes(cfg, step_kind(tokens, False, cfg.replay), tokens)
                # the runner's path: one launch for every rank (one-shot), else per-rank
                # launches, one-shot too (the launcher's checks read the mailbox)
                launch = dict(one_launch=True) if DEFAULT_OPROJ_LAUNCH == "both" else {}
                plan = choose(tp, rows, cfg.hidden, twoshot=False, **launch)
                exchange = tp * plan.bytes // 2  # every rank's mailbox, one parity
                hbm = b["state"] + b["w_o"] + exchange
                flops = 2 * rows * cfg.hidden * cfg.heads * 128
                floor = max(hbm / (tbps * 1e6), flops / (tflops * 1e6))
                row = dict(tp=tp, requests=requests, tokens=tokens, rows=rows)
                row.update(kda_state=cfg.kda_state, ring=_ring(cfg), state_bytes=b["state"])
                row.update(state_dtype=cfg.state_dtype)
                row.update(w_o_bytes=b["w_o"], exchange_bytes=exchange, gemm_flops=flops)
                how = dict(producer=plan.producer, twoshot=plan.twoshot, reason=plan.reason)
                row.update(floor_us=floor, plan=how)
                for name, fn in (("ours", ours), ("peer", peer)):
                    if name == "peer" and tokens > 1:
                        row["peer_us"], row["peer_skipped"] = None, "the fla peer is T = 1"
                        continue
                    try:
                        result = fn(cfg, model, args.replays)
                    except (ImportError, ValueError, RuntimeError) as e:
                        row[f"{name}_us"] = None
                        row[f"{name}_skipped"] = f"{type(e).__name__}: {e}"
                        continue
                    if name == "ours":
                        row["ours_us"], row["stages_us"], row["kernel"], _ = result
                    else:
                        row["peer_us"] = result
                    torch.cuda.empty_cache()
                out.append(row)
                ours_us, peer_us = row["ours_us"], row["peer_us"]
                print(
                    f"TP{tp:>3} B{requests:>4} T{tokens}: rows {rows:>5} ours {cell(ours_us)} "
                    f"peer {cell(peer_us)} floor {cell(floor)} "
                    f"x floor {cell(None if ours_us is None else ours_us / floor)} | "
                    f"{plan.reason}",
                    flush=True,
                )
                _print_row(row)
                if args.json:  # after every row: a cut run keeps what it measured
                    with open(args.json, "w") as f:
                        summary = {"device": device, "copy_tbps": tbps, "gemm_tflops": tflops}
                        json.dump(dict(summary, rows=out), f, indent=2)
    return 0


def _print_row(row):
    for key in [k for k in row if k.endswith("_skipped")]:
        print(f"  TP {row['tp']} B {row['requests']}: {key[:-8]} skipped: {row[key]}")


def _print_table(rows, tbps):
    print(f"\nT = 1, all requests live; floor = (state + w_o bytes) / {tbps:.2f} TB/s")
    head = f"{'TP':>3}{'B':>4}{'ours us':>9}{'alone us':>9}{'peer us':>9}"
    print(head + f"{'floor us':>9}{'x floor':>9}{'peer/ours':>10}  kernel, groups, stages (us)")
    for r in rows:
        ours_us, peer_us = r.get("ours_us"), r.get("peer_us")
        ratio = None if ours_us is None else ours_us / r["floor_us"]
        speed = None if ours_us is None or peer_us is None else peer_us / ours_us
        stages = ", ".join(f"{k} {v:.1f}" for k, v in (r.get("stages_us") or {}).items())
        print(
            f"{r['tp']:>3}{r['requests']:>4}{cell(ours_us)}{cell(r.get('alone_us'))}"
            f"{cell(peer_us)}{cell(r['floor_us'])}{cell(ratio)}{cell(speed, 10)}"
            f"  {r.get('kernel', '-')}, {r.get('groups', '-')}, {stages}"
        )
    for r in rows:
        if "compiled_us" in r:  # --compiled
            c, o = r["compiled_us"], r.get("ours_us")
            ca, a = r.get("compiled_alone_us"), r.get("alone_us")
            vs = "-" if c is None or o is None else f"{c / o:.2f} x ours"
            va = "-" if ca is None or a is None else f"{ca / a:.2f} x alone"
            print(
                f"  TP {r['tp']} B {r['requests']}: compiled DecodeLayer step, one rank "
                f"(engine, one rank per GPU) {cell(ca).strip()} us GPU ({va}; target <= "
                f"1.00 x), host dispatch {cell(r.get('compiled_alone_host_us')).strip()} us "
                f"per call (graph replay: {cell(r.get('alone_host_us')).strip()} us); "
                f"every rank on one stream {cell(c).strip()} us ({vs})"
            )
    for r in rows:
        modes = ", ".join(
            f"{m} {r[k]:.2f} us"
            for m in OPROJ_LAUNCHES
            if r.get(k := f"{m.replace('-', '_')}_us") is not None
        )
        print(
            f"  TP {r['tp']} B {r['requests']}: ours = o-projection launches "
            f"{DEFAULT_OPROJ_LAUNCH}; other modes: {modes or '-'}"
        )
    print("targets (B 8): alone <= 12 us; ours <= 1.3 x floor; peer / ours >= 2")


if __name__ == "__main__":
    sys.exit(main())
