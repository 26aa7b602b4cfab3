"""CPU tests of the registered ops (``kimi::kda_*``, ``kimi::oproj_*``) and ``DecodeLayer``:
schemas and what they mutate, fake implementations under ``FakeTensorMode`` (shapes,
dtypes, the entry points' ValueErrors), ``torch.library.opcheck`` on meta tensors (the fake
implementation is the meta kernel; of its checks only the aot_dispatch ones run on meta
tensors, the others need the real kernels) and a ``torch.compile(fullgraph=True)`` trace of a
decode-layer step on fake tensors with no graph break. The real kernels: test_engine_gpu.py.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kda
from engine import AllRanksStep, DecodeLayer
from kda import layer as kl
from kda import synthetic as kt
from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import custom_ops as oproj_ops
from tpcomm.oproj.allreduce import OprojAllReduce

B, T, H, HID, NB = 2, 2, 2, 1024, 2
N, D = B * T, H * 128
OPCHECK_UTILS = (
    "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)  # fmt: skip


def _mutated(op):
    return {a.name for a in op.default._schema.arguments if a.alias_info and a.alias_info.is_write}


def test_ops_registered_in_one_namespace_with_their_mutations():
    ops = torch.ops.kimi
    assert _mutated(ops.kda_decode) == {"conv_state", "state", "out", "v_records", "kg_records"}
    assert _mutated(ops.kda_recover) == {"state"}
    assert _mutated(ops.oproj_publish) == _mutated(ops.oproj_produce) == set()
    assert _mutated(ops.oproj_consume) == _mutated(ops.oproj_produce_consume) == {
        "prefix", "output"
    }  # fmt: skip
    from torch._higher_order_ops.effects import _get_effect

    for name in ("oproj_publish", "oproj_produce", "oproj_consume", "oproj_produce_consume"):
        assert _get_effect(getattr(ops, name).default) == torch.library.EffectType.ORDERED
    assert kda.custom_ops.NAMESPACE == oproj_ops.NAMESPACE == "kimi"


def _case(tokens=T, record=False, device=None):
    layer = kt.make_layer(H, 8, seed=1)
    step = kt.make_step(B, tokens, H, pages=8, seed=2)
    records = None
    if record:
        records = (torch.zeros(B, H, tokens, 128), torch.zeros(B, H, tokens, 256).bfloat16())
    if device is not None:
        layer = layer.to(device)
        step = kl.step_to(step, device)
        records = None if records is None else tuple(r.to(device) for r in records)
    return layer, step, records


def _decode(layer, step, records=None, **kw):
    return kda.decode(
        step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
        layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
        layer.f_b, lower_bound=kl.LOWER_BOUND, scale=kl.SCALE, eps=kl.EPS,
        accepted=step.accepted, records=records, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("tokens, record", [(1, False), (2, False), (3, True)])
def test_kda_fake_shapes_and_checks(tokens, record):
    """Fake CUDA tensors: kda.decode's output [B*T, D] bf16 on the state's device; bad
    shapes still raise ValueError naming the argument; recover traces too."""
    layer, step, records = _case(tokens, record)
    with FakeTensorMode():  # fake CUDA tensors of the same shapes (no GPU needed)
        # (a CPU build of torch cannot view a fake CUDA tensor: bad shapes are new tensors)
        fake = lambda t, shape=None: (
            None
            if t is None
            else torch.empty(t.shape if shape is None else shape, dtype=t.dtype, device="cuda")
        )
        weights = ("conv_weight", "conv_bias", "a_log", "dt_bias", "norm_weight", "f_b")
        flayer = kl.Layer(*(fake(getattr(layer, n)) for n in (*weights, "state", "conv_state")))
        inputs = ("x", "f_a", "beta", "gate", "slots", "accepted")
        fstep = kl.Step(*(fake(getattr(step, n)) for n in inputs))
        frec = None if records is None else tuple(fake(r) for r in records)
        out = _decode(flayer, fstep, frec, kernel="wide", pdl=True)
        assert out.shape == (B * tokens, D) and out.dtype == torch.bfloat16
        assert out.device.type == "cuda"
        with pytest.raises(ValueError, match="gate"):
            bad = kl.Step(fstep.x, fstep.f_a, fstep.beta, fake(step.gate, (B * tokens, 128)),
                          fstep.slots, fstep.accepted)  # fmt: skip
            _decode(flayer, bad, frec)
        with pytest.raises(ValueError, match="out must be"):
            _decode(flayer, fstep, frec, out=fake(out, (1, D)))
        with pytest.raises(ValueError, match="kernel"):
            _decode(flayer, fstep, frec, kernel="lean")
        if record:
            kda.recover(flayer.state, fstep.slots, *frec, flayer.a_log, flayer.dt_bias,
                        fstep.accepted, fstep.accepted, lower_bound=kl.LOWER_BOUND)  # fmt: skip
            with pytest.raises(ValueError, match="a_log"):
                kda.recover(flayer.state, fstep.slots, *frec, fake(layer.a_log, (1,)),
                            flayer.dt_bias, fstep.accepted, fstep.accepted,
                            lower_bound=kl.LOWER_BOUND)  # fmt: skip


def test_kda_entry_points_name_non_tensors():
    layer, step, _ = _case()
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        kda.decode(None, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a,
                   step.beta, layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate,
                   layer.norm_weight, layer.f_b, lower_bound=-5.0, scale=0.1, eps=1e-6,
                   accepted=step.accepted)  # fmt: skip
    with pytest.raises(ValueError, match="v_records"):
        kda.recover(layer.state, step.slots, None, None, layer.a_log, layer.dt_bias,
                    step.accepted, step.accepted, lower_bound=-5.0)  # fmt: skip


def _kda_op_args(tokens, record, device="meta"):
    layer, step, records = _case(tokens, record, device)
    out = torch.empty(B * tokens, D, dtype=torch.bfloat16, device=device)
    v, kg = records if record else (None, None)
    return (step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
            layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
            layer.f_b, out, step.accepted, v, kg, kl.LOWER_BOUND, kl.SCALE, kl.EPS, True,
            "auto", None, 0, True)  # fmt: skip


@pytest.mark.parametrize("tokens, record", [(1, False), (3, True)])
def test_opcheck_kda_on_meta(tokens, record):
    torch.library.opcheck(torch.ops.kimi.kda_decode.default, _kda_op_args(tokens, record),
                          test_utils=OPCHECK_UTILS)  # fmt: skip
    layer, step, (v, kg) = _case(3, True, "meta")
    args = (layer.state, step.slots, v, kg, layer.a_log, layer.dt_bias, step.accepted,
            step.accepted, kl.LOWER_BOUND, True)  # fmt: skip
    torch.library.opcheck(torch.ops.kimi.kda_recover.default, args, test_utils=OPCHECK_UTILS)


def _consumer_tensors(device, n=N):
    bf = dict(dtype=torch.bfloat16, device=device)
    return dict(prefix=torch.zeros(n, HID, **bf), blocks=torch.zeros(n, NB, HID, **bf),
                norm=torch.ones(HID, **bf), query=torch.ones(HID, **bf),
                out_norm=torch.ones(HID, **bf), output=torch.zeros(n, HID, **bf))  # fmt: skip


def test_opcheck_oproj_on_meta():
    comm = OprojAllReduce(LoopbackBackend(2, device="meta"), N, HID, NB)
    c = _consumer_tensors("meta")
    attn = torch.zeros(N, D, dtype=torch.bfloat16, device="meta")
    w_o = torch.zeros(HID, D, dtype=torch.bfloat16, device="meta")
    consumer = (c["prefix"], c["blocks"], c["norm"], c["query"], c["out_norm"], c["output"], None)
    cases = [
        (torch.ops.kimi.oproj_publish, (comm.handle, 1, 0, c["prefix"])),
        (torch.ops.kimi.oproj_produce, (comm.handle, 1, 1, attn, w_o)),
        (torch.ops.kimi.oproj_consume, (comm.handle, 0, 0, *consumer, False)),
        (torch.ops.kimi.oproj_produce_consume,
         (comm.handle, 0, 1, attn, w_o, *consumer, None, True, None, False)),
    ]  # fmt: skip
    for op, args in cases:
        torch.library.opcheck(op.default, args, test_utils=OPCHECK_UTILS)


def test_oproj_fake_checks():
    """The fake oproj ops run the entry points' checks: shapes, rank, step, handle."""
    comm = OprojAllReduce(LoopbackBackend(2, device="cpu"), N, HID, NB)
    c = _consumer_tensors("cpu")
    attn = torch.zeros(N, D, dtype=torch.bfloat16)
    w_o = torch.zeros(HID, D, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        f = {k: mode.from_tensor(v) for k, v in c.items()}
        fa, fw = mode.from_tensor(attn), mode.from_tensor(w_o)
        comm.produce(fa, fw, 0, rank=1)
        comm.consume(f["prefix"], f["blocks"], f["norm"], f["query"], f["out_norm"],
                     f["output"], 0, rank=1)  # fmt: skip
        with pytest.raises(ValueError, match="w_o"):
            comm.produce(fa, fw[:, :128], 0, rank=0)
        with pytest.raises(ValueError, match="prefix"):
            comm.consume(f["prefix"][:1], f["blocks"], f["norm"], f["query"], f["out_norm"],
                         f["output"], 0)  # fmt: skip
        with pytest.raises(ValueError, match="rank 5"):
            comm.produce_consume(fa, fw, f["prefix"], f["blocks"], f["norm"], f["query"],
                                 f["out_norm"], f["output"], 0, rank=5)  # fmt: skip
        with pytest.raises(ValueError, match="step"):
            torch.ops.kimi.oproj_produce(comm.handle, 0, -1, fa, fw)
        with pytest.raises(ValueError, match="handle"):
            torch.ops.kimi.oproj_produce(10**9, 0, 0, fa, fw)
    with pytest.raises(ValueError, match="norm must be a torch.Tensor"):
        comm.consume(c["prefix"], None, None, c["query"], c["out_norm"], c["output"], 0)


def _layers(device="cpu", rows=(N,)):
    backend = LoopbackBackend(2, device=device)  # the kernels' all-reduces, traced on the CPU
    comms = {n: OprojAllReduce(backend, n, HID, NB) for n in rows}
    c = _consumer_tensors(device)
    out = []
    for r in range(2):
        layer = kl.shard_layer(kt.make_layer(2 * H, 8, seed=1), r * H, H).to(device)
        w_o = torch.zeros(HID, D, dtype=torch.bfloat16, device=device)
        out.append(DecodeLayer(layer, w_o, comms, rank=r, norm=c["norm"], query=c["query"],
                               out_norm=c["out_norm"], sms=132))  # fmt: skip
    return out


@pytest.mark.parametrize("record", [False, True])
def test_decode_layer_compiles_without_graph_breaks(record):
    """A two-rank decode-layer step (every rank's KDA, recover after a recorded step, and
    producer, then every consumer, one stream: the loopback order) on fake tensors: one
    graph, no break, the ops in order; one rank's ``DecodeLayer.step`` likewise."""
    layers = _layers()
    _, step, records = _case(T, record)
    c = _consumer_tensors("cpu")

    def layer_step(x, f_a, beta, gate, slots, accepted, records, prefixes, blocks, outputs,
                   parity: int):  # fmt: skip
        for L in layers:
            attn = L.attend(x, f_a, beta, gate, slots, accepted=accepted, records=records)
            if records is not None:
                L.recover(slots, records, accepted, accepted)
            L.produce(attn, parity)
        for L, prefix, output in zip(layers, prefixes, outputs, strict=True):
            L.consume(prefix, blocks, output, parity)
        return outputs[0] + outputs[1]

    torch._dynamo.reset()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor
        args = [fake(t) for t in (step.x, step.f_a, step.beta, step.gate, step.slots,
                                  step.accepted)]  # fmt: skip
        frec = None if records is None else tuple(fake(r) for r in records)
        prefixes = [fake(c["prefix"].clone()) for _ in layers]
        outputs = [fake(c["output"].clone()) for _ in layers]
        blocks = fake(c["blocks"])
        explained = torch._dynamo.explain(layer_step)(*args, frec, prefixes, blocks, outputs, 0)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        code = explained.graphs[0].code
        names = ("kda_decode", "kda_recover", "oproj_produce")
        names = names if record else names[::2]
        order = [code.index(f"kimi.{name}(") for name in names]
        assert order == sorted(order) and "oproj_consume" in code
        assert code.count("kimi.kda_decode(") == 2 and code.count("kimi.oproj_consume(") == 2
        assert code.count("kimi.kda_recover(") == (2 if record else 0)
        for backend in ("eager", "aot_eager"):
            torch._dynamo.reset()
            compiled = torch.compile(layer_step, fullgraph=True, backend=backend)
            for parity in (0, 1):
                out = compiled(*args, frec, prefixes, blocks, outputs, parity)
                assert out.shape == (N, HID) and out.dtype == torch.bfloat16
        torch._dynamo.reset()
        x, f_a, beta, gate, slots, accepted = args
        one = torch._dynamo.explain(layers[0].step)(
            x, f_a, beta, gate, slots, prefixes[0], blocks, 1, accepted=accepted, records=frec,
            committed=accepted if record else None,
        )  # fmt: skip
        assert one.graph_break_count == 0 and one.graph_count == 1
    torch._dynamo.reset()


def test_decode_layer_checks():
    layers = _layers()
    with pytest.raises(ValueError, match="no o-projection all-reduce for 3 rows"):
        layers[0].comm(3)
    L = layers[0]
    with pytest.raises(ValueError, match="kernel"):
        DecodeLayer(L.shard, L.w_o, L.comms, rank=0, norm=L.norm, query=L.query,
                    out_norm=L.out_norm, kernel="lean")  # fmt: skip
    with pytest.raises(ValueError, match="w_o"):
        DecodeLayer(L.shard, L.w_o[:, :128], L.comms, rank=0, norm=L.norm, query=L.query,
                    out_norm=L.out_norm)  # fmt: skip
    assert L.choice(B, T).kernel in ("wide", "stream", "split", "pipe")
    # a verify step writing records is chosen apart: never KdaPipe (it has no record mode)
    wide = DecodeLayer(L.shard, L.w_o, L.comms, rank=0, norm=L.norm, query=L.query,
                       out_norm=L.out_norm, sms=1)  # fmt: skip
    assert wide.choice(B, 4).kernel == "pipe" and wide.choice(B, 4, True).kernel == "stream"


def test_all_ranks_step_checks():
    """AllRanksStep: ranks 0..TP-1 in order, ``w_o`` stacked; its launches refuse a CPU
    mailbox; ``sharing`` splits only the GPU's own SM count."""
    layers = _layers()
    with pytest.raises(ValueError, match="ranks 0..TP-1"):
        AllRanksStep(layers[::-1])
    step = AllRanksStep(layers)
    assert step.w_os.shape == (2, HID, D)
    attn = torch.zeros(2, N, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA device"):  # one launch, refused before it
        step.produce(attn, 0)
    L = layers[0]
    with pytest.raises(ValueError, match="sharing"):
        DecodeLayer(L.shard, L.w_o, L.comms, rank=0, norm=L.norm, query=L.query,
                    out_norm=L.out_norm, sharing=0)  # fmt: skip
    shared = DecodeLayer(L.shard, L.w_o, L.comms, rank=0, norm=L.norm, query=L.query,
                         out_norm=L.out_norm, sms=132, sharing=8)  # fmt: skip
    assert shared.choice(B, T) == L.choice(B, T)  # an explicit sms is the rank's own


def _replay_layer(L, **kw):
    return DecodeLayer(L.shard, L.w_o, L.comms, rank=0, norm=L.norm, query=L.query,
                       out_norm=L.out_norm, sms=132, kda_state="replay", **kw)  # fmt: skip


def test_decode_layer_replay_options(monkeypatch):
    """``kda_state`` / ``ring_size`` refused naming the argument before the ring is
    allocated; a replay layer owns a ring of ``ring_size`` entries per page; records,
    ``recover``, a per-step kernel and (per-step mode) ``materialize`` refused."""
    import engine.layer

    L = _layers()[0]
    assert L.kda_state == "per-step" and L.ring is None
    with pytest.raises(ValueError, match="materialize"):
        L.materialize()

    def no_ring(*args):
        raise AssertionError("a ring allocated before the options were checked")

    bad = [(dict(kda_state="paged"), "kda_state"), (dict(kda_state=None), "kda_state"),
           (dict(ring_size=1), "ring_size"), (dict(ring_size=17), "ring_size"),
           (dict(ring_size=True), "ring_size"), (dict(ring_size=4.0), "ring_size"),
           (dict(kda_state="replay", kernel="wide"), "kernel")]  # fmt: skip
    with monkeypatch.context() as m:
        m.setattr(engine.layer, "make_ring", no_ring)
        for options, name in bad:
            with pytest.raises(ValueError, match=name):
                DecodeLayer(L.shard, L.w_o, L.comms, rank=0, norm=L.norm, query=L.query,
                            out_norm=L.out_norm, **options)  # fmt: skip
    R = _replay_layer(L, ring_size=6)
    assert R.ring.size == 6 and R.ring.v.shape == (8, 6, H, 128)
    assert R.ring.length.shape == (8, H, 2) and not R.ring.length.any()
    assert R.choice(B, T).kernel == "wide" and "R = 6" in R.choice(B, T).reason
    _, step, records = _case(T, record=True)
    with pytest.raises(ValueError, match="records"):
        R.attend(step.x, step.f_a, step.beta, step.gate, step.slots, accepted=step.accepted,
                 records=records)  # fmt: skip
    with pytest.raises(ValueError, match="recover"):
        R.recover(step.slots, records, step.accepted, step.accepted)


def test_decode_layer_materialize_folds_the_rings():
    """``DecodeLayer.materialize`` on the CPU after replay steps (the reference on the
    layer's pools and ring): every ring, or some slots committing ``accepted`` pending
    entries, folded as ``kda.reference.materialize`` folds them."""
    from kda import reference as ref
    from kda.operands import Ring

    for slots, accepted in ((None, None), (torch.tensor([1, 3]), torch.tensor([2, 1]))):
        R = _replay_layer(_layers()[0], ring_size=4)
        S = R.shard
        table = 1 + torch.arange(B * 2, dtype=torch.int32).view(B, 2)  # request b: page 1 + 2b
        for n, tokens in enumerate((1, 2)):  # a decode step, then a verify step (pending)
            step = kt.make_step(B, tokens, H, pages=8, slot_table=table[:, :tokens], seed=10 + n)
            ref.replay_decode(
                step.x, S.conv_weight, S.conv_bias, S.conv_state, step.f_a, step.beta, S.a_log,
                S.dt_bias, step.slots, S.state, step.gate, S.norm_weight, S.f_b,
                lower_bound=R.lower_bound, scale=R.scale, eps=R.eps, accepted=step.accepted,
                ring=R.ring,
            )  # fmt: skip
        assert R.ring.length[[1, 3], 0].tolist() == [[1, 2], [1, 2]]
        want, ring = S.state.clone(), Ring(*(t.clone() for t in R.ring))
        ref.materialize(want, ring, S.a_log, S.dt_bias, lower_bound=R.lower_bound, slots=slots,
                        accepted=None if accepted is None else accepted.int())  # fmt: skip
        R.materialize(slots, None if accepted is None else accepted.int())
        assert torch.equal(S.state, want) and not R.ring.length[[1, 3]].any()
        assert all(torch.equal(a, b) for a, b in zip(R.ring, ring, strict=True))


def test_replay_decode_layer_traces_without_graph_breaks():
    """One rank's replay ``DecodeLayer.step`` on fake tensors: one graph, the replay op
    (mutating the ring) then the producer and the consumer."""
    R = _replay_layer(_layers()[0])
    _, step, _ = _case(T)
    c = _consumer_tensors("cpu")
    torch._dynamo.reset()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor
        x, f_a, beta, gate, slots, accepted = (fake(t) for t in (
            step.x, step.f_a, step.beta, step.gate, step.slots, step.accepted))  # fmt: skip
        one = torch._dynamo.explain(R.step)(x, f_a, beta, gate, slots, fake(c["prefix"].clone()),
                                            fake(c["blocks"]), 0, accepted=accepted)  # fmt: skip
        assert one.graph_break_count == 0 and one.graph_count == 1
        code = one.graphs[0].code
        order = [code.index(f"kimi.{name}(") for name in ("kda_replay_decode", "oproj_produce",
                                                          "oproj_consume")]  # fmt: skip
        assert order == sorted(order) and "kda_decode(" not in code
    torch._dynamo.reset()


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_admit_resets_the_new_requests_pages(kda_state):
    """``DecodeLayer.admit``: the given slots' state and conv pages zeroed and (replay) their
    ring counters emptied; every other page, window and counter untouched; bad slots refused
    before anything is written."""
    L = _layers()[0]
    if kda_state == "replay":
        L = _replay_layer(L, ring_size=4)
        L.ring.length.fill_(3)
        L.ring.v.fill_(1.0)
    S = L.shard
    S.state.uniform_(-1, 1)
    S.conv_state.uniform_(-1, 1)
    before = [t.clone() for t in (S.state, S.conv_state)]
    length = None if L.ring is None else L.ring.length.clone()
    for bad, name in ((torch.tensor([0]), "1..7"), (torch.tensor([8]), "1..7"),
                      (torch.tensor([1.0]), "int32"), (torch.tensor([[1]]), "1-D"),
                      ([1], "int32")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            L.admit(bad)
        assert torch.equal(S.state, before[0]) and torch.equal(S.conv_state, before[1])
    L.admit(torch.tensor([2, 5], dtype=torch.int32))
    kept = [s for s in range(8) if s not in (2, 5)]
    assert not S.state[[2, 5]].any() and not S.conv_state[[2, 5]].any()
    assert torch.equal(S.state[kept], before[0][kept])
    assert torch.equal(S.conv_state[kept], before[1][kept])
    if L.ring is not None:
        assert not L.ring.length[[2, 5]].any() and torch.equal(L.ring.length[kept], length[kept])
        assert bool((L.ring.v == 1.0).all())  # entries past the counters need no clearing
