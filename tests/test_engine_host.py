"""CPU tests of ``DecodeLayer`` on the CPU backends: ``all_reduces`` gives ``HostAllReduce``
(the references; gloo on the host backend, in-process on a CPU loopback), and the same
``DecodeLayer`` / ``AllRanksStep`` calls run ``kda.reference`` and
``tpcomm.oproj.reference``:

- ``DecodeLayer.step`` is bitwise the host job's step (``launch.host.host_step``: the parts
  the job times) and both are bitwise the references the job checks against
  (``launch.layer.Unsharded``), in per-step (decode, verify, recorded verify + recover)
  and replay mode;
- every rank of a CPU loopback through ``AllRanksStep`` is bitwise each rank's parts and
  the unsharded references; a consume before every rank produced is refused;
- no ``torch.cuda`` call on the way (step, admit, the state calls, materialize); what is
  GPU-only is refused with a ValueError naming it;
- bad ``all_reduces`` / ``DecodeLayer`` arguments are refused naming the argument.

The engine-level script on the host backend (several processes) and on loopback (GPU):
``examples/embed_layer.py``, run by ``test_examples.py``.
"""

from __future__ import annotations

import pytest
import torch

from engine import AllRanksStep, DecodeLayer, all_reduces
from kda import layer as kl
from kda import synthetic as kt
from launch.host import host_layer, host_step
from launch.layer import EPS, Config, Model, Schedule, Unsharded
from tpcomm.backends import make_backend
from tpcomm.oproj.allreduce import OprojAllReduce
from tpcomm.oproj.host_allreduce import HostAllReduce

HID = 1024


def _config(tp=1, **kw):
    base = dict(tp=tp, heads=4, hidden=HID, requests=3, tokens=3, blocks=2, steps=5, groups=4)
    return Config(**{**base, **kw})


@pytest.fixture
def host_backend():
    backend = make_backend("host")
    yield backend
    backend.teardown()


def _records(plan, layer, rows_b):
    if not plan.record:
        return None
    H, T = layer.heads, plan.tokens
    v = torch.zeros(rows_b, H, T, 128)
    return v, torch.zeros(rows_b, H, T, 256, dtype=torch.bfloat16)


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_host_step_is_the_jobs_step(host_backend, kda_state):
    """The job's route (``host_step``: attend, recover, produce, consume) and one
    ``DecodeLayer.step`` call on twin layers of the host backend: outputs, prefixes and
    pools bitwise equal, and bitwise the references (``Unsharded``: the TP output and
    prefix, the KDA outputs and pages) at every step."""
    cfg = _config(kda_state=kda_state)
    model, schedule = Model(cfg), Schedule(cfg)
    me = model.shard(0)
    job = host_layer(model, me, host_backend)
    other = model.shard(0)
    engine = host_layer(model, other, host_backend)
    unsharded = Unsharded(model)
    assert job.reference and isinstance(job.comm(cfg.requests), HostAllReduce)
    kinds = set()
    for _ in range(cfg.steps):
        plan = schedule.next()
        kinds.add(plan.kind)
        step, prefix, blocks = model.step_inputs(plan)
        a = prefix.clone()
        attn, out_a, _ = host_step(job, me, plan, step, a, blocks)
        b = prefix.clone()
        records = _records(plan, engine, cfg.requests)
        committed = plan.committed if plan.record else None
        out_b = engine.step(step.x, step.f_a, step.beta, step.gate, step.slots, b, blocks,
                            plan.index & 1, accepted=step.accepted, records=records,
                            committed=committed)  # fmt: skip
        ref = unsharded.step(plan, step, prefix, blocks)
        assert torch.equal(out_a, out_b) and torch.equal(a, b), plan.kind
        assert torch.equal(out_a, ref["tp_out"]) and torch.equal(a, ref["tp_prefix"]), plan.kind
        assert torch.equal(attn, ref["attn"]), plan.kind
        for x, y in ((me.kda.state, other.kda.state), (me.kda.conv_state, other.kda.conv_state)):
            assert torch.equal(x, y), plan.kind
        assert torch.equal(me.kda.state, unsharded.kda.state), plan.kind
        if job.ring is not None:
            assert all(torch.equal(x, y) for x, y in zip(job.ring, engine.ring, strict=True))
            assert all(torch.equal(x, y) for x, y in zip(job.ring, unsharded.ring, strict=True))
    want = {"replay decode", "replay verify"} if cfg.replay else {"decode", "verify"}
    assert want <= kinds and (cfg.replay or "verify+record+recover" in kinds)


def _loopback_layers(cfg, model, backend, rows):
    comms = all_reduces(backend, rows, cfg.hidden, cfg.blocks, groups=cfg.groups, eps=EPS,
                        out_eps=EPS)  # fmt: skip
    weights = dict(norm=model.norm, query=model.query, out_norm=model.out_norm)
    layers = []
    for r in range(cfg.tp):
        me = model.shard(r)
        layers.append(DecodeLayer(me.kda, me.w_o, comms, rank=r, **weights))
    return layers


def test_cpu_loopback_all_ranks_step():
    """TP 2 on a CPU loopback: ``AllRanksStep.step`` (stacked inputs) and each rank's parts
    (every rank's attend and produce, then every consume) on twin layers, both bitwise the
    unsharded references; a rank's consume before every rank produced is refused."""
    cfg = _config(tp=2, steps=3)
    model, schedule = Model(cfg), Schedule(cfg)
    rows = (cfg.requests, cfg.requests * cfg.tokens)
    backend = make_backend("loopback", world=2, device="cpu")
    parts = _loopback_layers(cfg, model, backend, rows)
    stacked = AllRanksStep(_loopback_layers(cfg, model, backend, rows))
    assert stacked.reference and all(L.reference for L in parts)
    unsharded = Unsharded(model)
    per = cfg.heads_per_rank
    for _ in range(cfg.steps):
        plan = schedule.next()
        step, prefix, blocks = model.step_inputs(plan)
        mine = [kl.shard_step(step, cfg.heads, r * per, per) for r in range(2)]
        options = dict(accepted=step.accepted)
        if plan.record:
            records = [_records(plan, parts[0], cfg.requests) for _ in range(2)]
            options.update(records=tuple(torch.stack(t) for t in zip(*records, strict=True)),
                           committed=plan.committed)  # fmt: skip
        ref = unsharded.step(plan, step, prefix, blocks)
        prefixes = torch.stack([prefix.clone(), prefix.clone()])
        out = stacked.step(torch.stack([m.x for m in mine]), step.f_a,
                           torch.stack([m.beta for m in mine]),
                           torch.stack([m.gate for m in mine]), step.slots, prefixes, blocks,
                           plan.index & 1, **options)  # fmt: skip
        attns = []
        for r, L in enumerate(parts):
            rec = None if not plan.record else tuple(t[r] for t in options["records"])
            attn = L.attend(mine[r].x, step.f_a, mine[r].beta, mine[r].gate, step.slots,
                            accepted=step.accepted, records=rec)  # fmt: skip
            if rec is not None:
                L.recover(step.slots, rec, plan.committed, step.accepted)
            L.produce(attn, plan.index & 1)
            attns.append(attn)
        for r, L in enumerate(parts):
            p, o = prefix.clone(), torch.empty_like(prefix)
            L.consume(p, blocks, o, plan.index & 1)
            assert torch.equal(o, ref["tp_out"]) and torch.equal(p, ref["tp_prefix"])
            assert torch.equal(out[r], o) and torch.equal(prefixes[r], p)
        assert torch.equal(torch.cat(attns, dim=1), ref["attn"])
    L = parts[0]
    attn = torch.zeros(cfg.requests, per * 128, dtype=torch.bfloat16)
    L.produce(attn, 0)  # rank 1 has not produced
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] have not produced"):
        L.consume(torch.zeros(3, HID).bfloat16(), torch.zeros(3, 2, HID).bfloat16(),
                  torch.empty(3, HID).bfloat16(), 0)  # fmt: skip


CUDA_CALLS = ("get_device_properties", "current_stream", "is_current_stream_capturing",
              "synchronize", "Event", "Stream", "stream", "current_device", "mem_get_info",
              "get_device_capability", "is_available", "device_count")  # fmt: skip


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_host_layer_makes_no_cuda_call(host_backend, monkeypatch, kda_state):
    """Every call of a host-backend layer (admit, step, copy_state, export / import,
    materialize / fold) with ``torch.cuda``'s entry points made to fail: none is reached."""
    cfg = _config(kda_state=kda_state, tokens=2)
    model = Model(cfg)
    me = model.shard(0)
    layer = host_layer(model, me, host_backend)

    def no_cuda(*args, **kwargs):
        raise AssertionError("a torch.cuda call on the host backend")

    for name in CUDA_CALLS:
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    slots = torch.tensor([1, 3, 5], dtype=torch.int32)
    layer.admit(slots)
    plan = Schedule(cfg).next()
    step, prefix, blocks = model.step_inputs(plan)
    out = layer.step(step.x, step.f_a, step.beta, step.gate, step.slots, prefix, blocks, 0)
    assert out.shape == (cfg.requests, HID) and out.dtype == torch.bfloat16
    layer.copy_state(torch.tensor([1], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))
    blob = layer.export_state(slots)
    assert blob.ready is None
    assert layer.import_state(torch.tensor([2, 4, 6], dtype=torch.int32), blob) is None
    assert torch.equal(layer.shard.state[2], layer.shard.state[1])
    if layer.replay:
        layer.fold(slots)
        layer.materialize(slots)


def test_gpu_only_parts_are_refused_by_name(host_backend):
    """On the CPU: the MoE latent copies (``xmoe``) refused by the host all-reduces and
    ``AllRanksStep``; a layer over the kernels' all-reduces on CPU pools asks for ``sms``
    before any CUDA call; host all-reduces over pools elsewhere, or mixed with the kernels',
    refused naming them."""
    cfg = _config()
    model = Model(cfg)
    me = model.shard(0)
    weights = dict(norm=model.norm, query=model.query, out_norm=model.out_norm)
    with pytest.raises(ValueError, match="xmoe_reps"):
        all_reduces(host_backend, (3,), HID, 2, xmoe_reps=1)
    layer = host_layer(model, me, host_backend)
    prefix, out = torch.zeros(3, HID).bfloat16(), torch.zeros(3, HID).bfloat16()
    with pytest.raises(ValueError, match="xmoe"):
        layer.consume(prefix, None, out, 0, xmoe=torch.zeros(1, 3, HID).bfloat16())
    with pytest.raises(ValueError, match="blocks must hold nb = 2"):
        layer.consume(prefix, None, out, 0)
    loop = make_backend("loopback", world=1, device="cpu")
    kernels = {3: OprojAllReduce(loop, 3, HID, 2)}
    gpu = DecodeLayer(me.kda, me.w_o, kernels, rank=0, **weights)
    assert not gpu.reference
    with pytest.raises(ValueError, match="sms"):
        gpu.choice(3, 1)
    mixed = {**kernels, 9: HostAllReduce(host_backend, 9, HID, 2)}
    with pytest.raises(ValueError, match="comms: host and GPU all-reduces mixed"):
        DecodeLayer(me.kda, me.w_o, mixed, rank=0, **weights)
    stacked = AllRanksStep([DecodeLayer(me.kda, me.w_o, layer.comms, rank=0, **weights)])
    with pytest.raises(ValueError, match="xmoe"):
        stacked.consume(prefix[None], None, out[None], 0, xmoe=out[None, None])


def test_bad_arguments_name_themselves(host_backend):
    """``all_reduces``: ``hidden``, ``blocks`` and ``rows`` named; ``DecodeLayer``: a
    ``norm`` / ``query`` / ``out_norm`` (or ``w_o``) of the wrong shape, dtype or device."""
    for kw, name in ((dict(hidden=-1024), "hidden"), (dict(hidden=1000), "hidden"),
                     (dict(hidden=1024.0), "hidden"), (dict(blocks=-1), "blocks"),
                     (dict(blocks=9), "blocks"), (dict(blocks=True), "blocks"),
                     (dict(rows=4), "rows"), (dict(rows=[0]), "rows"),
                     (dict(rows=[]), "rows")):  # fmt: skip
        args = {**dict(rows=(4,), hidden=HID, blocks=2), **kw}
        with pytest.raises(ValueError, match=f"^{name}"):
            all_reduces(host_backend, **args)
    shard = kt.make_layer(2, 4, seed=0)
    w_o = torch.zeros(HID, 256, dtype=torch.bfloat16)
    ones = torch.ones(HID, dtype=torch.bfloat16)
    good = dict(norm=ones, query=ones, out_norm=ones)
    for name in good:
        for bad in (ones[:512], ones.float(), ones.view(2, 512), "ones", ones.repeat(2)[::2]):
            with pytest.raises(ValueError, match=f"^{name}"):
                DecodeLayer(shard, w_o, {}, rank=0, **{**good, name: bad})
    with pytest.raises(ValueError, match="^w_o"):
        DecodeLayer(shard, w_o.float(), {}, rank=0, **good)
    for args, name in (((-2, 4), "heads"), ((2, 0), "pages"), ((2.0, 4), "heads")):
        with pytest.raises(ValueError, match=f"^{name} must be a positive int"):
            kt.make_layer(*args)
    with pytest.raises(ValueError, match="^window"):
        kt.make_layer(2, 4, window=2)
    with pytest.raises(ValueError, match="^requests"):
        kt.make_step(0, 1, 2, pages=4)


def test_host_produce_consume_is_produce_then_consume():
    """``HostAllReduce.produce_consume`` (one rank in this process) gives bitwise what
    ``produce`` then ``consume`` give."""
    backend = make_backend("loopback", world=1, device="cpu")
    comm = all_reduces(backend, (2,), HID, 1)[2]
    g = torch.Generator().manual_seed(0)
    attn = torch.randn(2, 256, generator=g).bfloat16()
    w_o = torch.randn(HID, 256, generator=g).bfloat16()
    prefix = torch.randn(2, HID, generator=g).bfloat16()
    blocks = torch.randn(2, 1, HID, generator=g).bfloat16()
    ones = torch.ones(HID, dtype=torch.bfloat16)
    outs = []
    for fused in (False, True):
        p, o = prefix.clone(), torch.empty(2, HID, dtype=torch.bfloat16)
        if fused:
            comm.produce_consume(attn, w_o, p, blocks, ones, ones, ones, o, 1)
        else:
            comm.produce(attn, w_o, 1)
            comm.consume(p, blocks, ones, ones, ones, o, 1)
        outs.append((p, o))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
