"""Decode steps of one KDA layer, tensor-parallel, end to end, checked and timed.

    torchrun --nproc N launch/decode.py [options]
    mpirun -np N python launch/decode.py [options]

Each rank owns heads / N KDA heads: it runs the KDA step on its shard, its o-projection
partial, exchanges the partials and runs the all-reduce consumer (rank-order sum,
residual, AttnRes, output RMSNorm). Rank 0 replays every checked step on the whole layer
in one process and compares; every rank checks that its output is bitwise rank 0's.
The last line is ``DECODE OK`` or ``DECODE FAILED: ...`` (exit status 1).

Backends: ``host`` (CPU, torch.distributed over gloo; the reference math). The GPU
backends (``loopback``, ``nvshmem``) join this entry point with the GPU kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from launch.layer import Config, Model, Schedule, Unsharded
from tpcomm import host
from tpcomm.oproj import reference as oref
from tpcomm.symm import make_backend


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backend",
        choices=("auto", "host"),
        default="auto",
        help="symmetric-memory backend; auto = host on a machine without a GPU",
    )
    p.add_argument(
        "--heads",
        type=int,
        default=16,
        help="KDA heads of the whole layer (96 in Kimi-K3); a multiple of the ranks",
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=1024,
        help="hidden width, a multiple of 1024 up to 8192 (7168 in Kimi-K3)",
    )
    p.add_argument("--requests", type=int, default=4, help="requests per step (B)")
    p.add_argument(
        "--tokens",
        type=int,
        default=3,
        help="tokens per request of the verify steps (T, 1..8); 1 = decode only",
    )
    p.add_argument("--blocks", type=int, default=3, help="AttnRes block snapshots (nb, 0..8)")
    p.add_argument(
        "--steps",
        type=int,
        default=6,
        help="steps: one single-token decode step, then verify steps",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of weights, pools and inputs")
    p.add_argument("--groups", type=int, default=4, help="consumer polling groups (1..4)")
    p.add_argument(
        "--padding",
        type=float,
        default=0.25,
        help="chance that a request is a padding row in a step",
    )
    p.add_argument(
        "--conv-layout",
        choices=("dim-first", "window-first"),
        default="dim-first",
        help="conv cache layout: [S, 3D, W] or [S, W, 3D]",
    )
    p.add_argument(
        "--check-every",
        type=int,
        default=1,
        help="rank 0 checks every k-th step against the unsharded layer (0: never)",
    )
    p.add_argument("--json", default=None, help="write the report as JSON to this path")
    p.add_argument(
        "--fault",
        choices=("none", "output", "state"),
        default="none",
        help="test hook: the last rank corrupts its output or a state page in step 1, "
        "which the checks must catch",
    )
    return p.parse_args(argv)


def _pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = make_backend("host")  # joins torchrun / mpirun / a single process
    info = host.ProcessInfo(backend.rank, backend.world, backend.rank, host.launcher())
    try:
        return run(args, info, backend)
    finally:
        backend.teardown()


def run(args, info, symm) -> int:
    backend = "host" if args.backend == "auto" else args.backend
    torch.set_num_threads(1 if info.world > 1 else torch.get_num_threads())
    cfg = Config(
        tp=info.world,
        heads=args.heads,
        hidden=args.hidden,
        requests=args.requests,
        tokens=args.tokens,
        blocks=args.blocks,
        steps=args.steps,
        seed=args.seed,
        groups=args.groups,
        conv_dim_first=args.conv_layout == "dim-first",
        padding=args.padding,
    )
    try:
        cfg.validate()
    except ValueError as e:
        if info.rank == 0:
            print(f"DECODE FAILED: {e}", flush=True)
        return 2

    model = Model(cfg)
    me = model.shard(info.rank)
    schedule = Schedule(cfg)
    unsharded = Unsharded(model) if info.rank == 0 and args.check_every else None
    stages = ("kda", "oproj", "exchange", "consume")
    times = {k: [] for k in (*stages, "step")}
    failures, checks, kinds = [], {}, {}

    def check(name, ok, step):
        checks.setdefault(name, [0, 0])
        checks[name][0] += int(ok)
        checks[name][1] += 1
        if not ok:
            failures.append(f"{name} (step {step})")

    worst = {"prefix": 0.0, "output": 0.0}  # error / bound against the unsharded o-proj
    for _ in range(cfg.steps):
        plan = schedule.next()
        kinds[plan.kind] = kinds.get(plan.kind, 0) + 1
        step, prefix, blocks = model.step_inputs(plan)
        host.barrier()
        t0 = time.perf_counter()
        attn = me.attention(plan, step)
        t1 = time.perf_counter()
        partial = oref.project(attn, me.w_o)
        t2 = time.perf_counter()
        partials = symm.all_gather(partial)
        t3 = time.perf_counter()
        output, prefix_new = me.consume(partials, prefix, blocks)
        t4 = time.perf_counter()
        if plan.index == 1 and info.rank == info.world - 1:
            _inject(args.fault, output, me)
        for k, v in zip(
            (*stages, "step"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True
        ):
            times[k].append(v)

        # Every rank: output and prefix bitwise equal to rank 0's.
        root_output, root_prefix = host.broadcast(output), host.broadcast(prefix_new)
        same = torch.equal(root_output, output) and torch.equal(root_prefix, prefix_new)
        check("outputs identical on all ranks", host.all_true(same), plan.index)
        if args.check_every and plan.index % args.check_every == 0:
            attn_all = host.all_gather(attn)
            state_all = host.all_gather(me.kda.state)
            conv_all = host.all_gather(me.kda.conv_state)
            if unsharded is not None:
                ref = unsharded.step(plan, step, prefix, blocks)
                attn_cat = torch.cat(list(attn_all), dim=1)
                check(
                    "kda outputs == unsharded (bitwise)",
                    torch.equal(attn_cat, ref["attn"]),
                    plan.index,
                )
                state_cat = torch.cat(list(state_all), dim=1)
                check(
                    "state pages == unsharded (bitwise)",
                    torch.equal(state_cat, unsharded.kda.state),
                    plan.index,
                )
                check(
                    "conv pages == unsharded (bitwise)",
                    torch.equal(_conv_cat(conv_all, cfg), unsharded.kda.conv_state),
                    plan.index,
                )
                check(
                    "output, prefix == TP reference (bitwise)",
                    torch.equal(output, ref["tp_out"])
                    and torch.equal(prefix_new, ref["tp_prefix"]),
                    plan.index,
                )
                check(
                    "prefix vs unsharded o-proj (within bound)",
                    ref["prefix_ratio"] <= 1,
                    plan.index,
                )
                check(
                    "output vs unsharded o-proj (within bound)", ref["out_ratio"] <= 1, plan.index
                )
                for key, name in (("prefix_ratio", "prefix"), ("out_ratio", "output")):
                    worst[name] = max(worst[name], ref[key])

    # Latency: per step, the slowest rank.
    per_rank = host.all_gather(
        torch.tensor([times[k] for k in (*stages, "step")], dtype=torch.float64)
    )
    slowest = per_rank.max(dim=0).values  # [stage, steps]
    ok = host.all_true(not failures)
    if info.rank == 0:
        report = _report(cfg, backend, info, kinds, slowest, stages, checks, worst, ok)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        _print(report)
        if ok:
            print("DECODE OK", flush=True)
        else:
            print(
                "DECODE FAILED: " + "; ".join(failures or ["a check failed on another rank"]),
                flush=True,
            )
    return 0 if ok else 1


def _inject(fault, output, me):
    """Flip the lowest mantissa bit of one value (the test hook of ``--fault``)."""
    if fault == "output":
        output.view(torch.int16)[0, 0] ^= 1
    elif fault == "state":
        me.kda.state.view(torch.int32)[-1, 0, 0, 0] ^= 1


def _conv_cat(conv_all, cfg):
    """Reassemble the whole layer's conv pool from the ranks' shards ([q | k | v] parts)."""
    axis = 1 if cfg.conv_dim_first else 2
    parts = []
    for p in range(3):
        for shard in conv_all:
            width = shard.shape[axis] // 3
            parts.append(shard.narrow(axis - 0, p * width, width))
    return torch.cat(parts, dim=axis)


def _report(cfg, backend, info, kinds, slowest, stages, checks, worst, ok):
    ms = slowest * 1e3
    lat = {
        name: {"median_ms": _pct(ms[i].tolist(), 0.5), "p99_ms": _pct(ms[i].tolist(), 0.99)}
        for i, name in enumerate((*stages, "step"))
    }
    return {
        "config": {
            "backend": backend,
            "launcher": info.launcher,
            "tp": cfg.tp,
            "heads": cfg.heads,
            "heads_per_rank": cfg.heads_per_rank,
            "hidden": cfg.hidden,
            "requests": cfg.requests,
            "tokens": cfg.tokens,
            "blocks": cfg.blocks,
            "groups": cfg.groups,
            "conv_layout": "dim-first" if cfg.conv_dim_first else "window-first",
            "seed": cfg.seed,
        },
        "steps": {"total": cfg.steps, **kinds},
        "latency": lat,
        "checks": {k: {"passed": v[0], "of": v[1]} for k, v in checks.items()},
        "worst": worst,
        "ok": ok,
    }


def _print(r):
    c = r["config"]
    print(
        f"config   backend {c['backend']} ({c['launcher']}), TP {c['tp']}, heads {c['heads']} "
        f"({c['heads_per_rank']}/rank), hidden {c['hidden']}, requests {c['requests']}, "
        f"tokens {c['tokens']}, blocks {c['blocks']}, groups {c['groups']}, "
        f"conv {c['conv_layout']}, seed {c['seed']}"
    )
    kinds = ", ".join(f"{v} {k}" for k, v in r["steps"].items() if k != "total")
    print(f"steps    {r['steps']['total']} ({kinds})")
    print(f"{'latency (slowest rank)':<26}{'median ms':>12}{'p99 ms':>12}")
    for name, v in r["latency"].items():
        print(f"  {name:<24}{v['median_ms']:>12.3f}{v['p99_ms']:>12.3f}")
    print("checks")
    for name, v in r["checks"].items():
        mark = "ok  " if v["passed"] == v["of"] else "FAIL"
        print(f"  {mark} {name}: {v['passed']}/{v['of']} steps")
    w = r["worst"]
    print(
        f"  vs unsharded o-proj, worst error / bound: prefix {w['prefix']:.3f}, "
        f"output {w['output']:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
