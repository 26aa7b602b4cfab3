"""The decode job on the GPU: ``loopback`` (one process, ``--tp N`` ranks as streams of one
GPU) or ``nvshmem`` (one process and rank per GPU under torchrun / mpirun).

Every step replays its bucket's CUDA graph (``launch.runner``) and is checked: outputs and
prefixes bitwise rank 0's, no consumer timeout, the first replay bitwise the eager run and
the stage pass; every ``--check-every``-th step against the unsharded layer
(``launch.checks.check_step``). With several processes the checks and latencies meet on
process 0 through torch.distributed (``launch.procs.Procs``), which prints the report.
``--trace``: then traced steps (``launch.trace``), their timeline in the report.
``--kda-state replay``: the unsharded replay reference starts each checked step from the
gathered checkpoint pages and rings, the per-step reference follows every step; after the
checked steps every rank materialises its rings (``DecodeLayer.materialize``) and the pages
are checked against the per-step reference's state (``check_materialized``).
"""

from __future__ import annotations

import torch

from kda.validate import check_slot_values
from launch import report as rep
from launch import trace
from launch.checks import (
    SEED_GATE_MODES,
    check_step,
    exact_gate_inputs,
    exact_gate_weights,
    inject,
    materialized_check,
)
from launch.layer import Config, Model, Schedule, Unsharded
from launch.procs import Procs, env_rank, nvshmem_installed, nvshmem_job
from launch.runner import BACK_TO_BACK, Runner, check_rows
from tpcomm.domain import check_domain_size


def main(args, backend_name: str, processes: int, launcher: str) -> int:
    """``launch/decode.py`` on a GPU backend (loopback or nvshmem); the exit status."""
    speak = env_rank() == 0

    def refuse(message):
        return rep.refuse(message, speak)

    if backend_name not in ("loopback", "nvshmem"):
        return refuse(f"launch/gpu.py runs loopback or nvshmem, not {backend_name}")
    if backend_name == "loopback" and processes != 1:
        return refuse(
            f"--backend loopback runs every rank in one process; this job has {processes} "
            "(use --nproc-per-node 1 / -np 1, or --backend nvshmem)"
        )
    if backend_name == "nvshmem" and args.tp is not None and args.tp != processes:
        return refuse(
            f"--tp {args.tp} is for the loopback backend; the nvshmem backend runs one rank "
            f"per process and GPU ({processes} here)"
        )
    tp = processes if backend_name == "nvshmem" else (args.tp or 2)
    try:
        cfg = Config.from_args(args, tp)
        cfg.validate()
        check_rows(cfg.requests, cfg.tokens)
        domain_size = getattr(args, "domain_size", None)
        if domain_size is not None:
            check_domain_size(domain_size, tp)
        if not torch.cuda.is_available():
            what = "a CUDA GPU per process" if backend_name == "nvshmem" else "a CUDA GPU"
            raise ValueError(f"--backend {backend_name} needs {what}")
        if backend_name == "nvshmem" and not nvshmem_installed():
            raise ValueError(
                "--backend nvshmem needs nvshmem4py (nvshmem.core; pip install "
                "nvshmem4py-cu13); --backend loopback --tp N runs every rank on one GPU"
            )
    except ValueError as e:
        return refuse(str(e))
    from tpcomm.backends import make_backend

    if backend_name == "nvshmem":
        multicast, timeout = getattr(args, "multicast", False), getattr(args, "timeout", 300.0)
        with nvshmem_job(launcher, multicast, timeout, domain_size) as (backend, procs):
            return run(args, cfg, backend, launcher, procs)
    backend = make_backend("loopback", world=cfg.tp, domain_size=domain_size)
    try:
        return run(args, cfg, backend, launcher)
    finally:
        backend.teardown()


def run(args, cfg: Config, backend, launcher="single", procs: Procs | None = None) -> int:
    """The steps on ``backend``'s ranks; with several processes every one calls this (the
    checks and latencies meet on process 0, which prints the report)."""
    procs = Procs() if procs is None else procs
    model = Model(cfg)
    grids = args.gate_mode in SEED_GATE_MODES  # the seed's orders: gate inputs on exact grids
    if grids:
        exact_gate_weights(model.kda)  # before the shards and the unsharded copy share it
    try:
        runner = Runner(
            cfg,
            model,
            backend,
            kernel=args.kernel,
            gate_mode=args.gate_mode,
            pdl=args.pdl,
            procs=procs,
            oproj_launch=getattr(args, "oproj_launch", None),
            xmoe=getattr(args, "xmoe", 0),
        )
    except ValueError as e:
        return rep.refuse(str(e), procs.root)
    block = rep.config(cfg, backend.name, launcher, domain_size=backend.domain.size)
    progress = rep.Progress(procs.root, block, cfg.steps)  # the configuration line first
    unsharded = Unsharded(model) if args.check_every and procs.root else None
    schedule = Schedule(cfg)
    check, kinds = rep.Checks(), {}
    latency: list[tuple[str, float]] = []  # (kind, us) per step, this process's ranks
    worst = {
        "kda_ulp": 0.0,
        "kda_exact": 1.0,
        "state": 0.0,
        "output_ulp": 0.0,
        "partial_ulp": 0.0,
        "prefix": 0.0,
        "output": 0.0,
    }
    if cfg.replay:  # vs the per-step reference; the ring's v_new; materialised pages
        worst.update(per_step_ulp=0.0, ring=0.0, materialized=0.0, ring_folds=0)
    for _ in range(cfg.steps):
        plan = schedule.next()
        kinds[plan.kind] = kinds.get(plan.kind, 0) + 1
        step, prefix, blocks = model.step_inputs(plan)
        if grids:
            exact_gate_inputs(step)
        check_slot_values(step.slots, step.accepted, plan.tokens, cfg.pages, cfg.pages)
        parity = plan.index & 1
        error = None
        try:
            bk = runner.bucket(plan.tokens, plan.record)
            runner.fill(bk, plan, step, prefix, blocks)
            _, eager, staged = runner.graph(bk, parity)
        except (RuntimeError, ValueError) as e:
            error = str(e)
        errors = [f"rank {r}: {e}" for r, e in enumerate(procs.objects(error)) if e]
        if errors:
            detail = errors[0] if procs.count > 1 else error
            check(f"{plan.kind}: first run", False, plan.index, detail)
            break
        checked = bool(args.check_every) and plan.index % args.check_every == 0
        before_state = None
        if checked:
            before_state, before_conv = runner.gather_pools()
            before_ring = runner.gather_ring() if cfg.replay else None
            if unsharded is not None:
                unsharded.kda.state.copy_(before_state)
                unsharded.kda.conv_state.copy_(before_conv)
                if cfg.replay:
                    for t, t0 in zip(unsharded.ring, before_ring, strict=True):
                        t.copy_(t0)
        elif unsharded is not None and cfg.replay:  # the per-step reference follows every step
            unsharded.per_step.step(step)
        runner.moe.poison(bk)
        latency.append((plan.kind, runner.replay(bk, parity)))
        masks = runner.timeout_masks(bk)
        moe_detail = [d for d in procs.objects(runner.moe.problems(bk)) if d] if runner.xmoe else []
        if not check("no consumer timeout", not any(masks), plan.index, f"masks {masks}"):
            bk.comm.reset()
        moe_name = "MoE copies read after their hints == output (bitwise)"
        if runner.xmoe and not check(moe_name, not moe_detail, plan.index, "; ".join(moe_detail)):
            bk.comm.reset()
        last = cfg.tp - 1  # --fault: the last rank, in the process that hosts it
        if plan.index == 1 and last in runner.local:
            i = runner.local[last]  # a high mantissa bit: beyond the state check's 1e-5
            inject(args.fault, bk.output[i], runner.layers[i].state, state_bit=22)

        outputs, prefixes = runner.all_ranks(bk.output), runner.all_ranks(bk.prefix)
        if procs.root:
            o, p = outputs.view(torch.int16), prefixes.view(torch.int16)
            same = all(torch.equal(o[r], o[0]) and torch.equal(p[r], p[0]) for r in range(cfg.tp))
            check("outputs identical on all ranks", same, plan.index)
        if eager is not None:  # the first step of this graph: its replay is the eager run's
            same = procs.all_true(_same(runner.results(bk), eager))
            check("graph replay == eager (bitwise)", same, plan.index)
        if staged is not None:
            check("stage pass == eager (bitwise)", procs.all_true(_same(staged, eager)), plan.index)
        if checked:
            check_step(
                runner, unsharded, bk, plan, step, prefix, blocks, before_state, check, worst
            )
        progress(plan.index + 1)

    if cfg.replay and args.check_every and procs.all_true(not check.failures):
        check_materialized(runner, unsharded, schedule, check, worst, plan.index)
    steady = None  # the last step's bucket back to back, when both its parities were run
    parity = (plan.index + 1) & 1  # the next step's
    if procs.all_true(not check.failures) and len(bk.graphs) == 2:
        try:
            steady = (bk.kind, runner.back_to_back(bk, parity))
            parity = (parity + BACK_TO_BACK + 1) & 1  # back_to_back ran one more step
        except RuntimeError as e:
            check("back-to-back steps", False, plan.index, str(e))
    timeline = None  # --trace: report["timeline"] (process 0)
    if getattr(args, "trace", 0) and procs.all_true(not check.failures):
        try:
            timeline = trace.run(runner, bk, parity, args.trace)
        except (RuntimeError, ValueError) as e:
            check("traced steps", False, plan.index, str(e))
    ok = procs.all_true(not check.failures)
    per_process = procs.objects(latency)
    steady = procs.objects(steady)
    stages = procs.objects({b.kind: b.stage_us for b in runner.buckets.values() if b.stage_us})
    runner.sync_all()  # nothing in flight on any GPU before the backend is torn down
    if not procs.root:
        return 0 if ok else 1
    report = rep.gpu_report(
        args, cfg, runner, launcher, kinds, per_process, stages, check, worst, ok, steady
    )
    printer = rep.print_gpu
    if timeline is not None:
        report["timeline"] = timeline

        def printer(r):
            rep.print_gpu(r)
            trace.print_timeline(r["timeline"])

    return rep.finish(report, check.failures, args.json, printer)


def check_materialized(runner, unsharded, schedule, check, worst, step) -> None:
    """Replay, after the checked steps: every rank materialises its requests' rings
    (committing the schedule's accepted counts); process 0 checks each request's page
    within 1e-5 of the page's max against the per-step reference's state. Collective."""
    model = runner.model
    slots = model.slot_table()[:, 0].contiguous()
    runner.materialize(slots, schedule.accepted)
    state, _ = runner.gather_pools()
    if unsharded is None:
        return
    worst["ring_folds"] = unsharded.folds
    if not model.cfg.cross_path:  # bf16 pages: the per-step path rounds at every store
        return
    per_step = unsharded.per_step
    ok, ratio = materialized_check(
        state, slots.long(), per_step.kda.state, per_step.request_pages(schedule.accepted)
    )
    check(
        "materialized state vs per-step reference (1e-5 of page max)",
        ok,
        step,
        f"worst {ratio:.2e}",
    )
    worst["materialized"] = ratio


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
