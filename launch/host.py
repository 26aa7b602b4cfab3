"""The decode job on the host backend (CPU, one rank per process, gloo): each rank steps its
``engine.DecodeLayer`` (on the host backend its calls run the references and the gloo
all-reduce, the route an engine embedding the layer takes), timed by stage; rank 0 checks
each ``--check-every``-th step bitwise against the unsharded layer, every rank that its
output and prefix are bitwise rank 0's.

``--kda-state replay``: each rank runs the replay reference on its shard with a ring of its
own; a checked step also compares the ring entries bitwise, and the KDA outputs with the
per-step reference's (bitwise where ``o`` lies away from a bf16 midpoint); after the last
step every rank materialises its rings and rank 0 checks the pages against the per-step
reference's state (1e-5 of the page's max) and the unsharded replay's (bitwise).

Each rank builds only its head shard; a checked step gathers the KDA outputs, state and
conv pages to rank 0 alone. ``--timeout`` bounds the gloo collectives, and heartbeats
(``launch.liveness``) name a rank that stopped or died on every survivor's last line.
"""

from __future__ import annotations

import os
import time

import torch

from engine import DecodeLayer, all_reduces
from kda import layer as kl
from kda.operands import Ring
from kda.validate import HEAD_DIM
from launch import report as rep
from launch.checks import inject, materialized_check, replay_output_check
from launch.layer import (
    EPS,
    OUT_EPS,
    Config,
    Model,
    Schedule,
    Unsharded,
    conv_cat,
    host_bytes,
    materialize,
)
from launch.liveness import Liveness
from launch.procs import env_rank, job_processes
from tpcomm import host
from tpcomm.domain import check_domain_size

STAGES = ("kda", "recover", "produce", "consume")  # the GPU runner's (launch.runner)


def host_memory_bytes() -> int:
    """This host's memory (``MemTotal``; the same answer on every rank of the host)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def refusal(args, world) -> str | None:
    """Why this job cannot run (decided alike on every rank, before the process group)."""
    if getattr(args, "trace", 0):
        return (
            "--trace stamps the GPU kernels (globaltimer); the host backend runs none: "
            "use --backend loopback or nvshmem"
        )
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
            live = Liveness(
                info.rank,
                info.world,
                args.timeout,
                store,
                host.store_client(args.timeout),
                store_on_rank0=host.store_on_rank0(),
            )
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


def host_layer(model: Model, me, backend) -> DecodeLayer:
    """Rank ``me``'s ``DecodeLayer`` on the host backend: the job's shard, its all-reduces
    (one per rows bucket: the decode and the verify steps) and AttnRes weights."""
    cfg = model.cfg
    rows = (cfg.requests, cfg.requests * cfg.tokens)
    scalars = dict(groups=cfg.groups, eps=EPS, out_eps=OUT_EPS)
    comms = all_reduces(backend, rows, cfg.hidden, cfg.blocks, **scalars)
    state = dict(kda_state=cfg.kda_state, ring_size=cfg.ring, state_dtype=cfg.torch_state_dtype)
    state["gate_form"] = cfg.gate
    weights = dict(norm=model.norm, query=model.query, out_norm=model.out_norm)
    return DecodeLayer(me.kda, me.w_o, comms, rank=me.rank, **weights, **state)


def host_step(layer: DecodeLayer, me, plan, step, prefix, blocks):
    """One step of the job through ``layer``'s parts, timed: the rank's heads of ``step``
    (``host_attend``), ``produce``, ``consume`` (``prefix`` updated in place). Returns
    (attn, output, seconds per stage and in all)."""
    parity = plan.index & 1
    times = []
    attn = host_attend(layer, me, plan, step, times)
    t2 = time.perf_counter()
    layer.produce(attn, parity)
    t3 = time.perf_counter()
    output = torch.empty_like(prefix)
    layer.consume(prefix, blocks, output, parity)
    t4 = time.perf_counter()
    t0, t1 = times
    return attn, output, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)


def host_attend(layer: DecodeLayer, me, plan, step, times=None):
    """KDA on rank ``me``'s heads of ``step`` through ``layer``: ``attend``, and ``recover``
    after a recorded verify step. Returns attn [N, D_local]; ``times`` gets the start and the
    end of ``attend``."""
    cfg = me.model.cfg
    local = kl.shard_step(step, cfg.heads, me.first, cfg.heads_per_rank)
    records = None
    if plan.record:
        B, H, T = local.slots.shape[0], layer.heads, plan.tokens
        v_rec = torch.zeros(B, H, T, HEAD_DIM)
        records = (v_rec, torch.zeros(B, H, T, 2 * HEAD_DIM, dtype=torch.bfloat16))
    t0 = time.perf_counter()
    inputs = (local.x, local.f_a, local.beta, local.gate, local.slots)
    attn = layer.attend(*inputs, accepted=local.accepted, records=records)
    t1 = time.perf_counter()
    if times is not None:
        times += [t0, t1]
    if records is not None:
        layer.recover(local.slots, records, plan.committed, plan.accepted)
    return attn


def gather_ring(ring: Ring) -> Ring | None:
    """Every rank's ring on rank 0, heads concatenated (the whole layer's); None elsewhere."""
    parts = [host.gather(t) for t in ring]
    if parts[0] is None:
        return None
    v, kg, length = (torch.cat(list(p), dim=d) for p, d in zip(parts, (2, 2, 1), strict=True))
    return Ring(v, kg, length)


def check_materialized(state, unsharded, model, accepted, check, worst, step) -> None:
    """After the last step, the ranks' materialised pools ``state`` (whole layer): each
    request's page bitwise the unsharded replay's materialised, and within 1e-5 of the
    per-step reference's page where that path left the request's state."""
    u = unsharded.kda.clone()
    ring = Ring(*(t.clone() for t in unsharded.ring))
    materialize(u, ring, model, accepted)
    pages = model.slot_table()[:, 0].long()
    check(
        "materialized pages == unsharded materialized (bitwise)",
        torch.equal(state[pages], u.state[pages]),
        step,
    )
    worst["ring_folds"] = unsharded.folds
    if not model.cfg.cross_path:  # bf16 pages: the per-step path rounds at every store
        return
    per_step = unsharded.per_step
    ok, ratio = materialized_check(
        state, pages, per_step.kda.state, per_step.request_pages(accepted)
    )
    check(
        "materialized state vs per-step reference (1e-5 of page max)",
        ok,
        step,
        f"worst {ratio:.2e}",
    )
    worst["materialized"] = max(worst["materialized"], ratio)


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
    layer = host_layer(model, me, symm)
    schedule = Schedule(cfg)
    unsharded = Unsharded(model) if root and args.check_every else None
    times = {k: [] for k in (*STAGES, "step")}
    check, kinds = rep.Checks(), {}

    block = rep.config(cfg, "host", info.launcher, domain_size=symm.domain.size)
    progress = rep.Progress(root, block, cfg.steps)
    worst = {"prefix": 0.0, "output": 0.0}  # error / bound (launch.checks.oproj_bound_ratios)
    if cfg.replay:  # head rows not bitwise the per-step path's; materialised pages' error
        worst.update(per_step_rows=0, materialized=0.0, ring_folds=0)
    for _ in range(cfg.steps):
        plan = schedule.next()
        i = plan.index
        kinds[plan.kind] = kinds.get(plan.kind, 0) + 1
        step, prefix, blocks = model.step_inputs(plan)
        arrive(i)  # rank 0 may still be checking the last step: wait here, not in gloo
        host.barrier()
        prefix_new = prefix.clone()  # the layer updates it in place; rank 0 checks the input
        attn, output, laps = host_step(layer, me, plan, step, prefix_new, blocks)
        if i == 1 and info.rank == info.world - 1:
            inject(args.fault, output, me.kda.state)
        for k, v in zip((*STAGES, "step"), laps, strict=True):
            times[k].append(v)

        progress(i + 1)
        # Every rank: output and prefix bitwise equal to rank 0's.
        root_output, root_prefix = host.broadcast(output), host.broadcast(prefix_new)
        same = torch.equal(root_output, output) and torch.equal(root_prefix, prefix_new)
        check("outputs identical on all ranks", host.all_true(same), i)
        if not (args.check_every and i % args.check_every == 0):
            if unsharded is not None:  # the whole layer's pools follow every step
                unsharded.attention(plan, step)
            continue
        attn_all = host.gather(attn)  # rank 0 only compares: the others just send
        state_all = host.gather(me.kda.state)
        conv_all = host.gather(me.kda.conv_state)
        ring_all = gather_ring(layer.ring) if cfg.replay else None
        if unsharded is None:
            continue
        ref, u = unsharded.step(plan, step, prefix, blocks), unsharded.kda
        attn_cat, state_cat = torch.cat(list(attn_all), dim=1), torch.cat(list(state_all), dim=1)
        check("kda outputs == unsharded (bitwise)", torch.equal(attn_cat, ref["attn"]), i)
        pages = "checkpoint pages" if cfg.replay else "state pages"
        check(f"{pages} == unsharded (bitwise)", torch.equal(state_cat, u.state), i)
        conv_same = torch.equal(conv_cat(conv_all, cfg.conv_dim_first), u.conv_state)
        check("conv pages == unsharded (bitwise)", conv_same, i)
        if cfg.replay:
            same = all(torch.equal(a, b) for a, b in zip(ring_all, unsharded.ring, strict=True))
            check("ring entries and counters == unsharded (bitwise)", same, i)
        if cfg.cross_path:
            rows_live = (step.slots.view(cfg.requests, -1)[:, 0] > 0).repeat_interleave(plan.tokens)
            ok, rows, detail = replay_output_check(
                attn_cat, ref["per_step_attn"], ref["o32"], rows_live
            )
            check(
                "kda outputs vs per-step reference (bitwise off o's bf16 midpoints, "
                "else 1 ulp + o's)",
                ok,
                i,
                detail,
            )
            worst["per_step_rows"] += rows
        del attn_all, state_all, conv_all, attn_cat, state_cat
        tp_same = torch.equal(output, ref["tp_out"]) and torch.equal(prefix_new, ref["tp_prefix"])
        check("output, prefix == TP reference (bitwise)", tp_same, i)
        check("prefix vs unsharded o-proj (within bound)", ref["prefix_ratio"] <= 1, i)
        check("output vs fp64 epilogue of the prefix (within bound)", ref["out_ratio"] <= 1, i)
        for key, name in (("prefix_ratio", "prefix"), ("out_ratio", "output")):
            worst[name] = max(worst[name], ref[key])

    if cfg.replay and args.check_every:  # the engine's materialize, then the plain state
        materialize(me.kda, layer.ring, model, schedule.accepted)
        state_all = host.gather(me.kda.state)
        if unsharded is not None:
            check_materialized(
                torch.cat(list(state_all), dim=1),
                unsharded,
                model,
                schedule.accepted,
                check,
                worst,
                plan.index,
            )

    # Latency: per step, the slowest rank; peak memory of every rank.
    arrive("end")
    recorded = any(k.endswith("recover") for k in kinds)  # as the GPU report: no empty stage
    stages = tuple(k for k in STAGES if k != "recover" or recorded)
    per_rank = host.all_gather(
        torch.tensor([times[k] for k in (*stages, "step")], dtype=torch.float64)
    )
    slowest = per_rank.max(dim=0).values  # [stage, steps]
    ok = host.all_true(not check.failures)
    rss = host.gather(torch.tensor([rep.peak_rss_bytes()], dtype=torch.int64))
    if root:
        rss = [int(v) for v in rss[:, 0]]
        report = rep.host_report(
            cfg, "host", info, kinds, slowest, stages, check, worst, ok, rss, symm.domain.size
        )
        if rep.finish(report, check.failures, args.json, rep.print_host) and ok:
            return 1  # the report could not be written
    return 0 if ok else 1
