"""The GPU runner: the TP ranks a backend hosts, their buffers and CUDA graphs.

Per step and rank, on the rank's own stream, in stream order, through the rank's
``engine.DecodeLayer`` (the code an engine runs): ``kda.decode`` (record mode on a recorded
verify step), ``kda.recover`` (after a recorded step), ``produce`` (bf16(attn_out @ w_o^T)
into every rank's mailbox), ``consume`` (rank-order sum, residual, AttnRes, output
RMSNorm). With every rank on one GPU (loopback) ``oproj_launch`` picks the
o-projection launches: ``both`` (one ``produce_all`` and one ``consume_all`` launch) or
``per-rank`` (the multi-process structure and its plan: twoshot past the measured
crossovers, ``launch.bucket.oproj_plan``); the same results (one-shot's bitwise).

``cfg.kda_state == "replay"``: each rank's ``DecodeLayer`` owns a ring of ``cfg.ring`` entries
per state page and its KDA stage is ``kda.replay_decode`` (the replay dispatcher's kernel);
verify steps are never recorded, so there is no recover stage. The ring is part of the
pools (snapshot, restore, the eager comparison); ``materialize`` folds it on demand.

``xmoe`` > 0: the consumer also writes latent copies of each output row and ready hints;
the MoE dispatch's stand-in waits for them on a stream of its own (``launch.moe``).

A bucket is a step shape (tokens, record): buffers allocated once, one CUDA graph per
mailbox parity (``step & 1``) captured once and replayed. Its first use also runs it
eagerly (compiles; the reference for "graph replay == eager") and stage by stage (the
per-kernel breakdown), restoring the pools and prefixes after each. Several processes
(nvshmem): eager run, stage pass and capture are separated by barriers, the consumer is
compiled before anyone polls, and timed replays start behind an on-stream barrier.
"""

from __future__ import annotations

import torch

from engine import AllRanksStep, DecodeLayer
from kda import layer as kl
from kda.operands import Ring
from kda.validate import HEAD_DIM
from launch.bucket import Bucket, oproj_plan, shard_inputs, twoshot_partials
from launch.layer import EPS, OUT_EPS, Config, Model, conv_cat
from launch.moe import MoeWaiters, check_xmoe
from launch.procs import Procs
from tpcomm.mailbox import MAX_ROWS

GATE_CYCLES = 40_000_000  # ~20 ms sleep: the stage pass is enqueued behind it
BACK_TO_BACK = 50  # steps replayed back to back after the checked ones
STAGES = ("kda", "recover", "produce", "consume")
# o-projection launches with every rank on one GPU (loopback): "per-rank" (producer and
# consumer per rank on its stream), "both" (one producer and one consumer launch)
OPROJ_LAUNCHES = ("per-rank", "both")
DEFAULT_OPROJ_LAUNCH = "both"  # the faster (docs/decode.md)


def check_rows(requests: int, tokens: int) -> None:
    """Rows per step (requests x tokens) <= ``MAX_ROWS``: the o-projection's buffers (and
    one CUDA graph) per rows bucket; above 8 rows its producer is a cuBLAS GEMM."""
    rows = requests * tokens
    if rows > MAX_ROWS:
        raise ValueError(
            f"--requests x --tokens = {requests} x {tokens} = {rows} rows per step; the "
            f"o-projection takes at most {MAX_ROWS}: lower --requests or --tokens"
        )


class Runner:
    """The TP ranks hosted by ``backend`` (all of them on loopback, one on nvshmem); steps
    as CUDA-graph replays. ``procs``: the job's processes (default: this one alone)."""

    def __init__(
        self,
        cfg: Config,
        model: Model,
        backend,
        *,
        kernel="auto",
        gate_mode=3,
        pdl=True,
        budget_ns=None,
        procs: Procs | None = None,
        oproj_launch: str | None = None,
        xmoe: int = 0,
    ):
        check_rows(cfg.requests, cfg.tokens)
        check_xmoe(xmoe)
        self.xmoe = xmoe
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
        # every rank on this GPU: the producers and consumers of all ranks as one launch
        # each (engine.AllRanksStep: tpcomm.oproj.all_ranks produce_all / consume_all)
        whole = not self.multiprocess and backend.single_device and cfg.tp > 1
        whole = whole and not backend.domain.split  # a split domain: per rank, puts between
        mode = oproj_launch
        if mode is None:
            mode = DEFAULT_OPROJ_LAUNCH if whole else "per-rank"
        if mode not in OPROJ_LAUNCHES:
            raise ValueError(f"oproj_launch must be one of {OPROJ_LAUNCHES}; got {mode!r}")
        if mode != "per-rank" and not whole:
            raise ValueError(
                f"oproj_launch={mode!r} needs every rank on one GPU in this process (loopback)"
            )
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
        # each hosted rank's step, as an engine runs it; they share the rows buckets' comms
        common = dict(norm=self.norm, query=self.query, out_norm=self.out_norm, pdl=self.pdl)
        kda = dict(kernel=kernel, gate_mode=gate_mode, kda_state=cfg.kda_state, ring_size=cfg.ring)
        kda.update(state_dtype=cfg.torch_state_dtype, gate_form=cfg.gate)
        ranks = zip(self.ranks, self.layers, self.w_o, strict=True)
        self.decode_layers = [
            DecodeLayer(L, w, self.comms, rank=r, sharing=len(self.ranks), **common, **kda)
            for r, L, w in ranks
        ]
        # "both": every rank's o-projection as one producer and one consumer launch
        both = mode == "both"
        self.all_ranks_step = AllRanksStep(self.decode_layers, self.w_os) if both else None
        self.moe = MoeWaiters(xmoe, self.device, self.ranks, every_rank=mode == "both")

    # --- buffers ---------------------------------------------------------------------------
    def comm_for(self, rows: int):
        """The all-reduce for ``rows`` tokens, of ``oproj_plan``: one launch for every rank
        one-shot; per-rank launches the deployment's plan (twoshot past the measured
        crossovers; ``partials`` reads either back), their groups (or ``--groups``) lowered
        until every rank's consumer can be resident (loopback; one rank per GPU always is).
        Collective on nvshmem: every process builds the same ones in the same order."""
        if rows in self.comms:
            return self.comms[rows]
        from tpcomm.oproj.allreduce import OprojAllReduce

        cfg, split = self.cfg, self.backend.domain.split
        plan = oproj_plan(cfg.tp, rows, cfg.hidden, self.oproj_launch, split)
        if cfg.groups is not None:
            options = [cfg.groups]
        elif self.oproj_launch != "per-rank":  # one consumer launch: no co-residency rule
            options = [plan.groups]
        else:
            options = range(plan.groups, 0, -1)
        one = {"one_launch": True} if self.oproj_launch != "per-rank" else {}
        error = None
        for groups in options:
            try:
                kw = dict(groups=groups, eps=EPS, out_eps=OUT_EPS, twoshot=plan.twoshot)
                shape = (self.backend, rows, cfg.hidden, cfg.blocks)
                comm = OprojAllReduce(*shape, **kw, xmoe_reps=self.xmoe, **self.budget, **one)
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

    def fill(self, bk: Bucket, plan, step: kl.Step, prefix, blocks) -> None:
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
        """The bucket's KDA kernel, as the ranks' ``DecodeLayer.choice`` has it (every rank
        this process hosts shares the GPU: the per-step dispatcher sees a rank's share of
        the SMs, so KdaSplit does not crowd out the other ranks; replay, the whole GPU's),
        kept on the bucket."""
        if bk.kda_choice is None:
            layer = self.decode_layers[0]
            bk.kda_choice = layer.choice(self.cfg.requests, bk.tokens, bk.record)
        return bk.kda_choice

    def _kda(self, bk: Bucket, r: int) -> None:
        i = self.local[r]
        inputs = (bk.x[i], bk.f_a, bk.beta[i], bk.gate[i], bk.slots)
        if bk.replay:  # the ring holds the step's entries; the replay dispatcher's kernel
            self.decode_layers[i].attend(*inputs, accepted=bk.accepted, out=bk.attn[i])
            return
        records = (bk.v_records[i], bk.kg_records[i]) if bk.record else None
        choice = self.kda_choice(bk)
        self.decode_layers[i].attend(
            *inputs, accepted=bk.accepted, records=records, out=bk.attn[i], choice=choice
        )

    def _recover(self, bk: Bucket, r: int) -> None:
        i = self.local[r]
        records = (bk.v_records[i], bk.kg_records[i])
        self.decode_layers[i].recover(bk.slots, records, bk.committed, bk.accepted)

    def _produce(self, bk: Bucket, r: int, parity: int) -> None:
        i = self.local[r]
        with torch.cuda.stream(self.streams[r]):
            self.decode_layers[i].produce(bk.attn[i], parity)

    def _consume(self, bk: Bucket, r: int, parity: int) -> None:
        i = self.local[r]
        x = None if bk.xmoe is None else bk.xmoe[i]
        with torch.cuda.stream(self.streams[r]):
            self.decode_layers[i].consume(bk.prefix[i], bk.blocks, bk.output[i], parity, x)

    def _produce_all(self, bk: Bucket, parity: int) -> None:
        self.all_ranks_step.produce(bk.attn, parity)

    def _consume_all(self, bk: Bucket, parity: int) -> None:
        self.all_ranks_step.consume(bk.prefix, bk.blocks, bk.output, parity, bk.xmoe)

    def _on_ranks(self, ranks, *phases, join=False) -> None:
        """Fork the rank streams from the current stream, run each phase ``fn(r)`` for
        every rank (phase by phase: all producers enqueued before any consumer), join them
        back. ``join``: every rank's next phase also waits for every rank's previous one,
        so on one GPU no spinning consumer starves another rank's KDA or producer CTAs."""
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

    def enqueue(self, bk: Bucket, parity: int, ranks=None, *, eager=False, stamp=None) -> None:
        """One step of ``ranks`` (default: all hosted) on their streams, in stream order.
        ``eager`` with several processes: KDA -> producer, synchronise, meet the other
        processes, then the consumer (compiled beforehand), so no poll budget covers a
        peer's compile or host skew. ``stamp(rank, point)`` (not with ``eager``; rank None:
        every rank, after a launch for all of them) is called on the current stream before
        KDA (``start``, ``launch``) and after each stage (``launch.trace``)."""
        ranks = self.ranks if ranks is None else tuple(ranks)
        all_at_once = self.oproj_launch == "both" and ranks == self.ranks
        mark = stamp if stamp is not None else (lambda r, point: None)

        def chain(r):
            mark(r, "start")
            mark(r, "launch")
            self._kda(bk, r)
            mark(r, "kda")
            if bk.record:
                self._recover(bk, r)
                mark(r, "recover")
            if not all_at_once:
                self._produce(bk, r, parity)
                mark(r, "produce")

        def consume(r):
            self._consume(bk, r, parity)
            mark(r, "consume")

        if eager and self.multiprocess:
            bk.comm.functions()  # the consumer compiled before anyone polls
            self._on_ranks(ranks, chain)
            self.sync_all()
            fork = self.moe.mark()
            self._on_ranks(ranks, consume)
            self.moe.launch(bk, fork)
            self.moe.join()
            return
        # replays: the waiters spin from the step's start; eager (compiles): after the step
        fork = None if eager else self.moe.mark()
        if all_at_once:  # per rank stream, joined; then one producer and one consumer
            self._on_ranks(ranks, chain)
            self._produce_all(bk, parity)
            mark(None, "produce")
            self._consume_all(bk, parity)
            mark(None, "consume")
        else:
            self._on_ranks(ranks, chain, consume, join=True)
        self.moe.launch(bk, self.moe.mark() if eager else fork)
        self.moe.join()

    def _stage(self, bk: Bucket, name: str, parity: int):
        fns = {
            "kda": lambda r: self._kda(bk, r),
            "recover": lambda r: self._recover(bk, r),
            "produce": lambda r: self._produce(bk, r, parity),
            "consume": lambda r: self._consume(bk, r, parity),
        }
        if self.oproj_launch == "both" and name == "produce":
            return lambda: self._produce_all(bk, parity)
        if name == "consume":  # with the MoE waiters (xmoe)

            def consume():
                fork = self.moe.mark()
                if self.oproj_launch == "both":
                    self._consume_all(bk, parity)
                else:
                    self._on_ranks(self.ranks, fns[name])
                self.moe.launch(bk, fork)
                self.moe.join()

            return consume
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
        """Per hosted rank: its state and conv pools (and, replay, its ring's tensors)."""
        return [
            (L.state, L.conv_state, *(D.ring if D.ring is not None else ()))
            for L, D in zip(self.layers, self.decode_layers, strict=True)
        ]

    def snapshot(self, bk: Bucket):
        return [tuple(t.clone() for t in pool) for pool in self.pools()], bk.prefix.clone()

    def restore(self, bk: Bucket, saved) -> None:
        pools, prefix = saved
        for pool, pool0 in zip(self.pools(), pools, strict=True):
            for t, t0 in zip(pool, pool0, strict=True):
                t.copy_(t0)
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
        self.raise_on_moe(bk, "eager run")
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
        return dict(zip(stages, self.timed_replays(bk, graphs, "stage pass"), strict=True))

    def timed_replays(self, bk: Bucket, graphs, what: str) -> list[float]:
        """``graphs`` replayed in order behind one sleep (the host enqueues everything
        while it runs) and one on-stream barrier, an event after each: us per graph on this
        process's clock. Collective; raises (naming ``what``) on a consumer timeout or
        (``xmoe``) a wrong MoE copy, waiter read or hint word."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)]
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(GATE_CYCLES)
        self.stream_barrier()
        events[0].record()
        for g, e in zip(graphs, events[1:], strict=True):
            g.replay()
            e.record()
        torch.cuda.synchronize(self.device)
        self.raise_on_timeout(bk, what)
        self.raise_on_moe(bk, what)
        return [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(len(graphs))]

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

    def raise_on_moe(self, bk: Bucket, what: str) -> None:
        """Collective, ``xmoe``: every process raises when any copy, waiter read or hint
        word is off after ``what`` (eager run, stage pass, back-to-back steps), naming it."""
        if not self.xmoe:
            return
        problems = [p for p in self.procs.objects(self.moe.problems(bk)) if p]
        if problems:
            bk.comm.reset()
            raise RuntimeError(f"{what}: MoE copies / hints: {'; '.join(problems)}")

    def replay(self, bk: Bucket, parity: int) -> float:
        """One step: the bucket's graph replayed; its GPU time in us (behind an on-stream
        barrier of all processes when there are several). A checked step's time includes
        the aftermath of the checks before it (two H200: ~126 us where back-to-back steps
        take ~28; without checks ~29): ``back_to_back`` is the serving figure."""
        g = bk.graphs[parity]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream_barrier()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def back_to_back(self, bk: Bucket, parity: int, steps: int = BACK_TO_BACK) -> list[float]:
        """``steps`` replays of ``bk``'s two graphs in turn from ``parity`` (the one after
        the last step's), enqueued behind one sleep and one on-stream barrier, no barrier
        or host wait between them: us per step on this process's clock, as a serving
        engine runs a layer step after step. One more step runs first and is left out (it
        pays for the checks' host work before it). Collective; raises on a timeout."""
        graphs = [bk.graphs[(parity + i) % 2] for i in range(steps + 1)]
        return self.timed_replays(bk, graphs, "back-to-back steps")[1:]

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

    def gather_ring(self) -> Ring | None:
        """Replay: the whole layer's ring on the CPU, heads concatenated from the ranks'
        rings (process 0; None elsewhere)."""
        parts = []
        for i, axis in enumerate((2, 2, 1)):  # v, kg: [S, R, H, .]; length: [S, H, 2]
            mine = torch.cat([D.ring[i].cpu() for D in self.decode_layers], dim=axis)
            every = self.procs.gather(mine.movedim(axis, 0))  # heads first: ranks concatenate
            parts.append(None if every is None else every.movedim(0, axis).contiguous())
        return None if parts[0] is None else Ring(*parts)

    def materialize(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """Replay: every hosted rank's ``DecodeLayer.materialize`` of ``slots`` (CPU [n]
        int32) committing ``accepted`` pending entries, on the current stream, then this
        GPU idle."""
        for D in self.decode_layers:
            D.materialize(slots.to(self.device), accepted.to(self.device))
        torch.cuda.synchronize(self.device)

    def w_o_cpu(self, r: int) -> torch.Tensor:
        """Rank ``r``'s ``w_o`` columns (CPU, from the model: any rank, hosted or not)."""
        first, count = self.model.rank_heads(r)
        return self.model.w_o[:, first * HEAD_DIM : (first + count) * HEAD_DIM].contiguous()

    def partials(self, bk: Bucket, parity: int):
        """The producers' partials of the step just run [TP, N, HID] (CPU, process 0):
        produced again from the step's attn_out (deterministic), read back from rank 0's
        mailbox (twoshot: from every owner's receive view), then everything re-armed. Also
        whether every rank's mailbox held the same (twoshot, where each column lands once:
        whether every receive slot was written) (process 0; None elsewhere)."""
        self.sync_all()  # every consumer of the step re-armed before the re-publish
        for r in self.ranks:
            i = self.local[r]
            bk.comm.produce(bk.attn[i], self.w_o[i], parity, rank=r)
        self.sync_all()  # every peer's partial landed
        if bk.comm.twoshot:
            views = [bk.comm.rows.receive_view(r)[parity] for r in self.ranks]
            every = self.procs.gather(torch.stack(views))  # [TP owner, TP source, N, HID / TP]
        else:
            every = self.procs.gather(
                torch.stack([bk.comm.mailbox.local(r)[parity] for r in self.ranks])
            )  # [TP, TP, N, HID]
        bk.comm.reset()  # re-arm (and barrier)
        if every is None:
            return None, None
        if bk.comm.twoshot:
            landed = not bool((every.view(torch.int32) == -1).any())  # no sentinel word left
            return twoshot_partials(every).clone(), landed
        bits = every.view(torch.int16)
        same = all(torch.equal(bits[r], bits[0]) for r in range(self.cfg.tp))
        return every[0].clone(), same


def _stream_barrier_fn(backend):
    """An on-stream barrier of every process of ``backend`` (nvshmem ``barrier_all`` on the
    stream), or a host barrier when it has none."""
    if backend.name == "nvshmem":
        try:
            import nvshmem.core as nv

            from tpcomm.backends.nvshmem import TorchStream

            def barrier(stream):
                nv.barrier_all(TorchStream(stream))

            return barrier
        except ImportError:
            pass
    print(
        "note: no on-stream barrier on this backend; replays start behind a host barrier",
        flush=True,
    )
    return lambda stream: backend.barrier()
