"""kda.reference: against an independent float64 loop, and its step semantics."""

import math
import struct

import pytest
import torch

from kda import layer as kl
from kda import reference as R
from kda import synthetic as kt


def _f32(v):
    """Round a Python float to fp32 (nearest even)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def naive_step(layer, step, lower_bound, scale, eps, records=False):
    """Per (request, head, token) float64 loop of the SPEC's step, written from the SPEC:
    fp32 roundings where the SPEC names an fp32 operation (the conv FMAs, the SiLU, the raw
    gate's sum), bf16 where it rounds to bf16, float64 elsewhere; ``lower_bound`` None: the
    softplus gate ``exp(-exp(a_log) softplus(raw + dt_bias))``. Returns (output, state,
    conv_state, o, sum |S q|) as new tensors; ``o`` the float64 value before its bf16
    rounding."""
    state = layer.state.double().clone()
    conv = layer.conv_state.clone()
    if not layer.conv_dim_first:
        conv = conv.transpose(1, 2)
    conv_new = conv.clone()
    B = step.slots.shape[0]
    T = step.tokens
    H = layer.heads
    D = H * 128
    out = torch.zeros(B * T, D, dtype=torch.bfloat16)
    o_all = torch.zeros(B * T, D, dtype=torch.float64)
    o_abs = torch.zeros(B * T, D, dtype=torch.float64)

    def bf(v):
        return float(torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).double())

    def sig(v):
        return 1.0 / (1.0 + math.exp(-v))

    w = layer.conv_weight.double()
    bias = None if layer.conv_bias is None else layer.conv_bias.double()
    for b in range(B):
        if T == 1:
            slot = int(step.slots[b])
            cslot, off = slot, 0
        else:
            off = int(step.accepted[b]) - 1
            slot, cslot = int(step.slots[b, off]), int(step.slots[b, 0])
        if slot <= 0:
            continue
        for h in range(H):
            qkv = torch.zeros(3, T, 128, dtype=torch.float64)
            for p in range(3):
                for c in range(128):
                    ch = p * D + h * 128 + c
                    win = [float(conv[cslot, ch, off + j]) for j in range(3)]
                    win += [float(step.x[b * T + t, ch]) for t in range(T)]
                    for t in range(T):
                        acc = 0.0 if bias is None else float(bias[ch])
                        for i in range(4):
                            acc = _f32(win[t + i] * float(w[p, i, h * 128 + c]) + acc)
                        silu = _f32(acc / _f32(1.0 + _f32(math.exp(-acc))))
                        qkv[p, t, c] = bf(silu)
                    for j, val in enumerate(win[1:]):
                        conv_new[cslot, ch, j] = val
            S = state[slot, h].clone()
            for t in range(T):
                row = b * T + t
                fa = step.f_a[row].double()
                raw = torch.tensor([bf(_f32(float(fa @ layer.f_b[h * 128 + c].double())))
                                    for c in range(128)], dtype=torch.float64)  # fmt: skip
                x = raw + layer.dt_bias[h * 128 : h * 128 + 128].double()
                a = math.exp(float(layer.a_log[h]))
                if lower_bound is None:  # torch's softplus: beta 1, x above 20
                    decay = torch.exp(-a * torch.nn.functional.softplus(x))
                else:
                    decay = torch.exp(lower_bound * torch.sigmoid(a * x))
                q, k, v = qkv[0, t], qkv[1, t], qkv[2, t]
                qn = q / math.sqrt(float(q @ q) + 1e-6) * scale
                kn = k / math.sqrt(float(k @ k) + 1e-6)
                bt = sig(float(step.beta[row, h]))
                S = S * decay[None, :]
                v_new = (v - S @ kn) * bt
                S = S + v_new[:, None] * kn[None, :]
                o64 = S @ qn
                o_all[row, h * 128 : h * 128 + 128] = o64
                o_abs[row, h * 128 : h * 128 + 128] = S.abs() @ qn.abs()
                o = torch.tensor([bf(float(x)) for x in o64], dtype=torch.float64)
                if not records:
                    target = slot if T == 1 else int(step.slots[b, t])
                    if target > 0:
                        state[target, h] = S
                rstd = 1.0 / math.sqrt(float(o @ o) / 128 + eps)
                gate = torch.sigmoid(step.gate[row, h * 128 : h * 128 + 128].double())
                out[row, h * 128 : h * 128 + 128] = (
                    o * rstd * layer.norm_weight.double() * gate
                ).to(torch.bfloat16)
    if not layer.conv_dim_first:
        conv_new = conv_new.transpose(1, 2)
    return out, state.float(), conv_new, o_all, o_abs


def bf16_ulp(x):
    """The bf16 ulp of each element of x (fp32 tensor)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, e - 7)


FLOAT64_CASES = [  # T, conv dim-first, bias, conv dtype, (lower_bound, scale, eps)
    (1, True, True, torch.bfloat16, (-5.0, 128**-0.5, 1e-6)),
    (2, False, False, torch.float32, (-2.0, 0.3, 2e-3)),
    (3, True, False, torch.float32, (-8.0, 0.05, 5e-4)),
    # lower_bound None: the softplus gate, some of its inputs past softplus's threshold
    (1, False, True, torch.bfloat16, (None, 128**-0.5, 1e-6)),
    (3, True, True, torch.float32, (None, 0.3, 2e-3)),
]


@pytest.mark.parametrize("T,dim_first,bias,conv_dtype,scalars", FLOAT64_CASES)
def test_against_float64_loop(T, dim_first, bias, conv_dtype, scalars):
    """The reference against the loop at the SPEC's tolerances: outputs within 1 bf16 ulp
    (2^-17 rms for small ones), one ulp of o more only where o lies within 2^-16 sum|S q|
    of a bf16 midpoint (the loop's o is float64: it may round the other way there);
    state pages within 1e-5 of the page's max |ref|; conv pages bitwise. Requests 2, 5, ...
    have small-rms rows, where eps decides the output."""
    H, B = 2, 3
    pages = 1 + B * T
    lower_bound, scale, eps = scalars
    layer = kt.make_layer(
        H, pages, conv_dim_first=dim_first, bias=bias, conv_dtype=conv_dtype, seed=1
    )
    gate_form = "softplus" if lower_bound is None else "lower-bound"
    if gate_form == "softplus":
        kt.extreme_dt_bias(layer, seed=T)
    step = kt.make_step(B, T, H, pages=pages, padding=(1,), seed=2)
    for t in range(T):  # request 2's pages: o ~ 1e-4, mean(o^2) below eps
        layer.state[int(step.slots.view(B, -1)[2, t])] *= 2.0**-10
    ref_out, ref_state, ref_conv, o64, o_abs = naive_step(layer, step, lower_bound, scale, eps)
    got_layer = layer.clone()
    scalars = dict(lower_bound=lower_bound, scale=scale, eps=eps, gate_form=gate_form)
    out = kt.run_reference(got_layer, step, **scalars)
    g, r = out.float().view(B * T, H, 128), ref_out.float().view(B * T, H, 128)
    o = o64.view(B * T, H, 128)
    ulp_o = torch.exp2(torch.floor(torch.log2(o.abs().clamp_min(2.0**-126))) - 7)
    frac = (o.abs() / ulp_o) % 1.0  # position between the two bf16 neighbours of o
    # within 2^-16 sum|S q| of a midpoint: the fp32 recurrence's o differs from the loop's by
    # far less (a few fp32 roundings of S per token)
    near = (frac - 0.5).abs() * ulp_o <= o_abs.view(o.shape) * 2.0**-16
    rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    err = (g - r).abs()
    big = r.abs() >= rms * 2.0**-10
    allowed = bf16_ulp(r) + torch.where(near, r.abs() * 2.0**-7 * 1.01, torch.zeros_like(r))
    ok = torch.where(big, err <= allowed, err <= rms * 2.0**-17)
    assert ok.all(), f"{int((~ok).sum())} outputs beyond the bound: {(~ok).nonzero()[:4].tolist()}"
    scale_p = ref_state.abs().amax(dim=(1, 2, 3))
    state_err = (got_layer.state - ref_state).abs().amax(dim=(1, 2, 3))
    assert (state_err <= 1e-5 * scale_p).all(), (state_err / scale_p).max()
    assert torch.equal(got_layer.conv_state.float(), ref_conv.float())


def _inputs(T, B=4, H=2, dim_first=True, seed=3, padding=(), accepted=None):
    pages = 1 + B * T + 2
    layer = kt.make_layer(H, pages, conv_dim_first=dim_first, seed=seed)
    step = kt.make_step(B, T, H, pages=pages, padding=padding, accepted=accepted, seed=seed + 1)
    return layer, step


@pytest.mark.parametrize("T", [2, 4, 8])
def test_verify_equals_single_token_steps(T):
    B, H = 3, 2
    accepted = torch.tensor([1, T, max(1, T // 2)], dtype=torch.int32)
    layer, step = _inputs(T, B, H, accepted=accepted)
    verify = layer.clone()
    out_v = kt.run_reference(verify, step)
    for b in range(B):
        a = int(accepted[b])
        src = int(step.slots[b, a - 1])
        cslot = int(step.slots[b, 0])
        single = layer.clone()
        page = single.state.shape[0] - 1  # a spare page for the single-token chain
        single.state[page] = layer.state[src]
        single.conv_state[page, :, :3] = layer.conv_state[cslot, :, a - 1 : a + 2]
        for t in range(T):
            row = b * T + t
            one = kl.Step(
                x=step.x[row : row + 1], f_a=step.f_a[row : row + 1], beta=step.beta[row : row + 1],
                gate=step.gate[row : row + 1], slots=torch.tensor([page], dtype=torch.int32),
            )  # fmt: skip
            o = kt.run_reference(single, one)
            assert torch.equal(o, out_v[row : row + 1])
            assert torch.equal(single.state[page], verify.state[int(step.slots[b, t])])
        # The next step (accepted = T) reads window positions T-1 .. T+1.
        assert torch.equal(
            single.conv_state[page, :, :3], verify.conv_state[cslot, :, T - 1 : T + 2]
        )


@pytest.mark.parametrize("T, gate_form", [(2, "lower-bound"), (5, "lower-bound"), (4, "softplus")])
def test_record_and_recover_equal_direct_verify(T, gate_form):
    B, H = 4, 2
    layer, step = _inputs(T, B, H, padding=(2,))
    # not the model's -5: a recover that hard-codes it differs (softplus: no bound)
    gate = dict(gate_form=gate_form, lower_bound=-2.0 if gate_form == "lower-bound" else None)
    direct = layer.clone()
    out_d = kt.run_reference(direct, step, **gate)
    recorded = layer.clone()
    v_rec = torch.full((B, H, T, 128), float("nan"))
    kg_rec = torch.full((B, H, T, 256), float("nan"), dtype=torch.bfloat16)
    out_r = kt.run_reference(recorded, step, records=(v_rec, kg_rec), **gate)
    assert torch.equal(out_r, out_d)
    assert torch.equal(recorded.state, layer.state)  # record mode writes no state
    assert torch.equal(recorded.conv_state, direct.conv_state)  # conv written in record mode
    assert torch.isnan(v_rec[2]).all() and torch.isnan(kg_rec[2].float()).all()  # padding
    n = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    R.recover(
        recorded.state, step.slots, v_rec, kg_rec, layer.a_log, layer.dt_bias, n, step.accepted,
        **gate,
    )  # fmt: skip
    touched = set()
    for b in range(B):
        if b == 2:
            continue
        for t in range(int(n[b])):
            slot = int(step.slots[b, t])
            touched.add(slot)
            assert torch.equal(recorded.state[slot], direct.state[slot])
    for page in range(layer.state.shape[0]):
        if page not in touched:
            assert torch.equal(recorded.state[page], layer.state[page])


def test_raw_gate_input():
    """``raw_gate=``: the recorded raw gate fed back gives the same bits as the dot; one
    raw gate moved by a bf16 ulp moves that head's state; a bad one raises before writes."""
    B, H, T = 3, 2, 3
    layer, step = _inputs(T, B, H, padding=(1,))
    kg = torch.full((B, H, T, 256), float("nan"), dtype=torch.bfloat16)
    kt.run_reference(layer.clone(), step, records=(torch.zeros(B, H, T, 128), kg))
    raw = kg[..., 128:].permute(0, 2, 1, 3).reshape(B * T, H * 128).contiguous()
    plain, fed = layer.clone(), layer.clone()
    out_p = kt.run_reference(plain, step)
    out_f = kt.run_reference(fed, step, raw_gate=raw)
    assert torch.equal(out_p, out_f) and torch.equal(plain.state, fed.state)
    moved = raw.clone()
    moved[0, 130] = (moved[0, 130].float() * (1 + 2.0**-7)).to(torch.bfloat16)
    other = layer.clone()
    kt.run_reference(other, step, raw_gate=moved)
    slot = int(step.slots[0, 0])
    assert not torch.equal(other.state[slot, 1], plain.state[slot, 1])
    assert torch.equal(other.state[slot, 0], plain.state[slot, 0])
    bad = layer.clone()
    with pytest.raises(ValueError, match="raw_gate"):
        kt.run_reference(bad, step, raw_gate=raw.float())
    assert torch.equal(bad.state, layer.state) and torch.equal(bad.conv_state, layer.conv_state)


def test_padding_and_untouched_pages_bitwise():
    T, B, H = 3, 4, 2
    layer, step = _inputs(T, B, H, padding=(0, 3))
    after = layer.clone()
    out = kt.run_reference(after, step)
    assert (out.view(B, T, -1)[[0, 3]] == 0).all()
    written = {int(s) for b in (1, 2) for s in step.slots[b]}
    conv_written = {int(step.slots[b, 0]) for b in (1, 2)}
    for page in range(layer.state.shape[0]):
        if page not in written:
            assert torch.equal(after.state[page], layer.state[page])
        if page not in conv_written:
            assert torch.equal(after.conv_state[page], layer.conv_state[page])
        else:  # window positions past T + 1 untouched
            assert torch.equal(
                after.conv_state[page, :, T + 2 :], layer.conv_state[page, :, T + 2 :]
            )


def test_all_padding_step_touches_nothing():
    layer, step = _inputs(1, 3, 2, padding=(0, 1, 2))
    after = layer.clone()
    out = kt.run_reference(after, step)
    assert (out == 0).all()
    assert torch.equal(after.state, layer.state) and torch.equal(after.conv_state, layer.conv_state)


@pytest.mark.parametrize("T", [1, 4])
def test_conv_layouts_agree(T):
    first, step = _inputs(T, dim_first=True)
    second = first.clone()
    second.conv_state = first.conv_state.transpose(1, 2).contiguous()
    second.conv_dim_first = False
    out1 = kt.run_reference(first, step)
    out2 = kt.run_reference(second, step)
    assert torch.equal(out1, out2)
    assert torch.equal(first.state, second.state)
    assert torch.equal(first.conv_state, second.conv_state.transpose(1, 2))


def test_zero_bias_equals_no_bias():
    layer, step = _inputs(2)
    layer.conv_bias = None
    zero = layer.clone()
    zero.conv_bias = torch.zeros(3 * layer.heads * 128, dtype=torch.bfloat16)
    assert torch.equal(kt.run_reference(layer, step), kt.run_reference(zero, step))


def test_sharded_heads_give_the_same_bits():
    """A head's results do not depend on which shard it is computed in."""
    T, B, H = 2, 3, 4
    layer, step = _inputs(T, B, H)
    full = layer.clone()
    out_full = kt.run_reference(full, step)
    for first in (0, 2):
        shard = kl.shard_layer(layer, first, 2)
        out = kt.run_reference(shard, kl.shard_step(step, H, first, 2))
        assert torch.equal(out, out_full[:, first * 128 : (first + 2) * 128])
        assert torch.equal(shard.state, full.state[:, first : first + 2])


# --- bad inputs: ValueError naming the argument, nothing written ----------------------


def _args(layer, step):
    return dict(
        x=step.x, conv_weight=layer.conv_weight, conv_bias=layer.conv_bias,
        conv_state=layer.conv_state, f_a=step.f_a, beta=step.beta, a_log=layer.a_log,
        dt_bias=layer.dt_bias, slots=step.slots, state=layer.state, gate=step.gate,
        norm_weight=layer.norm_weight, f_b=step.f_b if hasattr(step, "f_b") else layer.f_b,
    )  # fmt: skip


def _call(args, **kw):
    a = dict(args)
    names = ("x", "conv_weight", "conv_bias", "conv_state", "f_a", "beta", "a_log", "dt_bias",
             "slots", "state", "gate", "norm_weight", "f_b")  # fmt: skip
    pos = [a.pop(n) for n in names]
    kw.setdefault("lower_bound", -5.0)
    kw.setdefault("scale", 128**-0.5)
    kw.setdefault("eps", 1e-6)
    return R.decode(*pos, **kw)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _records(v_dtype=torch.float32, v_shape=(4, 2, 4, 128), kg_shape=(4, 2, 4, 256)):
    return (torch.zeros(v_shape, dtype=v_dtype), torch.zeros(kg_shape, dtype=torch.bfloat16))


# (message the refusal must give, change to the valid B = 4, T = 4, H = 2 arguments,
# keywords): each input reaches its own branch of check_decode / check_slot_values.
BAD = [
    ("x must have dtype", lambda a: a.update(x=a["x"].float()), {}),
    (r"x must be \[B\*T, 3\*H\*128\]", lambda a: a.update(x=a["x"][:, :-8].contiguous()), {}),
    ("x must be contiguous", lambda a: a.update(x=a["x"].t().contiguous().t()), {}),
    ("x rows", lambda a: a.update(x=torch.zeros(17, a["x"].shape[1], dtype=torch.bfloat16)), {}),
    ("tokens per request", lambda a: a.update(x=torch.zeros(36, 768, dtype=torch.bfloat16)), {}),
    (r"slots must be \[B, >= T\] for T = 4", lambda a: a.update(slots=a["slots"][:, 0].clone()),
     {}),
    (r"slots must have >= T = 4 columns", lambda a: a.update(slots=a["slots"][:, :3].clone()),
     {}),
    ("slots must have dtype", lambda a: a.update(slots=a["slots"].long()), {}),
    ("conv_weight must have shape",
     lambda a: a.update(conv_weight=a["conv_weight"][:, :3].contiguous()), {}),
    ("conv_bias must have shape", lambda a: a.update(conv_bias=a["conv_bias"][:-1]), {}),
    ("conv_state window W = 5", lambda a: a.update(conv_state=a["conv_state"][..., :5].clone()),
     {}),
    ("conv_state must have dtype", lambda a: a.update(conv_state=a["conv_state"].half()), {}),
    (r"conv_state must be \[S, 3D, W\]",
     lambda a: a.update(conv_state=a["conv_state"][:, :-1].contiguous()), {}),
    (r"state must be \[S, H, 128, 128\]",
     lambda a: a.update(state=a["state"][:, :, :64].contiguous()), {}),
    ("state must have dtype", lambda a: a.update(state=a["state"].double()), {}),
    ("f_a must have shape", lambda a: a.update(f_a=a["f_a"][:-1].contiguous()), {}),
    ("beta must have shape", lambda a: a.update(beta=a["beta"][:, :1].contiguous()), {}),
    ("a_log must have dtype", lambda a: a.update(a_log=a["a_log"].half()), {}),
    ("dt_bias must have dtype", lambda a: a.update(dt_bias=a["dt_bias"].half()), {}),
    ("gate must have shape", lambda a: a.update(gate=a["gate"][:-1]), {}),
    ("norm_weight must have shape", lambda a: a.update(norm_weight=a["norm_weight"][:64]), {}),
    ("f_b must have shape", lambda a: a.update(f_b=a["f_b"][:, :64].contiguous()), {}),
    (r"slots\[0, 1\] = 10000 is past the state pool",
     lambda a: a["slots"].__setitem__((0, 1), 10_000), {}),
    # request 1 is live (accepted 2: its state slot is slots[1, 1] > 0), its conv slot not
    (r"slots\[1, 0\] = 0 but request 1 is live", lambda a: a["slots"].__setitem__((1, 0), 0),
     {"accepted": _i32(1, 2, 3, 4)}),
    (r"slots\[1, 0\] = 5 is past the conv pool \(3\)",
     lambda a: a.update(conv_state=a["conv_state"][:3].clone()), {}),
    (r"accepted\[3\] = 5 is outside", lambda a: None, {"accepted": _i32(1, 2, 3, 5)}),
    (r"accepted\[1\] = 0 is outside", lambda a: None, {"accepted": _i32(1, 0, 3, 1)}),
    ("accepted must have dtype", lambda a: None, {"accepted": _i32(1, 2, 3, 4).long()}),
    ("accepted .* is required", lambda a: None, {"accepted": None}),
    (r"records must be a \(v_records, kg_records\) pair", lambda a: None,
     {"records": (torch.zeros(1),)}),
    ("v_records must have shape", lambda a: None, {"records": (torch.zeros(1), torch.zeros(1))}),
    ("v_records must have dtype", lambda a: None, {"records": _records(torch.bfloat16)}),
    ("kg_records must have shape", lambda a: None,
     {"records": _records(kg_shape=(4, 2, 4, 128))}),
]  # fmt: skip


@pytest.mark.parametrize("message,mutate,kw", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_inputs_raise_before_any_write(message, mutate, kw):
    layer, step = _inputs(4, B=4, H=2)
    args = _args(layer, step)
    args["slots"] = args["slots"].clone()
    mutate(args)
    kw = dict(kw)
    kw.setdefault("accepted", step.accepted)
    state0, conv0 = args["state"].clone(), args["conv_state"].clone()
    with pytest.raises(ValueError, match=message):
        _call(args, **kw)
    assert torch.equal(args["state"], state0) and torch.equal(args["conv_state"], conv0)


def test_valid_inputs_pass():
    """The arguments the refusals above change are valid as they are."""
    layer, step = _inputs(4, B=4, H=2)
    out = _call(_args(layer, step), accepted=step.accepted, records=_records())
    assert out.shape == (16, 256)


def test_bad_inputs_single_token():
    layer, step = _inputs(1, B=2, H=2)
    args = _args(layer, step)
    with pytest.raises(ValueError, match="accepted must be None for single-token"):
        _call(args, accepted=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="records must be None for single-token"):
        _call(args, records=(torch.zeros(2, 2, 1, 128), torch.zeros(2, 2, 1, 256)))
    with pytest.raises(ValueError, match=r"state must be \[S, H, 128, 128\] \(head dim 128\)"):
        _call(dict(args, state=torch.zeros(3, 2, 64, 64)))


RECOVER_BAD = [  # message, argument index (RecoverOperands order) -> bad value
    (r"accepted values must be in 1..T = 1..3", 6, lambda a: a * 4),
    (r"accepted values must be in 1..T", 6, lambda a: a * 0),
    (r"checkpoint values must be in 1..T", 7, lambda a: a * 0),
    (r"checkpoint values must be in 1..T", 7, lambda a: a + 3),
    (r"slots values must be below the state pool", 1, lambda s: s * 100),
    ("kg_records must have dtype", 3, lambda k: k.float()),
    ("v_records must be .* T in 2..8", 2, lambda v: v[:, :, :1].contiguous()),
    (r"slots must have >= T = 3 columns", 1, lambda s: s[:, :2].contiguous()),
    ("a_log must have shape", 4, lambda a: a[:1]),
    ("dt_bias must have shape", 5, lambda d: d[:128]),
    ("checkpoint must have dtype", 7, lambda c: c.long()),
    (r"state must be \[S, H, 128, 128\]", 0, lambda s: s[:, :, :64].contiguous()),
]


@pytest.mark.parametrize("message,index,change", RECOVER_BAD,
                         ids=[str(i) for i in range(len(RECOVER_BAD))])  # fmt: skip
def test_recover_validates(message, index, change):
    T, B, H = 3, 2, 2
    layer, step = _inputs(T, B, H)
    args = [layer.state, step.slots, torch.zeros(B, H, T, 128),
            torch.zeros(B, H, T, 256, dtype=torch.bfloat16), layer.a_log, layer.dt_bias,
            torch.ones(B, dtype=torch.int32), step.accepted]  # fmt: skip
    R.recover(*[a.clone() for a in args], lower_bound=-5.0)  # valid as given
    state0 = layer.state.clone()
    args[index] = change(args[index])
    with pytest.raises(ValueError, match=message):
        R.recover(*args, lower_bound=-5.0)
    assert torch.equal(layer.state, state0)
