"""Decode steps of one KDA layer, tensor-parallel, end to end, checked and timed.

    torchrun --nproc N launch/decode.py [options]
    mpirun -np N python launch/decode.py [options]

Each rank owns heads / N KDA heads: it runs the KDA step on its shard, its o-projection
partial, exchanges the partials and runs the all-reduce consumer (rank-order sum,
residual, AttnRes, output RMSNorm). Rank 0 replays every checked step on the whole layer
in one process and compares; every rank checks that its output is bitwise rank 0's.
The last line is ``DECODE OK`` or ``DECODE FAILED: ...`` (exit status 1).

Backends: ``host`` (CPU, torch.distributed over gloo; the reference math), ``loopback``
(one process, ``--tp N`` ranks as streams of one GPU: the KDA kernel, the o-projection
producer and the all-reduce consumer per rank, one CUDA graph per step bucket; see
``launch/gpu.py``), ``nvshmem`` (one process per GPU, one rank each, peers through
nvshmem4py symmetric memory; the same runner, checks and report, the checks and latencies
meeting on rank 0 through torch.distributed). ``auto``: loopback when CUDA is available
and the job is one process, nvshmem under torchrun / mpirun with a GPU per process and
nvshmem4py installed, host otherwise (a CPU-only machine always runs host).

    torchrun --nproc-per-node 8 launch/decode.py --backend nvshmem --heads 96 --hidden 7168 \
        --requests 8 --tokens 1 --blocks 8
    mpirun -np 8 python launch/decode.py --backend nvshmem ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from launch import report as rep
from launch.layer import Config, Model, Schedule, Unsharded, conv_cat
from tpcomm import host
from tpcomm.oproj import reference as oref
from tpcomm.symm import make_backend

_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
HOST_TOKENS = 3  # --tokens default on the host
GPU_TOKENS = 2  # --tokens default on the GPU backends (requests x tokens <= 8)
NVSHMEM_WIRED = True  # auto picks nvshmem for several processes with CUDA and nvshmem4py


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backend",
        choices=("auto", "host", "loopback", "nvshmem"),
        default="auto",
        help="auto = loopback with CUDA in one process, nvshmem under torchrun / mpirun "
        "with GPUs and nvshmem4py, host otherwise",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="TP ranks of the loopback backend (streams of one GPU; default 2); the other "
        "backends take the job's process count",
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
        default=None,
        help=f"tokens per request of the verify steps (T, 1..8; 1 = decode only); default "
        f"{HOST_TOKENS} on the host, {GPU_TOKENS} on the GPU (requests x tokens <= 8 there)",
    )
    p.add_argument("--blocks", type=int, default=3, help="AttnRes block snapshots (nb, 0..8)")
    p.add_argument(
        "--steps",
        type=int,
        default=6,
        help="steps: one single-token decode step, then verify steps",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of weights, pools and inputs")
    p.add_argument(
        "--groups",
        type=int,
        default=None,
        help="consumer polling groups (1..4); default 4 on the host, on the GPU the "
        "o-projection plan's, lowered until all ranks' consumers are co-resident",
    )
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
    gpu = p.add_argument_group("GPU backends")
    gpu.add_argument(
        "--kernel",
        choices=("auto", "wide", "stream", "split"),
        default="auto",
        help="KDA kernel (auto: kda.dispatch's choice)",
    )
    gpu.add_argument(
        "--gate-mode",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="KDA raw-gate reduction (0/1: the seed's mma.sync orders, 2: exactly rounded)",
    )
    gpu.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="programmatic dependent launch of the KDA and recover kernels (and, loopback "
        "with --one-launch, of the consumer behind the producer)",
    )
    gpu.add_argument(
        "--oproj-launch",
        choices=("per-rank", "consumer", "both"),
        default=None,
        help="loopback: o-projection launches; both (default): one producer and one consumer "
        "launch for all ranks; consumer: producers per rank, one consumer launch; per-rank",
    )
    gpu.add_argument(
        "--multicast",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="nvshmem: allow NVLink multicast (NVLS); off sets NVSHMEM_DISABLE_NVLS=1 unless "
        "the environment says otherwise, and publishing goes to each peer",
    )
    p.add_argument(
        "--fault",
        choices=("none", "output", "state"),
        default="none",
        help="test hook: the last rank corrupts its output or a state page in step 1, "
        "which the checks must catch",
    )
    return p.parse_args(argv)


def job_processes() -> int:
    """Processes of this job from the launcher's environment (1 for a plain process)."""
    if host.launcher() == "torchrun":
        return int(os.environ["WORLD_SIZE"])
    for var in _MPI_SIZE_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return 2 if host.launcher() == "mpirun" else 1  # a launcher that hides its size


def resolve_backend(requested: str) -> str:
    """``auto`` -> loopback (CUDA, one process), nvshmem (CUDA, several), else host."""
    if requested in ("auto", "loopback") and job_processes() == 1:
        # the loopback ranks need one hardware queue each, set before CUDA starts
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    if requested != "auto":
        return requested
    if not torch.cuda.is_available():
        return "host"
    if job_processes() == 1:
        return "loopback"
    # one GPU per process (a smaller node runs host rather than several PEs per GPU)
    if NVSHMEM_WIRED and job_processes() <= torch.cuda.device_count() and _nvshmem_installed():
        return "nvshmem"
    return "host"


def _nvshmem_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvshmem") is not None


def main(argv=None) -> int:
    args = parse_args(argv)
    backend_name = resolve_backend(args.backend)
    if backend_name != "host":
        args.tokens = GPU_TOKENS if args.tokens is None else args.tokens
        from launch import gpu

        return gpu.main(args, backend_name, job_processes(), host.launcher())
    args.tokens = HOST_TOKENS if args.tokens is None else args.tokens
    args.groups = 4 if args.groups is None else args.groups
    backend = make_backend("host")  # joins torchrun / mpirun / a single process
    info = host.ProcessInfo(backend.rank, backend.world, backend.rank, host.launcher())
    try:
        return run(args, info, backend)
    finally:
        backend.teardown()


def run(args, info, symm) -> int:
    backend = "host"
    if args.tp is not None and args.tp != info.world:
        if info.rank == 0:
            print(
                f"DECODE FAILED: --tp {args.tp} is for the loopback backend; the host backend "
                f"runs one rank per process ({info.world} here)",
                flush=True,
            )
        return 2
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
    check, kinds = rep.Checks(), {}

    worst = {"prefix": 0.0, "output": 0.0}  # error / bound (see launch.layer.oproj_bound_ratios)
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
                    torch.equal(conv_cat(conv_all, cfg.conv_dim_first), unsharded.kda.conv_state),
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
                    "output vs fp64 epilogue of the prefix (within bound)",
                    ref["out_ratio"] <= 1,
                    plan.index,
                )
                for key, name in (("prefix_ratio", "prefix"), ("out_ratio", "output")):
                    worst[name] = max(worst[name], ref[key])

    # Latency: per step, the slowest rank.
    per_rank = host.all_gather(
        torch.tensor([times[k] for k in (*stages, "step")], dtype=torch.float64)
    )
    slowest = per_rank.max(dim=0).values  # [stage, steps]
    ok = host.all_true(not check.failures)
    if info.rank == 0:
        report = _report(cfg, backend, info, kinds, slowest, stages, check, worst, ok)
        rep.finish(report, check.failures, args.json, _print)
    return 0 if ok else 1


def _inject(fault, output, me):
    """Flip the lowest mantissa bit of one value (the test hook of ``--fault``)."""
    if fault == "output":
        output.view(torch.int16)[0, 0] ^= 1
    elif fault == "state":
        me.kda.state.view(torch.int32)[-1, 0, 0, 0] ^= 1


def _report(cfg, backend, info, kinds, slowest, stages, checks, worst, ok):
    ms = slowest * 1e3
    lat = {
        name: {
            "median_ms": rep.percentile(ms[i].tolist(), 0.5),
            "p99_ms": rep.percentile(ms[i].tolist(), 0.99),
        }
        for i, name in enumerate((*stages, "step"))
    }
    return {
        "config": rep.config(cfg, backend, info.launcher),
        "steps": {"total": cfg.steps, **kinds},
        "latency": lat,
        "checks": checks.as_dict(),
        "worst": worst,
        "ok": ok,
    }


def _print(r):
    rep.print_config(r)
    print(f"{'latency (slowest rank)':<26}{'median ms':>12}{'p99 ms':>12}")
    for name, v in r["latency"].items():
        print(f"  {name:<24}{v['median_ms']:>12.3f}{v['p99_ms']:>12.3f}")
    rep.print_checks(r)
    w = r["worst"]
    print(
        f"  worst error / bound: prefix vs unsharded o-proj {w['prefix']:.3f}, "
        f"output vs fp64 epilogue {w['output']:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
