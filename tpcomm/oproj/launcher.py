"""Compiles and launches the o-projection kernels of an ``OprojAllReduce`` (``comm``).

The route of a step is one way: ``OprojAllReduce``'s entries call the ``kimi::oproj_*``
torch ops (``tpcomm.oproj.custom_ops``), whose implementations are this module's
``publish``, ``produce``, ``consume`` and ``produce_consume`` (arguments in the ops'
schema order, after the handle); the one-GPU all-ranks launches (``tpcomm.oproj.all_ranks``)
call its compiled kernels and ``launch_partial`` directly. Nothing here imports either
caller. Kernels compile once per configuration (``tpcomm.cuteutil.compile_cached``); the
CuTe DSL is imported on the first launch only.
"""

from __future__ import annotations

import torch

from tpcomm.oproj import checks
from tpcomm.oproj.gemm import gemm
from tpcomm.oproj.operands import (
    ConsumerOperands,
    ConsumeTensors,
    ProducerOperands,
    PublishOperands,
)
from tpcomm.oproj.plan import DeviceLimits, plan_fused


def stream(comm):
    """The current stream of ``comm``'s device, as the kernels take it."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(comm.device).cuda_stream)


# --- compiled kernels: ``ranks`` = TP launches every rank at once ----------------------------
def publisher(comm, pdl=False, ranks=1):
    from tpcomm.oproj.kernels.producer import compiled_publisher

    multicast = comm.multicast_base != 0
    twoshot = comm.twoshot
    return compiled_publisher(
        comm.tp, comm.hid, multicast, comm.fence, pdl, twoshot=twoshot, ranks=ranks
    )


def producer(comm, d_local, pdl=False, ranks=1):
    """The producer kernel of ``comm``'s plan: ``OprojProducer`` (mma.sync, <= 8 rows) or,
    with ``producer="wgmma"``, ``OprojGemmProducer`` at the plan's tile."""
    multicast = comm.multicast_base != 0
    config = dict(twoshot=comm.twoshot, ranks=ranks)
    if comm.producer == "wgmma":
        from tpcomm.oproj.kernels.gemm import compiled_gemm_producer

        tile_m, tile_n = comm.gemm_tile
        config.update(tile_m=tile_m, tile_n=tile_n)
        fn = compiled_gemm_producer
    else:
        from tpcomm.oproj.kernels.producer import compiled_producer as fn
    return fn(comm.tp, comm.hid, d_local, multicast, comm.fence, pdl, **config)


def consumer(comm, pdl=False, ranks=1):
    """Per rank (``ranks`` 1): the consumer of ``comm``'s path (twoshot, domain); every
    rank at once: the one-shot one."""
    from tpcomm.oproj.kernels.consumer import compiled

    config = (comm.tp, comm.hid, comm.nb, comm.has_delta, comm.groups, comm.xmoe_reps)
    if ranks > 1:
        return compiled(*config, pdl, fence=comm.fence, ranks=ranks)
    domain = comm.backend.domain.size
    return compiled(*config, twoshot=comm.twoshot, fence=comm.fence, domain=domain)


def functions(comm):
    """(publisher, consumer) of ``comm``'s per-rank launches, kept on ``comm``."""
    if comm.compiled is None:
        comm.compiled = (publisher(comm), consumer(comm))
    return comm.compiled


def fused_plan(comm, tiles=None, limits=None, launches=None):
    """``OprojAllReduce.fused_plan``, kept on ``comm`` per arguments."""
    key = (tiles, limits, launches)
    if key not in comm.fused_plans:
        if limits is None:
            if comm.device.type != "cuda":
                raise ValueError(f"the fused plan needs a CUDA device; got {comm.device}")
            limits = DeviceLimits.of(comm.device)
        shared = comm.backend.world if comm.backend.single_device else 1
        plan = plan_fused(
            comm.tp,
            comm.tokens,
            comm.hid,
            comm.nb,
            comm.groups,
            limits,
            launches=shared if launches is None else launches,
            tiles=tiles,
            xmoe_reps=comm.xmoe_reps,
        )
        if launches is None:  # the backend's own rule too (loopback: world launches)
            comm.backend.check_coresident(plan.ctas, plan.threads, plan.launch_bound)
        comm.fused_plans[key] = plan
    return comm.fused_plans[key]


def fused(comm, d_local, tiles=None, pdl=False, launches=None):
    """The compiled ``OprojFused`` of ``comm`` (plans first: may refuse)."""
    from tpcomm.oproj.kernels.fused import compiled_fused

    plan = fused_plan(comm, tiles, launches=launches)
    config = dict(tiles=plan.tiles, has_delta=comm.has_delta, groups=comm.groups, pdl=bool(pdl))
    paths = dict(multicast=comm.multicast_base != 0, fence=comm.fence, twoshot=comm.twoshot)
    shape = (comm.tp, comm.hid, comm.nb, d_local)
    return compiled_fused(*shape, xmoe_reps=comm.xmoe_reps, **config, **paths)


# --- operands ---------------------------------------------------------------------------
def projection_operands(comm, rank, attn_out, w_o):
    """The fused kernel's producer operands of ``rank``."""
    from cutlass import Int64

    from tpcomm.cuteutil import to_cute

    peers = to_cute(comm.peers[rank], 8)
    return ProducerOperands(to_cute(attn_out), to_cute(w_o), peers, Int64(comm.multicast_base))


def consumer_operands(comm, rank, step, tensors: ConsumeTensors):
    """``ConsumerOperands`` of ``rank``'s consumer (rank 0's for every rank at once)."""
    from cutlass import Float32, Int32, Int64

    from tpcomm.cuteutil import to_cute

    if comm.twoshot:
        box = comm.rows.gather_row(rank).view(2, 1, comm.tokens, comm.hid)
        recv = comm.rows.receive_view(rank).view(-1)
    else:
        box, recv = comm.mailbox.local(rank), comm.no_recv
        if comm.remote is not None:  # the consumer's signal words travel as ``recv``
            recv = comm.remote.words(rank)
    t = tensors
    return ConsumerOperands(
        mailbox=to_cute(box),
        prefix=to_cute(t.prefix),
        blocks=to_cute(comm.no_blocks if t.blocks is None else t.blocks),
        norm=to_cute(t.norm),
        query=to_cute(t.query),
        out_norm=to_cute(t.out_norm),
        output=to_cute(t.output),
        xmoe=to_cute(comm.no_xmoe if t.xmoe is None else t.xmoe),
        hints=to_cute(comm.hints(rank), 4),
        eps=Float32(comm.eps),
        out_eps=Float32(comm.out_eps),
        error=to_cute(comm.error(rank), 4),
        step=Int32(step & 1),
        budget_ns=Int64(comm.budget_ns),
        recv=to_cute(recv),
        gather_peers=to_cute(comm.gather_peers[rank], 8),
        rank=Int32(rank),
    )


def launch_partial(comm, fn, tensors, rank, step):
    """A publisher or producer launch: ``tensors`` of ``rank`` (the partial: the publisher's
    ``PublishOperands``; attn_out and w_o: the producer's ``ProducerOperands``) with its
    peer table, then rank and parity, on the current stream."""
    from cutlass import Int32, Int64

    from tpcomm.cuteutil import to_cute

    peers, multicast = to_cute(comm.peers[rank], 8), Int64(comm.multicast_base)
    kind = PublishOperands if len(tensors) == 1 else ProducerOperands
    operands = kind(*map(to_cute, tensors), peers, multicast)
    fn(operands, Int32(rank), Int32(step & 1), stream(comm))
    if comm.remote is not None:  # the slot to the other domains, after the stores
        comm.remote.put(rank, step)


# --- the torch ops' implementations -----------------------------------------------------
def publish(comm, rank, step, partial):
    """``kimi::oproj_publish``: check, launch on the current stream."""
    checks.publish_args(comm, rank, step, partial)
    launch_partial(comm, publisher(comm), (partial,), rank, step)


def produce(comm, rank, step, attn_out, w_o):
    """``kimi::oproj_produce``: check, launch on the current stream (above ``MAX_TOKENS``
    rows, or with ``producer="cublas"``: cuBLAS, then the publisher)."""
    d_local = checks.produce_args(comm, rank, step, attn_out, w_o)
    checks.require_cuda(comm)
    if comm.producer == "cublas":
        partial = comm.staging()[rank]
        gemm(attn_out, w_o.t(), partial)
        launch_partial(comm, publisher(comm), (partial,), rank, step)
        return
    launch_partial(comm, producer(comm, d_local), (attn_out, w_o), rank, step)


def consume(comm, rank, step, tensors: ConsumeTensors, checked, validate=None):
    """``kimi::oproj_consume`` (``checked``: the caller checked)."""
    rank, step = checks.hosted_rank(comm, rank), checks.check_step(step)
    if not checked:
        checks.consumer_tensors(comm, *tensors, validate)
    functions(comm)[1](consumer_operands(comm, rank, step, tensors), stream(comm))
    if comm.remote is not None:  # this parity's signal words, after every CTA read
        comm.remote.rearm(rank, step)


def produce_consume(comm, rank, step, attn_out, w_o, tensors, tiles, pdl, launches, checked):
    """``kimi::oproj_produce_consume``: check, plan, launch."""
    d_local = checks.produce_args(comm, rank, step, attn_out, w_o)
    if comm.remote is not None:
        raise ValueError("the fused producer + consumer needs every rank in one domain")
    if not checked:
        checks.consumer_tensors(comm, *tensors)
    fn = fused(comm, d_local, tiles, pdl, launches)
    producer_part = projection_operands(comm, rank, attn_out, w_o)
    fn(producer_part, consumer_operands(comm, rank, step, tensors), stream(comm))
