"""CPU tests of ``engine.load``: a rank's shard of a KDA layer's ``state_dict`` (fla's names,
Kimi-Linear's), what it refuses (ValueError naming the key), the engine's step inputs, the
hand-off of an fla prefill, and the same 16 decode tokens as fla at TP 1, 2 and 4 (the
lower-bound gate) and, for a Kimi-Linear-shaped layer (softplus gate, 32 heads, its names),
at TP 1, 2, 4 and 8.

The decode test runs fla's naive functions (``tests/_harness_fla.py``: fla-core 0.6.0, no
triton) against the runtime's CPU path, the references ``DecodeLayer.step`` stands for
(``kda.reference.decode`` per rank, ``tpcomm.oproj.reference``'s producer and consumer),
within the bounds the harness derives from the two paths' rounding points. The GPU kernels
against fla's own layer: ``test_engine_load_gpu.py``.
"""

from __future__ import annotations

import functools

import _harness_fla as fh
import pytest
import torch

from engine import KIMI_LINEAR_NAMES, admit_prefill, load_rank, step_inputs
from kda import reference as kref
from kda import synthetic as kt
from tpcomm.oproj import reference as oref

H, HID = 4, 1024  # the small layer of the loader tests
D = H * 128
KW = dict(lower_bound=-5.0, eps=1e-5)


@functools.cache
def _sd():
    return fh.state_dict(seed=3, hidden=HID, heads=H)


def _load(sd=None, **kw):
    return load_rank(_sd() if sd is None else sd, **{"rank": 0, "tp": 1, "pages": 3, **KW, **kw})


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ranks_hold_their_heads(tp):
    """Rank r's shard: heads r*H/tp.., the conv weights as [part, tap, channel], biases,
    f_b rows, A_log / dt_bias in fp32, the shared norm weight, its w_o columns; zeroed pools
    of the asked shapes; the ranks' shards together are the whole layer."""
    sd, whole = _sd(), _load(window=6)
    for r in range(tp):
        got = _load(rank=r, tp=tp, window=6)
        S, n = got.shard, H // tp
        cols = slice(r * n * 128, (r + 1) * n * 128)
        assert got.first == r * n and S.heads == n and got.scale == 128**-0.5
        for p, name in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
            assert torch.equal(S.conv_weight[p], sd[f"{name}.weight"][cols, 0].T)
            assert torch.equal(
                S.conv_bias[p * n * 128 : (p + 1) * n * 128], sd[f"{name}.bias"][cols]
            )
        assert torch.equal(S.f_b, sd["f_proj.1.weight"][cols])
        assert S.a_log.dtype == S.dt_bias.dtype == torch.float32
        assert torch.equal(S.a_log, sd["A_log"][r * n : (r + 1) * n])
        assert torch.equal(S.dt_bias, sd["dt_bias"][cols])
        assert torch.equal(S.norm_weight, sd["o_norm.weight"])
        assert torch.equal(got.w_o, sd["o_proj.weight"][:, cols]) and got.w_o.is_contiguous()
        assert S.state.shape == (3, n, 128, 128) and not S.state.any()
        assert S.conv_state.shape == (3, 3 * n * 128, 6) and not S.conv_state.any()
        assert torch.equal(S.conv_weight, whole.shard.conv_weight[:, :, cols])
    assert (got.lower_bound, got.eps) == (-5.0, 1e-5)


def test_kimi_linear_names_and_prefix():
    """A Kimi-Linear checkpoint (f_a/f_b/g_a/g_b names, A_log [1, 1, H, 1]) under a model
    prefix loads the same shard as fla's names."""
    prefix = "model.layers.3.self_attn."
    renamed = {prefix + KIMI_LINEAR_NAMES.get(n, n): t for n, t in _sd().items()}
    renamed[prefix + "A_log"] = _sd()["A_log"].view(1, 1, H, 1)
    a = _load(renamed, prefix=prefix, names=KIMI_LINEAR_NAMES, rank=1, tp=2)
    b = _load(rank=1, tp=2)
    for name in ("conv_weight", "conv_bias", "a_log", "dt_bias", "norm_weight", "f_b"):
        assert torch.equal(getattr(a.shard, name), getattr(b.shard, name)), name
    assert torch.equal(a.w_o, b.w_o)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.f_b_proj\.weight"):
        _load(
            {n: t for n, t in renamed.items() if "f_b" not in n},
            prefix=prefix,
            names=KIMI_LINEAR_NAMES,
        )


def _without(name):
    return {n: t for n, t in _sd().items() if n != name}


def _with(name, t):
    return {**_sd(), name: t}


REFUSED = [
    (lambda: _without("v_conv1d.weight"), {}, "v_conv1d.weight: missing"),
    (lambda: _without("k_conv1d.bias"), {}, "k_conv1d.bias: missing"),
    (lambda: _with("dt_bias", torch.zeros(H * 64)), {}, "dt_bias.*head dim 128"),
    (lambda: _with("A_log", torch.zeros(2, 2)), {}, "A_log: shape"),
    (lambda: _sd(), dict(tp=3), "A_log: 4 heads are not divisible by TP 3"),
    (lambda: _with("q_conv1d.weight", torch.zeros(D, 1, 3).bfloat16()), {}, "q_conv1d.weight"),
    (lambda: _with("k_conv1d.weight", torch.zeros(D, 1, 4)), {}, "k_conv1d.weight: dtype"),
    (lambda: _with("f_proj.1.weight", torch.zeros(D, 128)), {}, "f_proj.1.weight: dtype"),
    (lambda: _with("f_proj.1.weight", torch.zeros(D, 64).bfloat16()), {}, "f_proj.1.weight"),
    (lambda: _with("o_proj.weight", torch.zeros(HID, D)), {}, "o_proj.weight: dtype"),
    (lambda: _with("o_proj.weight", torch.zeros(1000, D).bfloat16()), {}, "o_proj.weight rows"),
    (lambda: _with("o_norm.weight", torch.zeros(D)), {}, "o_norm.weight: shape"),
    (lambda: _with("dt_bias", torch.zeros(D, dtype=torch.int32)), {}, "dt_bias: dtype"),
    (lambda: _sd(), dict(lower_bound=None), "lower_bound must be a finite float"),
    (lambda: _sd(), dict(eps=None), "eps must be a finite float"),
    (lambda: _sd(), dict(lower_bound=0.5), "lower_bound must be <= 0"),
    (lambda: _sd(), dict(rank=2, tp=2), "rank"),
    (lambda: _sd(), dict(pages=1), "pages"),
    (lambda: _sd(), dict(window=2), "window"),
    (lambda: [1], {}, "source must be"),
]


@pytest.mark.parametrize("make, kw, match", REFUSED)
def test_refusals_name_the_key(make, kw, match):
    with pytest.raises(ValueError, match=match):
        _load(make(), **kw)


class _Kda(torch.nn.Module):
    """The attributes and parameters of fla's ``KimiDeltaAttention`` that the loader reads
    (fla's module itself needs triton and a GPU to build)."""

    def __init__(self, **attrs):
        super().__init__()
        base = dict(
            num_heads=H,
            num_v_heads=H,
            head_dim=128,
            conv_size=4,
            use_short_conv=True,
            allow_neg_eigval=False,
            lower_bound=-5.0,
        )
        for name, value in {**base, **attrs}.items():
            setattr(self, name, value)
        for name, t in _sd().items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
        self.o_norm.activation, self.o_norm.eps = "sigmoid", 1e-5


@pytest.mark.parametrize(
    "attrs, kw, match",
    [
        (dict(lower_bound=None), dict(lower_bound=-5.0), r"lower_bound \(-5.0\) differs"),
        (dict(lower_bound=None), dict(gate_form="lower-bound"), "gate_form .* differs"),
        ({}, dict(gate_form="softplus"), "gate_form .* differs"),
        (dict(num_v_heads=2 * H), {}, "num_v_heads"),
        (dict(head_dim=64), {}, "head_dim"),
        (dict(allow_neg_eigval=True), {}, "allow_neg_eigval"),
        (dict(use_short_conv=False), {}, "use_short_conv"),
        (dict(conv_size=3), {}, "conv_size"),
        ({}, dict(lower_bound=-4.0), "lower_bound .* differs"),
        ({}, dict(eps=1e-6), "eps .* differs"),
        ({}, dict(names=KIMI_LINEAR_NAMES), "names"),
    ],
)
def test_module_refusals(attrs, kw, match):
    with pytest.raises(ValueError, match=match):
        load_rank(_Kda(**attrs), rank=0, tp=1, pages=2, **kw)


def test_module_source_gives_its_scalars():
    module = _Kda(lower_bound=-3.0)
    module.o_norm.eps = 1e-6
    got = load_rank(module, rank=1, tp=2, pages=2)
    assert (got.lower_bound, got.eps, got.gate_form) == (-3.0, 1e-6, "lower-bound")
    assert torch.equal(got.shard.f_b, _load(rank=1, tp=2).shard.f_b)
    softplus = load_rank(_Kda(lower_bound=None), rank=1, tp=2, pages=2, gate_form="softplus")
    assert (softplus.lower_bound, softplus.gate_form) == (None, "softplus")
    assert torch.equal(softplus.shard.dt_bias, got.shard.dt_bias)


def test_softplus_state_dict_and_its_refusals():
    """A state_dict with ``gate_form="softplus"`` loads with no bound (Kimi-Linear's names,
    A_log [1, 1, H, 1]); its ``DecodeLayer`` carries the form. A bound with it, no gate at
    all, or an unknown form: ValueError naming the argument."""
    kimi = fh.kimi_linear_names(_sd())
    got = _load(kimi, prefix="model.layers.0.self_attn.", names=KIMI_LINEAR_NAMES,
                lower_bound=None, gate_form="softplus", rank=1, tp=2)  # fmt: skip
    assert (got.gate_form, got.lower_bound) == ("softplus", None)
    assert torch.equal(got.shard.a_log, _sd()["A_log"][2:])
    hid = got.w_o.shape[0]
    gammas = {k: torch.ones(hid, dtype=torch.bfloat16) for k in ("norm", "query", "out_norm")}
    layer = got.decode_layer({}, **gammas)
    assert (layer.gate_form, layer.lower_bound) == ("softplus", None)
    for kw, match in (
        (dict(gate_form="softplus"), "lower_bound must be None with gate_form='softplus'"),
        (dict(gate_form="relu"), "gate_form must be one of"),
        (dict(lower_bound=None), "or gate_form='softplus'"),
    ):
        with pytest.raises(ValueError, match=match):
            _load(**kw)


def test_fla_module_loads_as_its_state_dict():
    """fla's own ``KimiDeltaAttention`` (built where fla's layers import: triton installed)
    has the harness's key names and shapes and loads as its ``state_dict`` does."""
    if fh.fla_dir() is None:
        pytest.skip("fla-core 0.6.0 is not installed")
    try:
        cls = fh.kda_layer_class()
    except ImportError as e:
        pytest.skip(f"fla's KimiDeltaAttention does not import here: {e}")
    layer = cls(
        hidden_size=HID,
        num_heads=H,
        head_dim=128,
        lower_bound=-5.0,
        conv_bias=True,
        layer_idx=0,
        norm_eps=1e-5,
    ).to(torch.bfloat16)
    want = {n: tuple(t.shape) for n, t in _sd().items()}
    assert {n: tuple(t.shape) for n, t in layer.state_dict().items()} == want
    layer.load_state_dict(_sd())
    got, ref = load_rank(layer, rank=1, tp=2, pages=2), _load(rank=1, tp=2, pages=2)
    assert (got.lower_bound, got.eps) == (-5.0, 1e-5)
    for name in ("conv_weight", "conv_bias", "norm_weight", "f_b"):
        assert torch.equal(getattr(got.shard, name), getattr(ref.shard, name)), name
    # the module casts A_log / dt_bias to bf16 with the rest; the loader widens them exactly
    assert torch.equal(got.shard.a_log, ref.shard.a_log.bfloat16().float())
    assert torch.equal(got.w_o, ref.w_o)


def test_step_inputs_and_prefill_handoff():
    """``step_inputs``: the rank's [q | k | v] columns, beta heads and gate columns;
    ``admit_prefill``: the rank's heads of fla's state (V-first, or transposed) and the last
    three inputs of its conv windows into both conv layouts; refusals before any write."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).bfloat16()
    q, k, v, gate, f_a, beta = rnd(2, D), rnd(2, D), rnd(2, D), rnd(2, D), rnd(2, 128), rnd(2, H)
    x, fa, b, gt = step_inputs(q, k, v, f_a, beta, gate, rank=1, tp=2)
    cols = slice(256, 512)
    assert torch.equal(x, torch.cat([q[:, cols], k[:, cols], v[:, cols]], 1))
    assert torch.equal(b, beta[:, 2:]) and torch.equal(gt, gate[:, cols]) and fa is not None
    with pytest.raises(ValueError, match="beta"):
        step_inputs(q, k, v, f_a, beta[:, :3], gate, rank=0, tp=2)
    with pytest.raises(ValueError, match="rank 0 of TP 3"):
        step_inputs(q, k, v, f_a, beta, gate, rank=0, tp=3)

    state = torch.randn(2, H, 128, 128, generator=g)
    windows = tuple(rnd(2, D, 4) for _ in range(3))
    for dim_first, v_first in ((True, True), (False, False)):
        got = _load(rank=1, tp=2, window=5, conv_dim_first=dim_first).shard
        got.conv_state.fill_(7.0)
        admit_prefill(got, 2, state, windows, rank=1, tp=2, index=1, state_v_first=v_first)
        want = state[1, 2:] if v_first else state[1, 2:].transpose(-1, -2)
        assert torch.equal(got.state[2], want) and not got.state[[0, 1]].any()
        taps = torch.cat([w[1, cols, 1:] for w in windows])  # [3D, 3]
        page = got.conv_state[2] if dim_first else got.conv_state[2].T
        assert torch.equal(page[:, :3], taps) and not page[:, 3:].any()
        assert bool((got.conv_state[1] == 7.0).all())
        for bad, match in (
            (dict(slot=0), "slot"),
            (dict(index=2), "index"),
            (dict(rank=0, tp=4), "has 1 heads"),
            (dict(conv_state=windows[:2]), "conv_state"),
        ):
            args = {**dict(slot=1, recurrent_state=state, conv_state=windows, rank=1, tp=2), **bad}
            with pytest.raises(ValueError, match=match):
                admit_prefill(got, **args)
        assert bool((got.conv_state[1] == 7.0).all())


def test_spec_conv_and_gate_are_the_references():
    """The harness's runtime-side recurrence inputs (``spec_conv``, ``spec_raw_gate``) are
    bitwise ``kda.reference``'s (its record mode writes k and the raw gate)."""
    layer = kt.make_layer(2, 5, seed=4)
    step = kt.make_step(2, 2, 2, pages=5, seed=5)
    dim = 256
    records = (torch.zeros(2, 2, 2, 128), torch.zeros(2, 2, 2, 256).bfloat16())
    conv = layer.conv_state.clone()
    kt.run_reference(layer, step, records)
    offset = step.accepted.long() - 1
    for b in range(2):
        taps = conv[step.slots[b, 0], dim : 2 * dim, offset[b] : offset[b] + 3].T
        seq = torch.cat([taps, step.x[2 * b : 2 * b + 2, dim : 2 * dim]])
        k = fh.spec_conv(
            seq.unfold(0, 4, 1).transpose(1, 2),
            layer.conv_weight[1],
            layer.conv_bias[dim : 2 * dim],
        )
        assert torch.equal(k.view(2, 2, 128), records[1][b, :, :, :128].transpose(0, 1))
    raw = fh.spec_raw_gate(step.f_a, layer.f_b).view(2, 2, 2, 128)
    assert torch.equal(raw.transpose(1, 2), records[1][..., 128:])


# --- the same tokens as fla ------------------------------------------------------------


@functools.cache
def _fla_run(heads=fh.HEADS, hidden=fh.HIDDEN, lower_bound=fh.LOWER_BOUND):
    """fla's naive layer (``lower_bound`` None: the softplus gate) and its trace."""
    sd = fh.state_dict(heads=heads, hidden=hidden, softplus=lower_bound is None)
    hs = fh.hidden_states(hidden=hidden)
    return sd, fh.cpu_fla(sd, hs, lower_bound=lower_bound)


def host_decode(sd, trace: fh.Trace, tp: int, lower_bound=fh.LOWER_BOUND):
    """fla's decode tokens through TP ``tp`` ranks loaded from ``sd``, on the CPU path of
    ``DecodeLayer.step``: each rank's ``kda.reference.decode`` and producer
    (``oref.project``), then the consumer (``oref.consume``; a zero prefix, so the prefix
    it returns is the o-projection). ``lower_bound`` None: the softplus gate, loaded from
    ``sd`` under Kimi-Linear's names. Returns (y [N, D], z [N, HID])."""
    source, kw = sd, dict(lower_bound=lower_bound, eps=fh.NORM_EPS)
    if lower_bound is None:
        source, prefix = fh.kimi_linear_names(sd), "model.layers.0.self_attn."
        kw.update(gate_form="softplus", names=KIMI_LINEAR_NAMES, prefix=prefix)
    ranks = [load_rank(source, rank=r, tp=tp, pages=2, window=4, **kw) for r in range(tp)]
    for r, rl in enumerate(ranks):
        admit_prefill(
            rl.shard,
            1,
            trace.recurrent_state,
            trace.windows,
            rank=r,
            tp=tp,
            state_v_first=trace.v_first,
        )
    slots = torch.tensor([1], dtype=torch.int32)
    hidden = sd["o_proj.weight"].shape[0]
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    ys, zs = [], []
    for t in range(trace.q.shape[0]):
        rows = [getattr(trace, n)[t : t + 1] for n in ("q", "k", "v", "f_a", "beta", "gate")]
        attns, partials = [], []
        for r, rl in enumerate(ranks):
            x, f_a, beta, gate = step_inputs(*rows, rank=r, tp=tp)
            L = rl.shard
            attn = kref.decode(
                x,
                L.conv_weight,
                L.conv_bias,
                L.conv_state,
                f_a,
                beta,
                L.a_log,
                L.dt_bias,
                slots,
                L.state,
                gate,
                L.norm_weight,
                L.f_b,
                lower_bound=rl.lower_bound,
                gate_form=rl.gate_form,
                scale=rl.scale,
                eps=rl.eps,
                conv_dim_first=L.conv_dim_first,
            )
            attns.append(attn)
            partials.append(oref.project(attn, rl.w_o))
        prefix = torch.zeros(1, hidden, dtype=torch.bfloat16)
        _, z = oref.consume(
            torch.stack(partials), prefix, None, ones, ones, ones, eps=1e-6, out_eps=1e-6
        )
        ys.append(torch.cat(attns, dim=1))
        zs.append(z)
    return torch.cat(ys), torch.cat(zs)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_decode_matches_fla_naive(tp):
    """fla's naive layer prefills 64 tokens (chunk form) and decodes 16; the runtime at TP
    ``tp`` takes fla's prefill state and conv windows and decodes the same 16: fla's
    recurrence inputs one rounding apart from ours, the outputs before and after ``o_proj``
    within ``y_bound`` / ``z_bound``, the greedy argmax of a 4096-word head equal on every
    token its margin decides (``fh.TIE_SIGMAS``)."""
    pytest.importorskip("einops")
    if fh.fla_dir() is None:
        pytest.skip("fla-core 0.6.0 is not installed")
    sd, trace = _fla_run()
    y, z = host_decode(sd, trace, tp)
    report = fh.compare(trace, sd, y, z, tp)
    print(f"TP {tp}: {report}")
    assert report["inputs"] <= 1, report
    assert report["y"] <= 1 and report["z"] <= 1, report
    assert report["argmax_equal"] and report["ties"] <= fh.DECODE // 4, report


@pytest.mark.parametrize("hidden", [fh.KIMI_LINEAR_HIDDEN])  # 2304 where the o-proj takes it
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kimi_linear_layer_matches_fla_naive(tp, hidden):
    """A Kimi-Linear-shaped layer (the softplus gate, 32 heads, random weights, fla's
    initial dt_bias) loaded under Kimi-Linear's names: as ``test_decode_matches_fla_naive``,
    fla's naive layer (``naive_kda_gate``) against the runtime at TP ``tp``, the same bounds
    and argmax check."""
    pytest.importorskip("einops")
    if fh.fla_dir() is None:
        pytest.skip("fla-core 0.6.0 is not installed")
    sd, trace = _fla_run(fh.KIMI_LINEAR_HEADS, hidden, None)
    y, z = host_decode(sd, trace, tp, lower_bound=None)
    report = fh.compare(trace, sd, y, z, tp, lower_bound=None)
    print(f"Kimi-Linear TP {tp}, hidden {hidden}: {report}")
    assert report["heads"] == 32 and z.shape[1] == hidden
    assert report["inputs"] <= 1, report
    assert report["y"] <= 1 and report["z"] <= 1, report
    assert report["argmax_equal"] and report["ties"] <= fh.DECODE // 4, report
