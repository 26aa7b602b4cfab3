"""The decode job on the GPU: every TP rank as a stream of one GPU (loopback backend).

One process, ``--tp N`` ranks (``make_backend("loopback", world=N)``). Per step and rank,
on the rank's own stream, in stream order:

    kda.decode   the rank's head shard (record mode on a recorded verify step)
    kda.recover  after a recorded step: commit the accepted tokens
    produce      ``OprojProducer``: bf16(attn_out @ w_o^T) into every rank's mailbox
    consume      ``OprojConsumer``: rank-order sum, residual, AttnRes, output RMSNorm

KDA and recover launch with PDL (``--pdl``; the o-projection API has no PDL option). Every
rank's KDA, recover and producer are enqueued before any consumer, so even an executor
that serialised the ranks' streams publishes before anything polls. The producer takes at
most 8 rows, so requests x tokens must be <= 8 (``check_rows``).

Buckets and graphs: a bucket is (tokens, record) of the step (requests are fixed per job);
its buffers (inputs, attn_out, records, prefix and output per rank) are allocated once and
one CUDA graph per bucket and mailbox parity (``step & 1``: the double buffer) is captured
once and replayed for every step of the bucket; a step's inputs are copied into the
captured buffers first. The first use of a bucket also runs it eagerly (compiles; the
reference for "graph replay == eager") and once stage by stage (each stage of all ranks
as its own graph, events between them, enqueued behind a sleep so the GPU never waits
for the host: the per-kernel breakdown); the state, conv pools and prefixes are restored
after each, so the graph replay is the step.

Checks (rank 0 is this process): every step, every rank's output and prefix bitwise rank
0's and no consumer timed out; every ``--check-every``-th step, against the unsharded
layer (``launch.layer.Unsharded``, on CPU copies, its pools first set to the GPU's):
KDA outputs within 1 bf16 ulp allowing o's own bf16 flip, state pages within 1e-5 of the
page's max |ref| and pages the reference leaves alone bitwise unchanged, conv pages
bitwise; the producer's partials (re-produced from the step's attn_out into the mailbox,
read back and re-armed) within 1 ulp of ``tpcomm.oproj.reference.project``, prefix bitwise
and output within 1 ulp of ``reference.consume`` of those partials. The gate inputs
(``f_a``, ``f_b``) sit on grids where every fp32 order of the gate dot is exact, so every
``--gate-mode`` rounds the raw gate like the reference.
"""

from __future__ import annotations

import statistics

import torch

from kda import testing as kt
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


# --- the runner ---------------------------------------------------------------------------


class Bucket:
    """The captured buffers of one (tokens, record) step shape; graphs per parity."""

    def __init__(self, runner: LoopbackRunner, tokens: int, record: bool):
        cfg, dev = runner.cfg, runner.device
        B, T, tp = cfg.requests, tokens, cfg.tp
        H = cfg.heads_per_rank
        D, N = H * HEAD_DIM, B * T
        self.tokens, self.record, self.rows = T, record, N
        self.comm = runner.comm_for(N)
        bf = dict(dtype=torch.bfloat16, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.x = torch.zeros(tp, N, 3 * D, **bf)
        self.f_a = torch.zeros(N, GATE_RANK, **bf)
        self.beta = torch.zeros(tp, N, H, **bf)
        self.gate = torch.zeros(tp, N, D, **bf)
        self.slots = torch.zeros((B,) if T == 1 else (B, T), **i32)
        self.accepted = torch.ones(B, **i32) if T > 1 else None
        self.committed = torch.ones(B, **i32) if record else None
        self.attn = torch.zeros(tp, N, D, **bf)
        self.v_records = self.kg_records = None
        if record:
            self.v_records = torch.zeros(tp, B, H, T, HEAD_DIM, dtype=torch.float32, device=dev)
            self.kg_records = torch.zeros(tp, B, H, T, 2 * HEAD_DIM, **bf)
        self.prefix = torch.zeros(tp, N, cfg.hidden, **bf)
        self.output = torch.zeros(tp, N, cfg.hidden, **bf)
        self.blocks = torch.zeros(N, cfg.blocks, cfg.hidden, **bf) if cfg.blocks else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stage_us: dict[str, float] | None = None
        self.kda_choice = None

    @property
    def kind(self) -> str:
        if self.tokens == 1:
            return "decode"
        return "verify+record+recover" if self.record else "verify"


class LoopbackRunner:
    """All TP ranks of one layer on one GPU; steps as CUDA-graph replays."""

    def __init__(self, cfg: Config, model: Model, backend, *, kernel="auto", gate_mode=0,
                 pdl=True, budget_ns=None):  # fmt: skip
        check_rows(cfg.requests, cfg.tokens)
        self.cfg, self.model, self.backend = cfg, model, backend
        self.device = backend.device
        self.streams = backend.streams
        self.kernel, self.gate_mode, self.pdl = kernel, gate_mode, bool(pdl)
        self.budget = {} if budget_ns is None else {"budget_ns": budget_ns}
        shards = [model.shard(r) for r in range(cfg.tp)]
        self.layers = [s.kda.to(self.device) for s in shards]
        self.w_o = [s.w_o.to(self.device) for s in shards]
        self.norm = model.norm.to(self.device)
        self.query = model.query.to(self.device)
        self.out_norm = model.out_norm.to(self.device)
        self.comms: dict = {}
        self.buckets: dict = {}

    # --- buffers ---------------------------------------------------------------------------
    def comm_for(self, rows: int):
        """The all-reduce for ``rows`` tokens: the plan's groups (or ``--groups``), lowered
        until every rank's consumer can be resident."""
        if rows in self.comms:
            return self.comms[rows]
        from tpcomm.oproj.api import OprojAllReduce, choose

        cfg = self.cfg
        if cfg.groups is not None:
            options = [cfg.groups]
        else:
            options = range(choose(cfg.tp, rows, cfg.hidden).groups, 0, -1)
        error = None
        for groups in options:
            try:
                comm = OprojAllReduce(self.backend, rows, cfg.hidden, cfg.blocks, groups=groups,
                                      eps=EPS, out_eps=OUT_EPS, **self.budget)  # fmt: skip
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
        """Copy a step's full-layer inputs (CPU) into the bucket's buffers, sharded by rank."""
        x, gate, beta = shard_inputs(step, self.cfg.tp)
        bk.x.copy_(x)
        bk.gate.copy_(gate)
        bk.beta.copy_(beta)
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
    def _kda(self, bk: Bucket, r: int) -> None:
        import kda

        L = self.layers[r]
        kda.decode(
            bk.x[r], L.conv_weight, L.conv_bias, L.conv_state, bk.f_a, bk.beta[r], L.a_log,
            L.dt_bias, bk.slots, L.state, bk.gate[r], L.norm_weight, L.f_b,
            lower_bound=kt.LOWER_BOUND, scale=kt.SCALE, eps=kt.EPS, accepted=bk.accepted,
            conv_dim_first=L.conv_dim_first,
            records=(bk.v_records[r], bk.kg_records[r]) if bk.record else None,
            kernel=self.kernel, gate_mode=self.gate_mode, pdl=self.pdl, out=bk.attn[r],
        )  # fmt: skip

    def _recover(self, bk: Bucket, r: int) -> None:
        import kda

        L = self.layers[r]
        kda.recover(
            L.state, bk.slots, bk.v_records[r], bk.kg_records[r], L.a_log, L.dt_bias,
            bk.committed, bk.accepted, lower_bound=kt.LOWER_BOUND, pdl=self.pdl,
        )  # fmt: skip

    def _produce(self, bk: Bucket, r: int, parity: int) -> None:
        bk.comm.produce(bk.attn[r], self.w_o[r], parity, rank=r, stream=self.streams[r])

    def _consume(self, bk: Bucket, r: int, parity: int) -> None:
        bk.comm.consume(bk.prefix[r], bk.blocks, self.norm, self.query, self.out_norm,
                        bk.output[r], parity, rank=r, stream=self.streams[r])  # fmt: skip

    def _on_ranks(self, ranks, *phases, join=False) -> None:
        """Fork the rank streams from the current stream, run each phase ``fn(r)`` for
        every rank (phase by phase, so all producers are enqueued before any consumer),
        join them back. With ``join`` every rank's next phase also waits for every rank's
        previous one: on one GPU a consumer that spins while another rank's KDA or
        producer CTAs still wait for registers could starve them (its bounded poll would
        then report an error), so loopback steps start consumers once all partials are
        on their way."""
        current = torch.cuda.current_stream(self.device)
        fork = torch.cuda.Event()
        fork.record(current)
        for r in ranks:
            self.streams[r].wait_event(fork)
        for i, phase in enumerate(phases):
            if join and i > 0:
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

    def enqueue(self, bk: Bucket, parity: int, ranks=None) -> None:
        """One step of ``ranks`` (default: all) on their streams, in stream order."""
        ranks = range(self.cfg.tp) if ranks is None else ranks

        def chain(r):
            self._kda(bk, r)
            if bk.record:
                self._recover(bk, r)
            self._produce(bk, r, parity)

        self._on_ranks(ranks, chain, lambda r: self._consume(bk, r, parity), join=True)

    def _stage(self, bk: Bucket, name: str, parity: int):
        fns = {
            "kda": lambda r: self._kda(bk, r),
            "recover": lambda r: self._recover(bk, r),
            "produce": lambda r: self._produce(bk, r, parity),
            "consume": lambda r: self._consume(bk, r, parity),
        }
        return lambda: self._on_ranks(range(self.cfg.tp), fns[name])

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
        the pools and prefixes are as before the call."""
        if parity in bk.graphs:
            return bk.graphs[parity], None, None
        from kda.ops import plan

        if bk.kda_choice is None:
            bk.kda_choice = plan(
                self.cfg.requests, self.cfg.heads_per_rank, bk.tokens, self.device,
                kernel=self.kernel,
            )  # fmt: skip
        saved = self.snapshot(bk)
        self.enqueue(bk, parity)  # eager: compiles and loads every kernel
        torch.cuda.synchronize(self.device)
        self.raise_on_timeout(bk, "eager run")
        eager = self.results(bk)
        self.restore(bk, saved)
        staged = None
        if bk.stage_us is None:
            bk.stage_us = self.stage_pass(bk, parity)
            staged = self.results(bk)
            self.restore(bk, saved)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            self.enqueue(bk, parity)
        torch.cuda.synchronize(self.device)
        bk.graphs[parity] = g
        return g, eager, staged

    def stage_pass(self, bk: Bucket, parity: int) -> dict[str, float]:
        """Each stage of all ranks as its own graph, events between them (us per stage)."""
        stages = [s for s in STAGES if s != "recover" or bk.record]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        graphs = []
        for name in stages:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                self._stage(bk, name, parity)()
            graphs.append(g)
        torch.cuda.synchronize(self.device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(GATE_CYCLES)  # the host enqueues everything while this runs
        events[0].record()
        for g, e in zip(graphs, events[1:], strict=True):
            g.replay()
            e.record()
        torch.cuda.synchronize(self.device)
        self.raise_on_timeout(bk, "stage pass")
        return {n: events[i].elapsed_time(events[i + 1]) * 1e3 for i, n in enumerate(stages)}

    def raise_on_timeout(self, bk: Bucket, what: str) -> None:
        masks = bk.comm.errors[:, 0].tolist()
        if any(masks):
            bk.comm.reset()
            raise RuntimeError(f"{what}: consumer poll timed out (missing-rank masks {masks})")

    def replay(self, bk: Bucket, parity: int) -> float:
        """One step: the bucket's graph replayed; its GPU time in us."""
        g = bk.graphs[parity]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    # --- reading back -------------------------------------------------------------------
    def gather_pools(self):
        """The whole layer's state and conv pools on the CPU, from the ranks' shards."""
        state = torch.cat([L.state.cpu() for L in self.layers], dim=1)
        conv = conv_cat([L.conv_state.cpu() for L in self.layers], self.cfg.conv_dim_first)
        return state, conv

    def partials(self, bk: Bucket, parity: int):
        """The producers' partials of the step just run [TP, N, HID] (CPU): produced again
        from the step's attn_out (deterministic), read back from rank 0's mailbox, then
        everything re-armed. Also whether every rank's mailbox held the same."""
        for r in range(self.cfg.tp):
            bk.comm.produce(bk.attn[r], self.w_o[r], parity, rank=r)
        torch.cuda.synchronize(self.device)
        boxes = [bk.comm.mailbox.local(r)[parity] for r in range(self.cfg.tp)]
        same = all(torch.equal(b.view(torch.int16), boxes[0].view(torch.int16)) for b in boxes)
        out = boxes[0].to("cpu", copy=True)
        bk.comm.reset()
        return out, same


# --- the job --------------------------------------------------------------------------------


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


def main(args, backend_name: str, processes: int, launcher: str) -> int:
    """``launch/decode.py`` on a GPU backend; the exit status."""
    if backend_name == "nvshmem":
        print(
            "DECODE FAILED: --backend nvshmem (one rank per process) is not yet wired to the "
            "GPU runner; run all ranks on one GPU with --backend loopback --tp N",
            flush=True,
        )
        return 2
    if processes != 1:
        print(
            f"DECODE FAILED: --backend loopback runs every rank in one process; this job has "
            f"{processes} (use --nproc-per-node 1 / -np 1)",
            flush=True,
        )
        return 2
    try:
        cfg = Config(
            tp=args.tp or 2, heads=args.heads, hidden=args.hidden, requests=args.requests,
            tokens=args.tokens, blocks=args.blocks, steps=args.steps, seed=args.seed,
            groups=args.groups, conv_dim_first=args.conv_layout == "dim-first",
            padding=args.padding,
        )  # fmt: skip
        cfg.validate()
        check_rows(cfg.requests, cfg.tokens)
        if not torch.cuda.is_available():
            raise ValueError(f"--backend {backend_name} needs a CUDA GPU")
    except ValueError as e:
        print(f"DECODE FAILED: {e}", flush=True)
        return 2
    from tpcomm.symm import make_backend

    backend = make_backend("loopback", world=cfg.tp)
    try:
        return run(args, cfg, backend, launcher)
    finally:
        backend.teardown()


def run(args, cfg: Config, backend, launcher="single") -> int:
    model = Model(cfg)
    exact_gate_weights(model.kda)  # before the shards and the unsharded copy share it
    try:
        runner = LoopbackRunner(cfg, model, backend, kernel=args.kernel,
                                gate_mode=args.gate_mode, pdl=args.pdl)  # fmt: skip
    except ValueError as e:
        print(f"DECODE FAILED: {e}", flush=True)
        return 2
    unsharded = Unsharded(model) if args.check_every else None
    schedule = Schedule(cfg)
    check, kinds = rep.Checks(), {}
    latency: dict[str, list[float]] = {}
    worst = {"kda_ulp": 0.0, "kda_exact": 1.0, "state": 0.0, "output_ulp": 0.0,
             "partial_ulp": 0.0, "prefix": 0.0, "output": 0.0}  # fmt: skip
    for _ in range(cfg.steps):
        plan = schedule.next()
        kinds[plan.kind] = kinds.get(plan.kind, 0) + 1
        step, prefix, blocks = model.step_inputs(plan)
        exact_gate_inputs(step)
        check_slot_values(step.slots, step.accepted, plan.tokens, cfg.pages, cfg.pages)
        parity = plan.index & 1
        try:
            bk = runner.bucket(plan.tokens, plan.record)
            runner.fill(bk, plan, step, prefix, blocks)
            _, eager, staged = runner.graph(bk, parity)
        except (RuntimeError, ValueError) as e:
            check(f"{plan.kind}: first run", False, plan.index, str(e))
            break
        checked = unsharded is not None and plan.index % args.check_every == 0
        if checked:
            before_state, before_conv = runner.gather_pools()
            unsharded.kda.state.copy_(before_state)
            unsharded.kda.conv_state.copy_(before_conv)
        latency.setdefault(plan.kind, []).append(runner.replay(bk, parity))
        masks = bk.comm.errors[:, 0].tolist()
        if not check("no consumer timeout", not any(masks), plan.index, f"masks {masks}"):
            bk.comm.reset()
        if plan.index == 1:
            _inject(args.fault, runner, bk)

        same = all(
            torch.equal(bk.output[r].view(torch.int16), bk.output[0].view(torch.int16))
            and torch.equal(bk.prefix[r].view(torch.int16), bk.prefix[0].view(torch.int16))
            for r in range(cfg.tp)
        )
        check("outputs identical on all ranks", same, plan.index)
        if eager is not None:  # the first step of this graph: its replay is the eager run's
            check("graph replay == eager (bitwise)", _same(runner.results(bk), eager), plan.index)
        if staged is not None:
            check("stage pass == eager (bitwise)", _same(staged, eager), plan.index)
        if checked:
            _check_step(runner, unsharded, bk, plan, step, prefix, blocks,
                        before_state, check, worst)  # fmt: skip

    ok = not check.failures
    report = _report(args, cfg, runner, launcher, kinds, latency, check, worst, ok)
    return rep.finish(report, check.failures, args.json, _print)


def _check_step(runner, unsharded, bk, plan, step, prefix, blocks, before_state, check, worst):
    cfg, model = runner.cfg, runner.model
    i = plan.index
    ref = unsharded.step(plan, step, prefix, blocks, groups=bk.comm.groups)
    attn = torch.cat(list(bk.attn.cpu()), dim=1)
    ok, exact, ulps, detail = ulp_check(attn, ref["attn"], row=HEAD_DIM, o_flip=True)
    check("kda outputs vs unsharded (1 ulp + o's flip)", ok, i, detail)
    worst["kda_ulp"] = max(worst["kda_ulp"], ulps)
    worst["kda_exact"] = min(worst["kda_exact"], exact)
    state, conv = runner.gather_pools()
    within, untouched, ratio = state_check(state, unsharded.kda.state, before_state)
    check("state pages vs unsharded (1e-5 of page max)", within, i, f"worst {ratio:.2e}")
    check("state pages the step leaves alone unchanged (bitwise)", untouched, i)
    worst["state"] = max(worst["state"], ratio)
    check("conv pages == unsharded (bitwise)", torch.equal(conv, unsharded.kda.conv_state), i)

    check("mailboxes re-armed", bk.comm.armed(), i)
    partials, same = runner.partials(bk, plan.index & 1)
    check("partials identical in every rank's mailbox", same, i)
    from tpcomm.oproj import reference as oref

    per, bad = bk.attn.cpu(), []
    for r in range(cfg.tp):
        ok, _, ulps, detail = ulp_check(partials[r], oref.project(per[r], runner.w_o[r].cpu()))
        bad += [] if ok else [f"rank {r}: {detail}"]
        worst["partial_ulp"] = max(worst["partial_ulp"], ulps)
    check("partials vs reference projection (1 ulp)", not bad, i, "; ".join(bad[:2]))
    want_out, want_prefix = model.consume(partials, prefix, blocks, groups=bk.comm.groups)
    got_prefix, got_out = bk.prefix[0].cpu(), bk.output[0].cpu()
    check("prefix == TP reference math (bitwise)",
          torch.equal(got_prefix.view(torch.int16), want_prefix.view(torch.int16)), i)  # fmt: skip
    ok, _, ulps, detail = ulp_check(got_out, want_out)
    check("output vs TP reference math (1 ulp)", ok, i, detail)
    worst["output_ulp"] = max(worst["output_ulp"], ulps)
    p, o = oproj_bound_ratios(partials, got_prefix, got_out, ref["u_prefix"], ref["u_out"])
    worst["prefix"], worst["output"] = max(worst["prefix"], p), max(worst["output"], o)


def _inject(fault, runner, bk):
    """``--fault``: the last rank corrupts one output value or one state element."""
    if fault == "output":
        bk.output[-1].view(torch.int16)[0, 0] ^= 1
    elif fault == "state":
        runner.layers[-1].state.view(torch.int32)[-1, 0, 0, 0] ^= 1 << 22


def _stats(values):
    return {
        "median_us": statistics.median(values),
        "p99_us": rep.percentile(values, 0.99),
        "max_us": max(values),
        "n": len(values),
    }


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _report(args, cfg, runner, launcher, kinds, latency, check, worst, ok):
    buckets = sorted(runner.buckets.values(), key=lambda b: (b.tokens, b.record))
    everything = [v for vs in latency.values() for v in vs]
    lat = {k: _stats(v) for k, v in latency.items()}
    if everything:
        lat["step"] = _stats(everything)
    props = torch.cuda.get_device_properties(runner.device)
    extra = {
        "device": props.name,
        "kernel": {b.kind: b.kda_choice.kernel for b in buckets if b.kda_choice},
        "kernel_reason": {b.kind: b.kda_choice.reason for b in buckets if b.kda_choice},
        "gate_mode": args.gate_mode,
        "pdl": bool(args.pdl),
        "groups_chosen": {str(n): c.groups for n, c in sorted(runner.comms.items())},
        "exact_gate_grids": True,
    }
    return {
        "config": rep.config(cfg, "loopback", launcher, **extra),
        "steps": {"total": sum(kinds.values()), **kinds},
        "latency": lat,
        "breakdown": {b.kind: b.stage_us for b in buckets if b.stage_us},
        "bytes": {b.kind: step_bytes(cfg, b.kind, b.tokens) for b in buckets},
        "checks": check.as_dict(),
        "worst": worst,
        "ok": ok,
    }


def _print(r):
    rep.print_config(r)
    c = r["config"]
    kernels = ", ".join(f"{k}: {v}" for k, v in c["kernel"].items())
    groups = ", ".join(f"{v} at {k} rows" for k, v in c["groups_chosen"].items())
    print(
        f"gpu      {c['device']}; KDA {kernels}; gate mode {c['gate_mode']}, "
        f"pdl {c['pdl']}; consumer groups {groups}"
    )
    print(f"{'latency (graph replay, all ranks)':<36}{'median us':>11}{'p99 us':>10}"
          f"{'max us':>10}{'steps':>7}{'floor us':>10}")  # fmt: skip
    for name, v in r["latency"].items():
        floor = r["bytes"].get(name, {}).get("floor_us")
        f = f"{floor:>10.2f}" if floor is not None else f"{'':>10}"
        print(f"  {name:<34}{v['median_us']:>11.2f}{v['p99_us']:>10.2f}{v['max_us']:>10.2f}"
              f"{v['n']:>7}{f}")  # fmt: skip
    print("breakdown (each stage of all ranks as its own graph, events, us)")
    for kind, stages in r["breakdown"].items():
        cells = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
        print(f"  {kind:<34}{cells}; sum {sum(stages.values()):.2f}")
    print("bytes per step (every request live; floor = (state + w_o) / 4.16 TB/s)")
    for kind, b in r["bytes"].items():
        print(f"  {kind:<34}state {b['state'] / 1e6:.2f} MB, w_o {b['w_o'] / 1e6:.2f} MB, "
              f"mailbox stores {b['mailbox_stores'] / 1e6:.2f} MB")  # fmt: skip
    rep.print_checks(r)
    w = r["worst"]
    print(
        f"  worst: kda {w['kda_ulp']:.2f} ulp (exact >= {w['kda_exact']:.4f}), state "
        f"{w['state']:.2e} of page max, partials {w['partial_ulp']:.2f} ulp, output "
        f"{w['output_ulp']:.2f} ulp; vs unsharded o-proj, error / bound: prefix "
        f"{w['prefix']:.3f}, output {w['output']:.3f}"
    )
