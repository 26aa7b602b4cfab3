"""GPU tests of the registered ops and ``DecodeLayer`` (loopback: every TP rank on this GPU).

- ``torch.library.opcheck`` of ``kimi::kda_decode`` (each kernel, decode and recorded
  verify), ``kimi::kda_recover`` and the all-reduce ops on a loopback TP 1 (the fused op
  is self-contained there; ``consume`` gets a fresh partial before each check).
- ``DecodeLayer`` steps of TP 2 against the references (``launch.layer.Unsharded``: the
  whole layer in plain torch; ``launch.checks``' SPEC tolerances), outputs poisoned first;
  each rank's ``step`` on its own stream bitwise the one-stream order.
- A ``torch.compile(fullgraph=True, mode="reduce-overhead")`` layer step of TP 2, no graph
  break, CUDA graphs not skipped, bitwise the eager step over 20 steps.
"""

from __future__ import annotations

import functools

import pytest
import torch
from shared_gpu import poll_budget_ns

from engine import DecodeLayer, all_reduces
from kda import layer as kl
from kda import synthetic as kt
from launch.checks import (
    attn_drift,
    exact_gate_inputs,
    exact_gate_weights,
    oproj_bound_ratios,
    state_check,
    ulp_check,
)
from launch.layer import EPS, OUT_EPS, Config, Model, Schedule, Unsharded, conv_cat
from launch.runner import shard_inputs
from tpcomm.oproj import reference as oref

pytestmark = pytest.mark.gpu
BUDGET_NS = poll_budget_ns(
    20_000_000
)  # a consumer that never hears from a peer errors instead of hanging
UTILS = (
    "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)  # fmt: skip


# --- opcheck -------------------------------------------------------------------------------


def _kda_args(B, T, H, record, kernel):
    dev = torch.device("cuda")
    layer = kt.make_layer(H, 1 + B * T, seed=3).to(dev)
    step = kl.step_to(kt.make_step(B, T, H, pages=1 + B * T, seed=4), dev)
    out = torch.full((B * T, H * 128), float("nan"), dtype=torch.bfloat16, device=dev)
    v = kg = None
    if record:
        v = torch.zeros(B, H, T, 128, device=dev)
        kg = torch.zeros(B, H, T, 256, dtype=torch.bfloat16, device=dev)
    args = (step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
            layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
            layer.f_b, out, step.accepted, v, kg, kl.LOWER_BOUND, kl.SCALE, kl.EPS, True,
            kernel, None, 0, True)  # fmt: skip
    return args, layer, step, (v, kg)


@pytest.mark.parametrize("kernel", ["wide", "stream", "split", "auto"])
@pytest.mark.parametrize("T, record", [(1, False), (3, True)])
def test_opcheck_kda_decode(kernel, T, record):
    args, *_ = _kda_args(2, T, 2, record, kernel)
    torch.library.opcheck(torch.ops.kimi.kda_decode.default, args, test_utils=UTILS)


def test_opcheck_kda_recover():
    args, layer, step, (v, kg) = _kda_args(2, 3, 2, True, "auto")
    torch.ops.kimi.kda_decode(*args)  # the records of a verify step
    rargs = (layer.state, step.slots, v, kg, layer.a_log, layer.dt_bias, step.accepted,
             step.accepted, kl.LOWER_BOUND, True)  # fmt: skip
    torch.library.opcheck(torch.ops.kimi.kda_recover.default, rargs, test_utils=UTILS)


def test_opcheck_oproj_loopback():
    from tpcomm.backends import make_backend

    backend = make_backend("loopback", world=1)
    try:
        N, HID, NB, D = 4, 1024, 2, 256
        comm = all_reduces(backend, [N], HID, NB, budget_ns=BUDGET_NS)[N]
        g = torch.Generator(device="cuda").manual_seed(5)
        bf = dict(dtype=torch.bfloat16, device="cuda")
        rnd = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
        attn, w_o, partial = rnd(N, D), rnd(HID, D) * 0.05, rnd(N, HID)
        prefix, blocks, output = rnd(N, HID), rnd(N, NB, HID), torch.zeros(N, HID, **bf)
        norm, query, out_norm = rnd(HID), rnd(HID) * 0.2, rnd(HID)
        consumer = (prefix, blocks, norm, query, out_norm, output, None)
        torch.library.opcheck(torch.ops.kimi.oproj_publish.default,
                              (comm.handle, 0, 0, partial), test_utils=UTILS)  # fmt: skip
        torch.library.opcheck(torch.ops.kimi.oproj_produce.default,
                              (comm.handle, 0, 0, attn, w_o), test_utils=UTILS)  # fmt: skip
        comm.reset()  # the partials above were never consumed
        for util in UTILS[:3]:  # each consumes one fresh partial (the others run it twice)
            comm.publish(partial, 1)
            args = (comm.handle, 0, 1, *consumer, False)
            torch.library.opcheck(torch.ops.kimi.oproj_consume.default, args, test_utils=(util,))
            torch.cuda.synchronize()
            assert int(comm.error()[0]) == 0, util
        fused = (comm.handle, 0, 0, attn, w_o, *consumer, None, True, None, False)
        torch.library.opcheck(torch.ops.kimi.oproj_produce_consume.default, fused,
                              test_utils=UTILS)  # fmt: skip
        torch.cuda.synchronize()
        assert int(comm.error()[0]) == 0 and comm.armed()
    finally:
        torch.cuda.synchronize()
        backend.teardown()


# --- DecodeLayer on loopback TP 2 ----------------------------------------------------------


class Job:
    """A TP layer (``launch.layer.Model``) on loopback: each rank's DecodeLayer, per-rank
    input buffers of each step shape, and the steps of ``Schedule``."""

    def __init__(self, tp=2, heads=4, hidden=1024, requests=2, tokens=2, blocks=2, seed=0):
        from tpcomm.backends import make_backend

        cfg = Config(tp=tp, heads=heads, hidden=hidden, requests=requests, tokens=tokens,
                     blocks=blocks, steps=1, seed=seed, groups=None)  # fmt: skip
        cfg.validate()
        self.cfg, self.model = cfg, Model(cfg)
        exact_gate_weights(self.model.kda)
        self.backend = make_backend("loopback", world=tp)
        dev = self.dev = self.backend.device
        rows = sorted({requests, requests * tokens})
        self.comms = all_reduces(self.backend, rows, hidden, blocks, eps=EPS, out_eps=OUT_EPS,
                                 budget_ns=BUDGET_NS)  # fmt: skip
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        m = self.model
        norm, query, out_norm = m.norm.to(dev), m.query.to(dev), m.out_norm.to(dev)
        self.layers = []
        for r in range(tp):
            shard = m.shard(r)
            self.layers.append(DecodeLayer(
                shard.kda.to(dev), shard.w_o.to(dev), self.comms, rank=r, norm=norm,
                query=query, out_norm=out_norm, sms=max(1, sms // tp),
            ))  # fmt: skip
        self.schedule = Schedule(cfg)
        self.buffers: dict = {}

    def close(self):
        torch.cuda.synchronize()
        self.backend.teardown()

    def bufs(self, tokens, record):
        """Static per-rank buffers of a step shape (allocated once, marked static)."""
        key = (tokens, record)
        if key not in self.buffers:
            cfg, dev, tp = self.cfg, self.dev, self.cfg.tp
            B, N, H = cfg.requests, cfg.requests * tokens, cfg.heads_per_rank
            D = H * 128
            bf = dict(dtype=torch.bfloat16, device=dev)
            i32 = dict(dtype=torch.int32, device=dev)
            b = dict(
                x=[torch.zeros(N, 3 * D, **bf) for _ in range(tp)],
                beta=[torch.zeros(N, H, **bf) for _ in range(tp)],
                gate=[torch.zeros(N, D, **bf) for _ in range(tp)],
                f_a=torch.zeros(N, 128, **bf),
                slots=torch.zeros((B,) if tokens == 1 else (B, tokens), **i32),
                accepted=torch.ones(B, **i32) if tokens > 1 else None,
                committed=torch.ones(B, **i32) if record else None,
                records=None,
                prefixes=[torch.zeros(N, cfg.hidden, **bf) for _ in range(tp)],
                outputs=[torch.zeros(N, cfg.hidden, **bf) for _ in range(tp)],
                attns=[torch.zeros(N, D, **bf) for _ in range(tp)],
                blocks=torch.zeros(N, cfg.blocks, cfg.hidden, **bf),
            )
            if record:
                v = [torch.zeros(B, H, tokens, 128, device=dev) for _ in range(tp)]
                kg = [torch.zeros(B, H, tokens, 256, **bf) for _ in range(tp)]
                b["records"] = (v, kg)
            for t in _tensors(b):
                torch._dynamo.mark_static_address(t)
            self.buffers[key] = b
        return self.buffers[key]

    def fill(self, plan):
        """The plan's full-layer inputs into its buffers (each rank's heads); the CPU step."""
        step, prefix, blocks = self.model.step_inputs(plan)
        exact_gate_inputs(step)
        b = self.bufs(plan.tokens, plan.record)
        x, gate, beta = shard_inputs(step, self.cfg.tp)
        for r in range(self.cfg.tp):
            b["x"][r].copy_(x[r])
            b["gate"][r].copy_(gate[r])
            b["beta"][r].copy_(beta[r])
            b["prefixes"][r].copy_(prefix)
            b["outputs"][r].fill_(float("nan"))
            b["attns"][r].fill_(float("nan"))
        b["f_a"].copy_(step.f_a)
        b["slots"].copy_(step.slots)
        if b["accepted"] is not None:
            b["accepted"].copy_(step.accepted)
        if b["committed"] is not None:
            b["committed"].copy_(plan.committed)
        b["blocks"].copy_(blocks)
        return b, step, prefix, blocks

    def pools(self):
        """The whole layer's state and conv pools (CPU), from the ranks' shards."""
        state = torch.cat([L.shard.state.cpu() for L in self.layers], dim=1)
        conv = conv_cat([L.shard.conv_state.cpu() for L in self.layers], self.cfg.conv_dim_first)
        return state, conv


def _tensors(b):
    for v in b.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, list | tuple):
            for t in v:
                yield from ([t] if isinstance(t, torch.Tensor) else t)


def layer_step(layers, x, f_a, beta, gate, slots, accepted, records, committed, prefixes,
               blocks, outputs, attns, parity: int):  # fmt: skip
    """Every rank's step on one stream: each rank's KDA (and recover) and producer, then
    each consumer (every partial has landed before a consumer polls)."""
    for r, L in enumerate(layers):
        rec = None if records is None else (records[0][r], records[1][r])
        L.attend(x[r], f_a, beta[r], gate[r], slots, accepted=accepted, records=rec,
                 out=attns[r])  # fmt: skip
        if committed is not None:
            L.recover(slots, rec, committed, accepted)
        L.produce(attns[r], parity)
    for r, L in enumerate(layers):
        L.consume(prefixes[r], blocks, outputs[r], parity)


def _run(job, fn, b, parity):
    fn(job.layers, b["x"], b["f_a"], b["beta"], b["gate"], b["slots"], b["accepted"],
       b["records"], b["committed"], b["prefixes"], b["blocks"], b["outputs"], b["attns"],
       parity)  # fmt: skip


@pytest.fixture
def job():
    j = Job()
    yield j
    j.close()


def test_decode_layer_vs_references(job):
    """Decode, verify and recorded verify + recover steps of TP 2 against the unsharded
    layer: KDA outputs 1 ulp (+ o's flip), state pages 1e-5, conv pages bitwise, the
    prefix / output within the o-projection bounds, every rank's output bitwise equal."""
    cfg, unsharded = job.cfg, Unsharded(job.model)
    for _ in range(5):
        plan = job.schedule.next()
        b, step, prefix, blocks = job.fill(plan)
        before_state, before_conv = job.pools()
        unsharded.kda.state.copy_(before_state)
        unsharded.kda.conv_state.copy_(before_conv)
        _run(job, layer_step, b, plan.index & 1)
        torch.cuda.synchronize()
        comm = job.comms[cfg.requests * plan.tokens]
        assert int(comm.errors.abs().sum()) == 0 and comm.armed()
        ref = unsharded.step(plan, step, prefix, blocks, groups=comm.groups)
        attn = torch.cat([a.cpu() for a in b["attns"]], dim=1)
        ok, _, _, detail = ulp_check(attn, ref["attn"], row=128, o_flip=True)
        assert ok, (plan.kind, detail)
        state, conv = job.pools()
        within, untouched, ratio = state_check(state, unsharded.kda.state, before_state)
        assert within and untouched, (plan.kind, ratio)
        assert torch.equal(conv, unsharded.kda.conv_state), plan.kind
        outs = [o.cpu() for o in b["outputs"]]
        prefixes = [p.cpu() for p in b["prefixes"]]
        for r in range(1, cfg.tp):
            assert torch.equal(outs[r].view(torch.int16), outs[0].view(torch.int16))
            assert torch.equal(prefixes[r].view(torch.int16), prefixes[0].view(torch.int16))
        per = cfg.heads_per_rank * 128
        partials = torch.stack([
            oref.project(attn[:, r * per : (r + 1) * per].contiguous(), job.layers[r].w_o.cpu())
            for r in range(cfg.tp)
        ])  # fmt: skip
        epilogue = functools.partial(job.model.epilogue, blocks=blocks)
        drift = attn_drift(attn, ref["attn"], job.model.w_o)
        p, o = oproj_bound_ratios(partials, prefixes[0], outs[0], ref["u_prefix"], epilogue,
                                  drift)  # fmt: skip
        assert p <= 1 and o <= 1, (plan.kind, p, o)


def test_decode_layer_step_on_rank_streams(job):
    """Each rank's ``DecodeLayer.step`` on its own stream (recover through ``committed``)
    bitwise the one-stream order, over a decode and two verify steps."""
    plans = [job.schedule.next() for _ in range(3)]
    start = [(L.shard.state.clone(), L.shard.conv_state.clone()) for L in job.layers]
    results = []
    for mode in ("one-stream", "rank-streams"):
        for L, (s, c) in zip(job.layers, start, strict=True):
            L.shard.state.copy_(s)
            L.shard.conv_state.copy_(c)
        got = []
        for plan in plans:
            b, *_ = job.fill(plan)
            if mode == "one-stream":
                _run(job, layer_step, b, plan.index & 1)
            else:
                current = torch.cuda.current_stream()
                for r, L in enumerate(job.layers):
                    stream = job.backend.streams[r]
                    stream.wait_stream(current)
                    rec = None if b["records"] is None else (b["records"][0][r],
                                                             b["records"][1][r])  # fmt: skip
                    with torch.cuda.stream(stream):
                        L.step(b["x"][r], b["f_a"], b["beta"][r], b["gate"][r], b["slots"],
                               b["prefixes"][r], b["blocks"], plan.index & 1,
                               accepted=b["accepted"], records=rec, committed=b["committed"],
                               output=b["outputs"][r], attn=b["attns"][r])  # fmt: skip
                for r in range(job.cfg.tp):
                    current.wait_stream(job.backend.streams[r])
            torch.cuda.synchronize()
            got.append([t.clone() for t in (*b["outputs"], *b["prefixes"])])
        got.append([t.clone() for L in job.layers for t in (L.shard.state, L.shard.conv_state)])
        results.append(got)
    for a, b in zip(*results, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_compiled_layer_step_bitwise_eager(job):
    """``torch.compile(fullgraph=True, mode="reduce-overhead")`` of the TP 2 step: no graph
    break, no CUDA-graph skip, outputs / prefixes per step and the pools after 20 steps
    bitwise the eager step's."""
    from torch._dynamo.utils import counters

    plans = [job.schedule.next() for _ in range(20)]
    for plan in plans:  # every buffer allocated (and marked static) before any trace
        job.bufs(plan.tokens, plan.record)
    start = [(L.shard.state.clone(), L.shard.conv_state.clone()) for L in job.layers]

    def run(fn):
        for L, (s, c) in zip(job.layers, start, strict=True):
            L.shard.state.copy_(s)
            L.shard.conv_state.copy_(c)
        per_step = []
        for plan in plans:
            b, *_ = job.fill(plan)
            _run(job, fn, b, plan.index & 1)
            torch.cuda.synchronize()
            per_step.append([t.clone() for t in (*b["outputs"], *b["prefixes"])])
        pools = [t.clone() for L in job.layers for t in (L.shard.state, L.shard.conv_state)]
        return per_step, pools

    eager_steps, eager_pools = run(layer_step)  # also compiles and caches every kernel
    b, *_ = job.fill(plans[1])
    explained = torch._dynamo.explain(layer_step)(
        job.layers, b["x"], b["f_a"], b["beta"], b["gate"], b["slots"], b["accepted"],
        b["records"], b["committed"], b["prefixes"], b["blocks"], b["outputs"], b["attns"], 1,
    )  # fmt: skip
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.cuda.synchronize()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer_step, fullgraph=True, mode="reduce-overhead", dynamic=False)
    compiled_steps, compiled_pools = run(compiled)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    for i, (a, c) in enumerate(zip(eager_steps, compiled_steps, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True)), f"step {i}"
    assert all(torch.equal(x, y) for x, y in zip(eager_pools, compiled_pools, strict=True))
    for comm in job.comms.values():
        assert int(comm.errors.abs().sum()) == 0 and comm.armed()
    torch._dynamo.reset()
