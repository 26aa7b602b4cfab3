"""The decode job on the host backend (CPU, one rank per process, gloo): the reference math
per rank, timed by stage; rank 0 checks each ``--check-every``-th step bitwise against the
unsharded layer, every rank that its output and prefix are bitwise rank 0's.

Each rank builds only its head shard; a checked step gathers the KDA outputs, state and
conv pages to rank 0 alone. ``--timeout`` bounds the gloo collectives, and heartbeats
(``launch.liveness``) name a rank that stopped or died on every survivor's last line.
"""

from __future__ import annotations

import os
import time

import torch

from launch import report as rep
from launch.checks import inject
from launch.layer import Config, Model, Schedule, Unsharded, conv_cat, host_bytes
from launch.liveness import Liveness
from launch.procs import env_rank, job_processes
from tpcomm import host
from tpcomm.domain import check_domain_size
from tpcomm.oproj import reference as oref

STAGES = ("kda", "oproj", "exchange", "consume")


def host_memory_bytes() -> int:
    """This host's memory (``MemTotal``; the same answer on every rank of the host)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def refusal(args, world) -> str | None:
    """Why this job cannot run (decided alike on every rank, before the process group)."""
    if getattr(args, "trace", 0):
        return ("--trace stamps the GPU kernels (globaltimer); the host backend runs none: "
                "use --backend loopback or nvshmem")  # fmt: skip
    if args.tp is not None and args.tp != world:
        return (
            f"--tp {args.tp} is for the loopback backend; the host backend runs one rank per "
            f"process ({world} here)"
        )
    cfg = Config.from_args(args, world)
    try:
        cfg.validate()
        if getattr(args, "domain_size", None) is not None:
            check_domain_size(args.domain_size, world)
    except ValueError as e:
        return str(e)
    need, limit = host_bytes(cfg), host_memory_bytes()
    if need > limit:
        return (
            f"the job needs about {need / 2**30:.1f} GiB of host memory (state pools, w_o, "
            f"{world} processes); this host has {limit / 2**30:.1f} GiB"
        )
    return None


def main(args) -> int:
    """The host job in this process (joins torchrun / mpirun / a single process)."""
    from tpcomm.backends import make_backend

    why = refusal(args, job_processes())
    if why is not None:
        return rep.refuse(why, env_rank() == 0)
    backend = make_backend(
        "host", timeout_s=args.timeout, domain_size=getattr(args, "domain_size", None)
    )
    info = host.ProcessInfo(backend.rank, backend.world, backend.rank, host.launcher())
    live = None
    if info.world > 1:
        store = host.store_client(args.timeout)
        if store is not None:
            live = Liveness(info.rank, info.world, args.timeout, store,
                            host.store_client(args.timeout),
                            store_on_rank0=host.store_on_rank0())  # fmt: skip
    try:
        return run(args, info, backend, live)
    except Exception as e:
        if live is None:
            raise
        live.failed(e)  # names the rank that stopped; exits
        raise
    finally:
        if live is not None:
            live.done()
        backend.teardown()


def run(args, info, symm, live=None) -> int:
    """The steps of rank ``info.rank`` on the host backend ``symm``; the exit status."""
    torch.set_num_threads(1 if info.world > 1 else torch.get_num_threads())
    cfg = Config.from_args(args, info.world)
    root = info.rank == 0

    def arrive(tag):
        if live is not None:
            live.arrive(tag)

    model = Model(cfg)
    me = model.shard(info.rank)
    schedule = Schedule(cfg)
    unsharded = Unsharded(model) if root and args.check_every else None
    times = {k: [] for k in (*STAGES, "step")}
    check, kinds = rep.Checks(), {}

    worst = {"prefix": 0.0, "output": 0.0}  # error / bound (launch.checks.oproj_bound_ratios)
    for _ in range(cfg.steps):
        plan = schedule.next()
        i = plan.index
        kinds[plan.kind] = kinds.get(plan.kind, 0) + 1
        step, prefix, blocks = model.step_inputs(plan)
        arrive(i)  # rank 0 may still be checking the last step: wait here, not in gloo
        host.barrier()
        t0 = time.perf_counter()
        attn = me.attention(plan, step)
        t1 = time.perf_counter()
        partial = oref.project(attn, me.w_o)
        t2 = time.perf_counter()
        partials = symm.exchange(partial, i)
        t3 = time.perf_counter()
        output, prefix_new = me.consume(partials, prefix, blocks)
        t4 = time.perf_counter()
        if i == 1 and info.rank == info.world - 1:
            inject(args.fault, output, me.kda.state)
        laps = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)
        for k, v in zip((*STAGES, "step"), laps, strict=True):
            times[k].append(v)

        # Every rank: output and prefix bitwise equal to rank 0's.
        root_output, root_prefix = host.broadcast(output), host.broadcast(prefix_new)
        same = torch.equal(root_output, output) and torch.equal(root_prefix, prefix_new)
        check("outputs identical on all ranks", host.all_true(same), i)
        if not (args.check_every and i % args.check_every == 0):
            continue
        attn_all = host.gather(attn)  # rank 0 only compares: the others just send
        state_all = host.gather(me.kda.state)
        conv_all = host.gather(me.kda.conv_state)
        if unsharded is None:
            continue
        ref, u = unsharded.step(plan, step, prefix, blocks), unsharded.kda
        attn_cat, state_cat = torch.cat(list(attn_all), dim=1), torch.cat(list(state_all), dim=1)
        check("kda outputs == unsharded (bitwise)", torch.equal(attn_cat, ref["attn"]), i)
        check("state pages == unsharded (bitwise)", torch.equal(state_cat, u.state), i)
        conv_same = torch.equal(conv_cat(conv_all, cfg.conv_dim_first), u.conv_state)
        check("conv pages == unsharded (bitwise)", conv_same, i)
        del attn_all, state_all, conv_all, attn_cat, state_cat
        tp_same = torch.equal(output, ref["tp_out"]) and torch.equal(prefix_new, ref["tp_prefix"])
        check("output, prefix == TP reference (bitwise)", tp_same, i)
        check("prefix vs unsharded o-proj (within bound)", ref["prefix_ratio"] <= 1, i)
        check("output vs fp64 epilogue of the prefix (within bound)", ref["out_ratio"] <= 1, i)
        for key, name in (("prefix_ratio", "prefix"), ("out_ratio", "output")):
            worst[name] = max(worst[name], ref[key])

    # Latency: per step, the slowest rank; peak memory of every rank.
    arrive("end")
    per_rank = host.all_gather(
        torch.tensor([times[k] for k in (*STAGES, "step")], dtype=torch.float64)
    )
    slowest = per_rank.max(dim=0).values  # [stage, steps]
    ok = host.all_true(not check.failures)
    rss = host.gather(torch.tensor([rep.peak_rss_bytes()], dtype=torch.int64))
    if root:
        rss = [int(v) for v in rss[:, 0]]
        report = rep.host_report(cfg, "host", info, kinds, slowest, STAGES, check, worst, ok, rss,
                                 symm.domain.size)  # fmt: skip
        if rep.finish(report, check.failures, args.json, rep.print_host) and ok:
            return 1  # the report could not be written
    return 0 if ok else 1
