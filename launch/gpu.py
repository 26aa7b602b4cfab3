"""The decode job on the GPU: one runner for a backend hosting every rank or one rank.

- ``loopback``: one process, ``--tp N`` ranks as streams of one GPU
  (``make_backend("loopback", world=N)``);
- ``nvshmem``: one process per GPU (torchrun ``--nproc-per-node N`` / ``mpirun -np N``),
  one rank each (``make_backend("nvshmem")``), peers through nvshmem4py peer pointers.

``Runner`` drives the ranks its backend hosts (``backend.ranks``); its buffers hold one row
per hosted rank. Per step and rank, on the rank's own stream, in stream order:

    kda.decode   the rank's head shard (record mode on a recorded verify step)
    kda.recover  after a recorded step: commit the accepted tokens
    produce      ``OprojProducer``: bf16(attn_out @ w_o^T) into every rank's mailbox
    consume      ``OprojConsumer``: rank-order sum, residual, AttnRes, output RMSNorm

KDA and recover launch with PDL (``--pdl``). On loopback (every rank on one GPU, one
process) ``Runner(oproj_launch=...)`` (``--oproj-launch``) picks the o-projection
launches: ``both`` (the default there: the ranks' KDA and recover on their streams,
joined, then one ``produce_all`` launch, grid y = rank, and one ``consume_all`` launch,
grid z = rank, PDL-chained with ``--pdl``), ``consumer`` (each rank's KDA, recover and
producer on its stream, joined, then one ``consume_all``) or ``per-rank``; bitwise the same
results (tests/test_oproj_one_launch_gpu). With ``per-rank`` every rank's KDA, recover
and producer are enqueued before any
consumer, so even an executor that serialised the ranks' streams publishes before anything
polls. The
producer takes at most 8 rows, so requests x tokens must be <= 8 (``check_rows``).

Buckets and graphs: a bucket is (tokens, record) of the step (requests are fixed per job);
its buffers (inputs, attn_out, records, prefix and output per rank) are allocated once and
one CUDA graph per bucket and mailbox parity (``step & 1``: the double buffer) is captured
once and replayed for every step of the bucket; a step's inputs are copied into the
captured buffers first. The first use of a bucket also runs it eagerly (compiles; the
reference for "graph replay == eager") and once stage by stage (each stage of all hosted
ranks as its own graph, events between them, enqueued behind a sleep so the GPU never
waits for the host: the per-kernel breakdown); the state, conv pools and prefixes are
restored after each, so the graph replay is the step.

Several processes (nvshmem): the eager run publishes, synchronises and meets the other
processes (``backend.barrier``) before its consumer starts, with the consumer compiled
beforehand, so no rank's poll budget covers another's compile; eager run, stage pass and
capture are separated by barriers (they reuse one mailbox parity). Timed replays start
behind an on-stream nvshmem barrier, so a step's time is the graph alone, not the skew of
the processes' hosts. Checks and latencies cross processes through torch.distributed
(gloo, CPU copies; ``Procs``): per-rank checks are ANDed over the processes, rank 0
gathers the pools, attn_out, mailboxes for the unsharded comparison, and a step's latency
is its slowest rank's replay.

Checks (rank 0 reports): every step, every rank's output and prefix bitwise rank 0's and
no consumer timed out; every ``--check-every``-th step, against the unsharded layer
(``launch.layer.Unsharded``, on CPU copies, its pools first set to the GPU's): KDA outputs
within 1 bf16 ulp allowing o's own bf16 flip, state pages within 1e-5 of the page's max
|ref| and pages the reference leaves alone bitwise unchanged, conv pages bitwise; the
producer's partials (re-produced from the step's attn_out into the mailboxes, read back
and re-armed) within 1 ulp of ``tpcomm.oproj.reference.project``, prefix bitwise and
output within 1 ulp of ``reference.consume`` of those partials. The gate inputs (``f_a``,
``f_b``) sit on grids where every fp32 order of the gate dot is exact, so every
``--gate-mode`` rounds the raw gate like the reference.
"""

from __future__ import annotations

import os
import statistics

import torch

from kda import synthetic as kt
from kda.validate import GATE_RANK, HEAD_DIM, check_slot_values
from launch import report as rep
from launch.layer import (
    EPS,
    OUT_EPS,
    Config,
    Model,
    Schedule,
    Unsharded,
    conv_cat,
    oproj_bound_ratios,
)

MAX_PRODUCER_ROWS = 8
COPY_TBPS = 4.16  # H200 device-to-device copy, bytes read + written (../shared/H200.md)
PAGE_BYTES = HEAD_DIM * HEAD_DIM * 4
GATE_CYCLES = 40_000_000  # ~20 ms sleep: the stage pass is enqueued behind it
STAGES = ("kda", "recover", "produce", "consume")
# o-projection launches with every rank on one GPU (loopback): "per-rank" (producer and
# consumer per rank on its stream), "consumer" (producers per rank, PDL behind their KDA;
# one consumer launch for all ranks), "both" (one producer and one consumer launch)
OPROJ_LAUNCHES = ("per-rank", "consumer", "both")
# bench_decode --quick (H200, B 8): both 136.7 / 116.4 us at TP16 / TP8, consumer 138.6 /
# 118.6, per-rank 138.0 / 118.0
DEFAULT_OPROJ_LAUNCH = "both"


class NotYet(ValueError):
    """A GPU path the runner does not have yet."""


def check_rows(requests: int, tokens: int) -> None:
    """The producer's limit: rows per consumer (requests x tokens) <= 8."""
    rows = requests * tokens
    if rows > MAX_PRODUCER_ROWS:
        raise ValueError(
            f"--requests x --tokens = {requests} x {tokens} = {rows} rows per step; the "
            f"o-projection producer takes at most {MAX_PRODUCER_ROWS}: lower --requests or "
            "--tokens"
        )


def exact_gate_weights(layer: kt.Layer) -> None:
    """``f_b`` on a 1/64 grid (with ``exact_gate_inputs``: every partial sum of the gate
    dot is a multiple of 2^-9 below 2^8, exact in fp32, whatever the order)."""
    layer.f_b = ((layer.f_b.float() * 64).round() / 64).to(torch.bfloat16)


def exact_gate_inputs(step: kt.Step) -> None:
    """``f_a`` on a 1/8 grid in [-4, 4]."""
    step.f_a = ((step.f_a.float() * 8).round().clamp(-32, 32) / 8).to(torch.bfloat16)


# --- numerical checks (SPEC tolerances) ----------------------------------------------------


def bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp of each element of ``ref`` (fp32)."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126))) - 7)


def ulp_check(got, ref, row=None, o_flip=False):
    """SPEC's 1-ulp rule over rows of ``row`` elements (default: the last dim): elements
    with |ref| >= 2^-10 rms(row) within 1 ulp, the others within 2^-17 rms(row). With
    ``o_flip`` (KDA outputs, rows = a head's 128 channels) every element may also move by
    one ulp of ``o`` (2^-7 of itself; o is an fp32 reduction rounded to bf16 whose order
    the SPEC leaves open), and 99.9% must be strictly within 1 ulp.
    Returns (ok, exact fraction, worst ulps, detail)."""
    row = ref.shape[-1] if row is None else row
    g, r = got.float().reshape(-1, row), ref.float().reshape(-1, row)
    if torch.isnan(g).any():
        return False, 0.0, float("inf"), "NaN in the result"
    rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    err, ulp = (g - r).abs(), bf16_ulp(r)
    big = r.abs() >= rms * 2.0**-10
    strict = torch.where(big, err <= ulp, err <= rms * 2.0**-17)
    worst = float((err / ulp)[big].max()) if big.any() else 0.0
    exact = float((err == 0).float().mean())
    if o_flip:
        loose = torch.where(big, err <= ulp + r.abs() * 2.0**-7 * 1.01, err <= rms * 2.0**-16)
        within = float(strict.float().mean())
        ok = bool(loose.all()) and within >= 0.999
        detail = f"{within:.5f} within 1 ulp, max {worst:.2f} ulp"
    else:
        ok = bool(strict.all())
        detail = f"{int((~strict).sum())} elements beyond 1 ulp, max {worst:.2f} ulp"
    return ok, exact, worst, detail


def state_check(got, ref, before):
    """Pages the reference changed: within 1e-5 of the page's max |ref|; (page, head)
    blocks it left alone: bitwise ``before``. Returns (within, untouched, worst err/max)."""
    changed = (ref != before).flatten(2).any(-1)  # [S, H]
    page_changed = changed.any(-1)
    scale = ref.abs().flatten(1).amax(-1)
    err = (got - ref).abs().flatten(1).amax(-1)
    ratio = torch.where(page_changed, err / scale.clamp_min(1e-30), torch.zeros_like(err))
    untouched = (got == before).flatten(2).all(-1) | changed
    return bool((ratio <= 1e-5).all()), bool(untouched.all()), float(ratio.max())


def shard_inputs(step: kt.Step, tp: int):
    """A full-layer step's per-head inputs split by rank, each stacked ``[TP, ...]``: ``x``
    [TP, N, 3 D] (rank r's q | k | v columns, as ``kt.shard_step``), ``gate`` [TP, N, D],
    ``beta`` [TP, N, H]."""
    N, heads = step.beta.shape
    per = heads // tp
    D = per * HEAD_DIM
    x = step.x.view(N, 3, tp, D).permute(2, 0, 1, 3).reshape(tp, N, 3 * D)
    return x, step.gate.view(N, tp, D).transpose(0, 1), step.beta.view(N, tp, per).transpose(0, 1)


# --- the processes of the job (host-side exchange for checks and latencies) ---------------


class Procs:
    """The job's processes as the checks see them: one (loopback) or one per rank
    (nvshmem, through the default torch.distributed group, gloo on CPU copies)."""

    def __init__(self, count: int = 1, rank: int = 0):
        self.count, self.rank = count, rank

    @classmethod
    def from_distributed(cls) -> Procs:
        import torch.distributed as dist

        return cls(dist.get_world_size(), dist.get_rank())

    @property
    def root(self) -> bool:
        return self.rank == 0

    def objects(self, obj) -> list:
        """Every process's ``obj`` (picklable), in process order."""
        if self.count == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.count
        dist.all_gather_object(out, obj)
        return out

    def all_true(self, flag) -> bool:
        if self.count == 1:
            return bool(flag)
        from tpcomm import host

        return host.all_true(bool(flag))

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every process's CPU copy of ``t`` concatenated along dim 0, on process 0 (None on
        the others). Every process must call it with the same shape and dtype."""
        t = t.detach().to("cpu").contiguous()
        if self.count == 1:
            return t
        import torch.distributed as dist

        raw = t.view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float16) else t
        parts = [torch.empty_like(raw) for _ in range(self.count)] if self.root else None
        dist.gather(raw, parts, dst=0)
        if not self.root:
            return None
        return torch.cat([p.view(t.dtype) for p in parts], dim=0)

    def barrier(self) -> None:
        if self.count > 1:
            from tpcomm import host

            host.barrier()


# --- the runner ---------------------------------------------------------------------------


class Bucket:
    """The captured buffers of one (tokens, record) step shape; graphs per parity. Per-rank
    buffers have one row per rank hosted here (``runner.ranks``)."""

    def __init__(self, runner: Runner, tokens: int, record: bool):
        cfg, dev = runner.cfg, runner.device
        B, T, n = cfg.requests, tokens, len(runner.ranks)
        H = cfg.heads_per_rank
        D, N = H * HEAD_DIM, B * T
        self.tokens, self.record, self.rows = T, record, N
        self.comm = runner.comm_for(N)
        bf = dict(dtype=torch.bfloat16, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.x = torch.zeros(n, N, 3 * D, **bf)
        self.f_a = torch.zeros(N, GATE_RANK, **bf)
        self.beta = torch.zeros(n, N, H, **bf)
        self.gate = torch.zeros(n, N, D, **bf)
        self.slots = torch.zeros((B,) if T == 1 else (B, T), **i32)
        self.accepted = torch.ones(B, **i32) if T > 1 else None
        self.committed = torch.ones(B, **i32) if record else None
        self.attn = torch.zeros(n, N, D, **bf)
        self.v_records = self.kg_records = None
        if record:
            self.v_records = torch.zeros(n, B, H, T, HEAD_DIM, dtype=torch.float32, device=dev)
            self.kg_records = torch.zeros(n, B, H, T, 2 * HEAD_DIM, **bf)
        self.prefix = torch.zeros(n, N, cfg.hidden, **bf)
        self.output = torch.zeros(n, N, cfg.hidden, **bf)
        self.blocks = torch.zeros(N, cfg.blocks, cfg.hidden, **bf) if cfg.blocks else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stage_us: dict[str, float] | None = None
        self.kda_choice = None

    @property
    def kind(self) -> str:
        if self.tokens == 1:
            return "decode"
        return "verify+record+recover" if self.record else "verify"


class Runner:
    """The TP ranks hosted by ``backend`` (all of them on loopback, one on nvshmem); steps
    as CUDA-graph replays. ``procs``: the job's processes (default: this one alone)."""

    def __init__(self, cfg: Config, model: Model, backend, *, kernel="auto", gate_mode=0,
                 pdl=True, budget_ns=None, procs: Procs | None = None,
                 oproj_launch: str | None = None):  # fmt: skip
        check_rows(cfg.requests, cfg.tokens)
        if backend.world != cfg.tp:
            raise ValueError(f"the backend has {backend.world} ranks; the layer is TP {cfg.tp}")
        self.cfg, self.model, self.backend = cfg, model, backend
        self.procs = Procs() if procs is None else procs
        self.ranks = tuple(backend.ranks)
        self.local = {r: i for i, r in enumerate(self.ranks)}
        # several processes: peers are reached only through symmetric memory
        self.multiprocess = len(self.ranks) < cfg.tp
        self.device = backend.device
        shared = getattr(backend, "streams", None)
        if shared:  # loopback: the backend's own stream per rank
            self.streams = {r: shared[r] for r in self.ranks}
        else:
            self.streams = {r: torch.cuda.Stream(self.device) for r in self.ranks}
        self.kernel, self.gate_mode, self.pdl = kernel, gate_mode, bool(pdl)
        self.budget = {} if budget_ns is None else {"budget_ns": budget_ns}
        shards = [model.shard(r) for r in self.ranks]
        self.layers = [s.kda.to(self.device) for s in shards]
        self.w_o = [s.w_o.to(self.device) for s in shards]
        # every rank on this GPU: the consumers of all ranks (and with "both" the
        # producers) as one launch each (tpcomm.oproj.api consume_all / produce_all)
        whole = not self.multiprocess and backend.single_device and cfg.tp > 1
        mode = oproj_launch
        if mode is None:
            mode = DEFAULT_OPROJ_LAUNCH if whole else "per-rank"
        if mode not in OPROJ_LAUNCHES:
            raise ValueError(f"oproj_launch must be one of {OPROJ_LAUNCHES}; got {mode!r}")
        if mode != "per-rank" and not whole:
            raise ValueError(f"oproj_launch={mode!r} needs every rank on one GPU in this "
                             "process (loopback)")  # fmt: skip
        self.oproj_launch = mode
        self.w_os = None
        if mode == "both":  # stacked [TP, HID, D_local]; the per-rank list views it
            self.w_os = torch.stack(self.w_o)
            self.w_o = list(self.w_os.unbind(0))
        self.norm = model.norm.to(self.device)
        self.query = model.query.to(self.device)
        self.out_norm = model.out_norm.to(self.device)
        self.comms: dict = {}
        self.buckets: dict = {}
        self._stream_barrier = None

    # --- buffers ---------------------------------------------------------------------------
    def comm_for(self, rows: int):
        """The all-reduce for ``rows`` tokens: the plan's groups (or ``--groups``); with
        per-rank consumers lowered until every rank's consumer can be resident (loopback;
        one rank per GPU always is; one consumer launch for all ranks needs no such rule).
        Collective on nvshmem: every process builds the same ones in the same order."""
        if rows in self.comms:
            return self.comms[rows]
        from tpcomm.oproj.api import OprojAllReduce, choose

        cfg = self.cfg
        if cfg.groups is not None:
            options = [cfg.groups]
        elif self.oproj_launch != "per-rank":  # one consumer launch: no co-residency rule
            options = [choose(cfg.tp, rows, cfg.hidden).groups]
        else:
            options = range(choose(cfg.tp, rows, cfg.hidden).groups, 0, -1)
        one = {"one_launch": True} if self.oproj_launch != "per-rank" else {}
        error = None
        for groups in options:
            try:
                comm = OprojAllReduce(self.backend, rows, cfg.hidden, cfg.blocks, groups=groups,
                                      eps=EPS, out_eps=OUT_EPS, **self.budget, **one)  # fmt: skip
            except ValueError as e:
                if "resident" not in str(e):
                    raise
                error = e
                continue
            self.comms[rows] = comm
            return comm
        raise ValueError(f"{error} (tried groups {list(options)})")

    def bucket(self, tokens: int, record: bool) -> Bucket:
        key = (tokens, record)
        if key not in self.buckets:
            self.buckets[key] = Bucket(self, tokens, record)
        return self.buckets[key]

    def fill(self, bk: Bucket, plan, step: kt.Step, prefix, blocks) -> None:
        """Copy a step's full-layer inputs (CPU) into the bucket's buffers: the hosted
        ranks' shards."""
        x, gate, beta = shard_inputs(step, self.cfg.tp)
        mine = list(self.ranks)
        bk.x.copy_(x[mine])
        bk.gate.copy_(gate[mine])
        bk.beta.copy_(beta[mine])
        bk.f_a.copy_(step.f_a)
        bk.slots.copy_(step.slots)
        if bk.accepted is not None:
            bk.accepted.copy_(step.accepted)
        if bk.committed is not None:
            bk.committed.copy_(plan.committed)
        bk.prefix.copy_(prefix.to(self.device)[None].expand_as(bk.prefix))
        if bk.blocks is not None:
            bk.blocks.copy_(blocks)

    # --- launches --------------------------------------------------------------------------
    def kda_choice(self, bk: Bucket):
        """The bucket's KDA kernel (``kda.dispatch.choose``), chosen once. Every rank this
        process hosts shares the GPU (loopback: all TP ranks), so the dispatcher sees a
        rank's share of the SMs: KdaSplit spreading one rank's few items over the whole
        GPU would only crowd out the other ranks."""
        if bk.kda_choice is None:
            from kda import dispatch

            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            bk.kda_choice = dispatch.choose(
                self.cfg.requests, self.cfg.heads_per_rank, bk.tokens,
                sms=max(1, sms // len(self.local)), kernel=self.kernel,
            )  # fmt: skip
        return bk.kda_choice

    def _kda(self, bk: Bucket, r: int) -> None:
        import kda

        choice = self.kda_choice(bk)
        i = self.local[r]
        L = self.layers[i]
        kda.decode(
            bk.x[i], L.conv_weight, L.conv_bias, L.conv_state, bk.f_a, bk.beta[i], L.a_log,
            L.dt_bias, bk.slots, L.state, bk.gate[i], L.norm_weight, L.f_b,
            lower_bound=kt.LOWER_BOUND, scale=kt.SCALE, eps=kt.EPS, accepted=bk.accepted,
            conv_dim_first=L.conv_dim_first,
            records=(bk.v_records[i], bk.kg_records[i]) if bk.record else None,
            kernel=choice.kernel, gate_mode=self.gate_mode, pdl=self.pdl, out=bk.attn[i],
            cluster=choice.cluster if choice.kernel == "split" else None,
        )  # fmt: skip

    def _recover(self, bk: Bucket, r: int) -> None:
        import kda

        i = self.local[r]
        L = self.layers[i]
        kda.recover(
            L.state, bk.slots, bk.v_records[i], bk.kg_records[i], L.a_log, L.dt_bias,
            bk.committed, bk.accepted, lower_bound=kt.LOWER_BOUND, pdl=self.pdl,
        )  # fmt: skip

    def _produce(self, bk: Bucket, r: int, parity: int) -> None:
        i = self.local[r]
        bk.comm.produce(bk.attn[i], self.w_o[i], parity, rank=r, stream=self.streams[r])

    def _consume(self, bk: Bucket, r: int, parity: int) -> None:
        i = self.local[r]
        bk.comm.consume(bk.prefix[i], bk.blocks, self.norm, self.query, self.out_norm,
                        bk.output[i], parity, rank=r, stream=self.streams[r])  # fmt: skip

    def _produce_all(self, bk: Bucket, parity: int) -> None:
        bk.comm.produce_all(bk.attn, self.w_os, parity, pdl=self.pdl)

    def _consume_all(self, bk: Bucket, parity: int) -> None:
        bk.comm.consume_all(bk.prefix, bk.blocks, self.norm, self.query, self.out_norm,
                            bk.output, parity, pdl=self.pdl)  # fmt: skip

    def _on_ranks(self, ranks, *phases, join=False) -> None:
        """Fork the rank streams from the current stream, run each phase ``fn(r)`` for
        every rank (phase by phase, so all producers are enqueued before any consumer),
        join them back. With ``join`` every rank's next phase also waits for every rank's
        previous one: on one GPU a consumer that spins while another rank's KDA or
        producer CTAs still wait for registers could starve them (its bounded poll would
        then report an error), so loopback steps start consumers once all partials are
        on their way. (One rank per process: the join is the rank's own stream order.)"""
        current = torch.cuda.current_stream(self.device)
        fork = torch.cuda.Event()
        fork.record(current)
        for r in ranks:
            self.streams[r].wait_event(fork)
        for i, phase in enumerate(phases):
            if join and i > 0 and len(ranks) > 1:
                done = []
                for r in ranks:
                    event = torch.cuda.Event()
                    event.record(self.streams[r])
                    done.append(event)
                for r in ranks:
                    for event in done:
                        self.streams[r].wait_event(event)
            for r in ranks:
                with torch.cuda.stream(self.streams[r]):
                    phase(r)
        for r in ranks:
            current.wait_stream(self.streams[r])

    def enqueue(self, bk: Bucket, parity: int, ranks=None, *, eager=False) -> None:
        """One step of ``ranks`` (default: all hosted) on their streams, in stream order.
        ``eager`` with several processes: KDA -> producer, synchronise, meet the other
        processes, then the consumer (compiled beforehand), so no poll budget covers a
        peer's compile or host skew."""
        ranks = self.ranks if ranks is None else tuple(ranks)
        all_at_once = self.oproj_launch != "per-rank" and ranks == self.ranks
        produce_all = all_at_once and self.oproj_launch == "both"

        def chain(r):
            self._kda(bk, r)
            if bk.record:
                self._recover(bk, r)
            if not produce_all:
                self._produce(bk, r, parity)

        def consume(r):
            self._consume(bk, r, parity)

        if eager and self.multiprocess:
            bk.comm.functions()  # the consumer compiled before anyone polls
            self._on_ranks(ranks, chain)
            self.sync_all()
            self._on_ranks(ranks, consume)
            return
        if all_at_once:  # per rank stream, joined; then (one producer and) one consumer
            self._on_ranks(ranks, chain)
            if produce_all:
                self._produce_all(bk, parity)
            self._consume_all(bk, parity)
            return
        self._on_ranks(ranks, chain, consume, join=True)

    def _stage(self, bk: Bucket, name: str, parity: int):
        fns = {
            "kda": lambda r: self._kda(bk, r),
            "recover": lambda r: self._recover(bk, r),
            "produce": lambda r: self._produce(bk, r, parity),
            "consume": lambda r: self._consume(bk, r, parity),
        }
        if self.oproj_launch == "both" and name == "produce":
            return lambda: self._produce_all(bk, parity)
        if self.oproj_launch != "per-rank" and name == "consume":
            return lambda: self._consume_all(bk, parity)
        return lambda: self._on_ranks(self.ranks, fns[name])

    # --- synchronisation across processes ------------------------------------------------
    def sync_all(self) -> None:
        """This GPU idle, then every process here (nvshmem barrier); loopback: synchronise."""
        torch.cuda.synchronize(self.device)
        if self.multiprocess:
            self.backend.barrier()

    def stream_barrier(self) -> None:
        """Several processes: every GPU's current stream meets the others' (an nvshmem
        on-stream barrier) before what follows; the host does not wait. If the backend has
        no on-stream barrier, a host barrier (synchronising) instead, said once."""
        if not self.multiprocess:
            return
        if self._stream_barrier is None:
            self._stream_barrier = _stream_barrier_fn(self.backend)
        self._stream_barrier(torch.cuda.current_stream(self.device))

    # --- first use of a bucket: eager, stage pass, capture -----------------------------
    def pools(self):
        return [(L.state, L.conv_state) for L in self.layers]

    def snapshot(self, bk: Bucket):
        return [(s.clone(), c.clone()) for s, c in self.pools()], bk.prefix.clone()

    def restore(self, bk: Bucket, saved) -> None:
        pools, prefix = saved
        for (s, c), (s0, c0) in zip(self.pools(), pools, strict=True):
            s.copy_(s0)
            c.copy_(c0)
        bk.prefix.copy_(prefix)

    def results(self, bk: Bucket):
        """What a step leaves behind (clones): outputs, prefixes, attn, pools."""
        out = [bk.output.clone(), bk.prefix.clone(), bk.attn.clone()]
        return out + [t.clone() for pair in self.pools() for t in pair]

    def graph(self, bk: Bucket, parity: int):
        """The bucket's graph for ``parity``; on first use also the eager run and, once per
        bucket, the stage pass. Returns (graph, eager results or None, stage results or None);
        the pools and prefixes are as before the call. Collective with several processes."""
        if parity in bk.graphs:
            return bk.graphs[parity], None, None
        self.kda_choice(bk)
        saved = self.snapshot(bk)
        self.enqueue(bk, parity, eager=True)  # eager: compiles and loads every kernel
        torch.cuda.synchronize(self.device)
        self.raise_on_timeout(bk, "eager run")
        eager = self.results(bk)
        self.restore(bk, saved)
        self.sync_all()  # every consumer re-armed before this parity is published again
        staged = None
        if bk.stage_us is None:
            bk.stage_us = self.stage_pass(bk, parity)
            staged = self.results(bk)
            self.restore(bk, saved)
            self.sync_all()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            self.enqueue(bk, parity)
        torch.cuda.synchronize(self.device)
        bk.graphs[parity] = g
        return g, eager, staged

    def stage_pass(self, bk: Bucket, parity: int) -> dict[str, float]:
        """Each stage of the hosted ranks as its own graph, events between them (us per
        stage). Several processes: the stages start behind an on-stream barrier, so
        ``consume`` includes the wait for the slowest peer's producer."""
        stages = [s for s in STAGES if s != "recover" or bk.record]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        graphs = []
        for name in stages:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                self._stage(bk, name, parity)()
            graphs.append(g)
        self.sync_all()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(GATE_CYCLES)  # the host enqueues everything while this runs
        self.stream_barrier()
        events[0].record()
        for g, e in zip(graphs, events[1:], strict=True):
            g.replay()
            e.record()
        torch.cuda.synchronize(self.device)
        self.raise_on_timeout(bk, "stage pass")
        return {n: events[i].elapsed_time(events[i + 1]) * 1e3 for i, n in enumerate(stages)}

    def timeout_masks(self, bk: Bucket) -> list[int]:
        """Every rank's consumer error word (missing-rank mask; 0: none), in rank order."""
        mine = bk.comm.errors[list(self.ranks), 0].tolist()
        return [m for masks in self.procs.objects(mine) for m in masks]

    def raise_on_timeout(self, bk: Bucket, what: str) -> None:
        """Collective: every process raises when any rank's consumer timed out."""
        masks = self.timeout_masks(bk)
        if any(masks):
            bk.comm.reset()
            raise RuntimeError(f"{what}: consumer poll timed out (missing-rank masks {masks})")

    def replay(self, bk: Bucket, parity: int) -> float:
        """One step: the bucket's graph replayed; its GPU time in us (behind an on-stream
        barrier of all processes when there are several)."""
        g = bk.graphs[parity]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream_barrier()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    # --- reading back (collective; the whole layer on process 0, None elsewhere) ---------
    def all_ranks(self, t: torch.Tensor) -> torch.Tensor | None:
        """A per-hosted-rank buffer ``[n, ...]`` of every rank, ``[TP, ...]`` on the CPU."""
        return self.procs.gather(t)

    def gather_pools(self):
        """The whole layer's state and conv pools on the CPU, from the ranks' shards
        (process 0; None, None elsewhere)."""
        state = torch.cat([L.state.cpu() for L in self.layers], dim=1)
        state = self.procs.gather(state.movedim(1, 0))  # heads first: ranks concatenate
        convs = [L.conv_state.cpu()[None] for L in self.layers]
        conv = self.procs.gather(torch.cat(convs, dim=0))
        if state is None:
            return None, None
        return state.movedim(0, 1).contiguous(), conv_cat(list(conv), self.cfg.conv_dim_first)

    def w_o_cpu(self, r: int) -> torch.Tensor:
        """Rank ``r``'s ``w_o`` columns (CPU, from the model: any rank, hosted or not)."""
        first, count = self.model.rank_heads(r)
        return self.model.w_o[:, first * HEAD_DIM : (first + count) * HEAD_DIM].contiguous()

    def partials(self, bk: Bucket, parity: int):
        """The producers' partials of the step just run [TP, N, HID] (CPU, process 0):
        produced again from the step's attn_out (deterministic), read back from rank 0's
        mailbox, then everything re-armed. Also whether every rank's mailbox held the same
        (process 0; None elsewhere)."""
        self.sync_all()  # every consumer of the step re-armed before the re-publish
        for r in self.ranks:
            i = self.local[r]
            bk.comm.produce(bk.attn[i], self.w_o[i], parity, rank=r)
        self.sync_all()  # every peer's partial landed
        boxes = torch.stack([bk.comm.mailbox.local(r)[parity] for r in self.ranks])
        every = self.procs.gather(boxes)  # [TP, TP, N, HID]
        bk.comm.reset()  # re-arm (and barrier)
        if every is None:
            return None, None
        bits = every.view(torch.int16)
        same = all(torch.equal(bits[r], bits[0]) for r in range(self.cfg.tp))
        return every[0].clone(), same


LoopbackRunner = Runner  # the name scripts/bench_decode.py uses


def _stream_barrier_fn(backend):
    """An on-stream barrier of every process of ``backend`` (nvshmem ``barrier_all`` on the
    stream), or a host barrier when it has none."""
    if backend.name == "nvshmem":
        try:
            import nvshmem.core as nv

            from tpcomm.backends.nvshmem import _TorchStream

            def barrier(stream):
                nv.barrier_all(_TorchStream(stream))

            return barrier
        except ImportError:
            pass
    print("note: no on-stream barrier on this backend; replays start behind a host barrier",
          flush=True)  # fmt: skip
    return lambda stream: backend.barrier()


# --- the job --------------------------------------------------------------------------------

_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def step_bytes(cfg: Config, kind: str, tokens: int) -> dict:
    """Bytes a step moves with every request live (state pages read + written, w_o read)
    and the HBM floor they give at the H200's copy bandwidth."""
    pages = {"decode": 2, "verify": 1 + tokens, "verify+record+recover": 2 + tokens}[kind]
    state = cfg.requests * cfg.heads * pages * PAGE_BYTES
    w_o = cfg.hidden * cfg.heads * HEAD_DIM * 2
    rows = cfg.requests * tokens
    mailbox = cfg.tp * cfg.tp * rows * cfg.hidden * 2
    return {
        "state": state,
        "w_o": w_o,
        "mailbox_stores": mailbox,
        "floor_us": (state + w_o) / (COPY_TBPS * 1e6),
    }


def env_rank() -> int:
    """This process's rank from the launcher's environment (0 for a plain process)."""
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def main(args, backend_name: str, processes: int, launcher: str) -> int:
    """``launch/decode.py`` on a GPU backend (loopback or nvshmem); the exit status."""
    speak = env_rank() == 0

    def refuse(message):
        if speak:
            print(f"DECODE FAILED: {message}", flush=True)
        return 2

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
        cfg = Config(
            tp=tp, heads=args.heads, hidden=args.hidden, requests=args.requests,
            tokens=args.tokens, blocks=args.blocks, steps=args.steps, seed=args.seed,
            groups=args.groups, conv_dim_first=args.conv_layout == "dim-first",
            padding=args.padding,
        )  # fmt: skip
        cfg.validate()
        check_rows(cfg.requests, cfg.tokens)
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
    from tpcomm.symm import make_backend

    if backend_name == "nvshmem":
        return _run_nvshmem(args, cfg, launcher)
    backend = make_backend("loopback", world=cfg.tp)
    try:
        return run(args, cfg, backend, launcher)
    finally:
        backend.teardown()


def nvshmem_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvshmem") is not None


def _run_nvshmem(args, cfg: Config, launcher: str) -> int:
    """One rank in this process: the gloo group (checks, the uid broadcast) first, then
    the nvshmem PE on the process's GPU; teardown frees, finalizes, destroys the group."""
    from tpcomm import host
    from tpcomm.symm import make_backend

    if not getattr(args, "multicast", False):  # no NVLS (cuMulticastCreate) unless asked
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    info = host.init_distributed()
    try:
        device = info.local_rank % torch.cuda.device_count()
        backend = make_backend("nvshmem", device=device, launcher=launcher)
        try:
            if (backend.rank, backend.world) != (info.rank, info.world):
                raise RuntimeError(
                    f"nvshmem PE {backend.rank} of {backend.world} is torch.distributed rank "
                    f"{info.rank} of {info.world}: the launcher's ranks disagree"
                )
            return run(args, cfg, backend, launcher, Procs(info.world, info.rank))
        finally:
            backend.teardown()
    finally:
        host.finalize()


def run(args, cfg: Config, backend, launcher="single", procs: Procs | None = None) -> int:
    """The steps on ``backend``'s ranks; with several processes every one calls this (the
    checks and latencies meet on process 0, which prints the report)."""
    procs = Procs() if procs is None else procs
    model = Model(cfg)
    exact_gate_weights(model.kda)  # before the shards and the unsharded copy share it
    try:
        runner = Runner(cfg, model, backend, kernel=args.kernel, gate_mode=args.gate_mode,
                        pdl=args.pdl, procs=procs,
                        oproj_launch=getattr(args, "oproj_launch", None))  # fmt: skip
    except ValueError as e:
        if procs.root:
            print(f"DECODE FAILED: {e}", flush=True)
        return 2
    unsharded = Unsharded(model) if args.check_every and procs.root else None
    schedule = Schedule(cfg)
    check, kinds = rep.Checks(), {}
    latency: list[tuple[str, float]] = []  # (kind, us) per step, this process's ranks
    worst = {"kda_ulp": 0.0, "kda_exact": 1.0, "state": 0.0, "output_ulp": 0.0,
             "partial_ulp": 0.0, "prefix": 0.0, "output": 0.0}  # fmt: skip
    for _ in range(cfg.steps):
        plan = schedule.next()
        kinds[plan.kind] = kinds.get(plan.kind, 0) + 1
        step, prefix, blocks = model.step_inputs(plan)
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
            if unsharded is not None:
                unsharded.kda.state.copy_(before_state)
                unsharded.kda.conv_state.copy_(before_conv)
        latency.append((plan.kind, runner.replay(bk, parity)))
        masks = runner.timeout_masks(bk)
        if not check("no consumer timeout", not any(masks), plan.index, f"masks {masks}"):
            bk.comm.reset()
        if plan.index == 1:
            _inject(args.fault, runner, bk)

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
            _check_step(runner, unsharded, bk, plan, step, prefix, blocks,
                        before_state, check, worst)  # fmt: skip

    ok = procs.all_true(not check.failures)
    per_process = procs.objects(latency)
    stages = procs.objects({b.kind: b.stage_us for b in runner.buckets.values() if b.stage_us})
    runner.sync_all()  # nothing in flight on any GPU before the backend is torn down
    if not procs.root:
        return 0 if ok else 1
    report = _report(args, cfg, runner, launcher, kinds, per_process, stages, check, worst, ok)
    return rep.finish(report, check.failures, args.json, _print)


def _check_step(runner, unsharded, bk, plan, step, prefix, blocks, before_state, check, worst):
    """Every process takes part (gathers, the mailbox read-back); process 0 compares."""
    cfg, model = runner.cfg, runner.model
    i = plan.index
    attn_all = runner.all_ranks(bk.attn)  # [TP, N, D_local]
    state, conv = runner.gather_pools()
    armed = runner.procs.all_true(bk.comm.armed())
    partials, same = runner.partials(bk, plan.index & 1)
    if unsharded is None:
        return
    ref = unsharded.step(plan, step, prefix, blocks, groups=bk.comm.groups)
    attn = torch.cat(list(attn_all), dim=1)
    ok, exact, ulps, detail = ulp_check(attn, ref["attn"], row=HEAD_DIM, o_flip=True)
    check("kda outputs vs unsharded (1 ulp + o's flip)", ok, i, detail)
    worst["kda_ulp"] = max(worst["kda_ulp"], ulps)
    worst["kda_exact"] = min(worst["kda_exact"], exact)
    within, untouched, ratio = state_check(state, unsharded.kda.state, before_state)
    check("state pages vs unsharded (1e-5 of page max)", within, i, f"worst {ratio:.2e}")
    check("state pages the step leaves alone unchanged (bitwise)", untouched, i)
    worst["state"] = max(worst["state"], ratio)
    check("conv pages == unsharded (bitwise)", torch.equal(conv, unsharded.kda.conv_state), i)

    check("mailboxes re-armed", armed, i)
    check("partials identical in every rank's mailbox", same, i)
    from tpcomm.oproj import reference as oref

    bad = []
    for r in range(cfg.tp):
        want = oref.project(attn_all[r], runner.w_o_cpu(r))
        ok, _, ulps, detail = ulp_check(partials[r], want)
        bad += [] if ok else [f"rank {r}: {detail}"]
        worst["partial_ulp"] = max(worst["partial_ulp"], ulps)
    check("partials vs reference projection (1 ulp)", not bad, i, "; ".join(bad[:2]))
    want_out, want_prefix = model.consume(partials, prefix, blocks, groups=bk.comm.groups)
    got_prefix, got_out = bk.prefix[0].cpu(), bk.output[0].cpu()  # rank 0: row 0 here
    check("prefix == TP reference math (bitwise)",
          torch.equal(got_prefix.view(torch.int16), want_prefix.view(torch.int16)), i)  # fmt: skip
    ok, _, ulps, detail = ulp_check(got_out, want_out)
    check("output vs TP reference math (1 ulp)", ok, i, detail)
    worst["output_ulp"] = max(worst["output_ulp"], ulps)
    # the epilogue of the TP prefix (bitwise got_prefix, checked above), in fp64
    p, o = oproj_bound_ratios(partials, got_prefix, got_out, ref["u_prefix"], ref["epi_out"])
    check("prefix vs unsharded o-proj (within bound)", p <= 1, i, f"worst {p:.3f}")
    check("output vs fp64 epilogue of the prefix (within bound)", o <= 1, i, f"worst {o:.3f}")
    worst["prefix"], worst["output"] = max(worst["prefix"], p), max(worst["output"], o)


def _inject(fault, runner, bk):
    """``--fault``: the last rank corrupts one output value or one state element (in the
    process that hosts it)."""
    last = runner.cfg.tp - 1
    if fault == "none" or last not in runner.local:
        return
    i = runner.local[last]
    if fault == "output":
        bk.output[i].view(torch.int16)[0, 0] ^= 1
    elif fault == "state":
        runner.layers[i].state.view(torch.int32)[-1, 0, 0, 0] ^= 1 << 22


def _stats(values):
    return {
        "median_us": statistics.median(values),
        "p99_us": rep.percentile(values, 0.99),
        "max_us": max(values),
        "n": len(values),
    }


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def slowest_per_step(per_process):
    """Per step, the slowest process's replay: ``per_process`` is every process's list of
    (kind, us); returns {kind: [us per step]} (a step's latency is its slowest rank's)."""
    latency: dict[str, list[float]] = {}
    for entries in zip(*per_process, strict=True):
        latency.setdefault(entries[0][0], []).append(max(us for _, us in entries))
    return latency


def _report(args, cfg, runner, launcher, kinds, per_process, stages, check, worst, ok):
    buckets = sorted(runner.buckets.values(), key=lambda b: (b.tokens, b.record))
    latency = slowest_per_step(per_process)
    everything = [v for vs in latency.values() for v in vs]
    lat = {k: _stats(v) for k, v in latency.items()}
    if everything:
        lat["step"] = _stats(everything)
    per_rank = None
    if len(per_process) > 1 and everything:  # nvshmem: one process per rank
        per_rank = [_stats([us for _, us in entries]) for entries in per_process]
    breakdown = {}
    for kind in {k for d in stages for k in d}:
        names = next(d[kind] for d in stages if kind in d)
        breakdown[kind] = {n: max(d[kind][n] for d in stages if kind in d) for n in names}
    props = torch.cuda.get_device_properties(runner.device)
    multicast = any(c.multicast_base for c in runner.comms.values())
    extra = {
        "device": props.name,
        "processes": runner.procs.count,
        "kernel": {b.kind: b.kda_choice.kernel for b in buckets if b.kda_choice},
        "kernel_reason": {b.kind: b.kda_choice.reason for b in buckets if b.kda_choice},
        "gate_mode": args.gate_mode,
        "pdl": bool(args.pdl),
        "groups_chosen": {str(n): c.groups for n, c in sorted(runner.comms.items())},
        "publish": "multicast" if multicast else "per peer",
        "oproj_launch": runner.oproj_launch,
        "exact_gate_grids": True,
    }
    report = {
        "config": rep.config(cfg, runner.backend.name, launcher, **extra),
        "steps": {"total": sum(kinds.values()), **kinds},
        "latency": lat,
        "breakdown": {b.kind: breakdown[b.kind] for b in buckets if b.kind in breakdown},
        "bytes": {b.kind: step_bytes(cfg, b.kind, b.tokens) for b in buckets},
        "checks": check.as_dict(),
        "worst": worst,
        "ok": ok,
    }
    if per_rank is not None:
        report["per_rank"] = per_rank
    return report


def _print(r):
    rep.print_config(r)
    c = r["config"]
    kernels = ", ".join(f"{k}: {v}" for k, v in c["kernel"].items())
    groups = ", ".join(f"{v} at {k} rows" for k, v in c["groups_chosen"].items())
    print(
        f"gpu      {c['device']} x {c['processes']} process(es); KDA {kernels}; gate mode "
        f"{c['gate_mode']}, pdl {c['pdl']}; consumer groups {groups}; publish {c['publish']}; "
        f"o-projection launches {c['oproj_launch']}"
    )
    title = "latency (graph replay, all ranks)"
    if c["processes"] > 1:
        title = "latency (graph replay, max over ranks)"
    print(f"{title:<40}{'median us':>11}{'p99 us':>10}{'max us':>10}{'steps':>7}"
          f"{'floor us':>10}")  # fmt: skip
    for name, v in r["latency"].items():
        floor = r["bytes"].get(name, {}).get("floor_us")
        f = f"{floor:>10.2f}" if floor is not None else f"{'':>10}"
        print(f"  {name:<38}{v['median_us']:>11.2f}{v['p99_us']:>10.2f}{v['max_us']:>10.2f}"
              f"{v['n']:>7}{f}")  # fmt: skip
    for rank, v in enumerate(r.get("per_rank", [])):
        print(f"  {'rank ' + str(rank) + ' alone':<38}{v['median_us']:>11.2f}"
              f"{v['p99_us']:>10.2f}{v['max_us']:>10.2f}{v['n']:>7}")  # fmt: skip
    where = "each stage of all ranks" if c["processes"] == 1 else "each stage, max over ranks"
    print(f"breakdown ({where} as its own graph, events, us)")
    for kind, stages in r["breakdown"].items():
        cells = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
        print(f"  {kind:<38}{cells}; sum {sum(stages.values()):.2f}")
    print("bytes per step (every request live; floor = (state + w_o) / 4.16 TB/s)")
    for kind, b in r["bytes"].items():
        print(f"  {kind:<38}state {b['state'] / 1e6:.2f} MB, w_o {b['w_o'] / 1e6:.2f} MB, "
              f"mailbox stores {b['mailbox_stores'] / 1e6:.2f} MB")  # fmt: skip
    rep.print_checks(r)
    w = r["worst"]
    print(
        f"  worst: kda {w['kda_ulp']:.2f} ulp (exact >= {w['kda_exact']:.4f}), state "
        f"{w['state']:.2e} of page max, partials {w['partial_ulp']:.2f} ulp, output "
        f"{w['output_ulp']:.2f} ulp; error / bound: prefix vs unsharded o-proj "
        f"{w['prefix']:.3f}, output vs fp64 epilogue {w['output']:.3f}"
    )
