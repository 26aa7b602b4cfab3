"""fla (flash-linear-attention 0.6.0) as the oracle of a loaded layer: shared by
``test_engine_load.py`` (CPU: fla's naive functions) and ``test_engine_load_gpu.py`` (GPU:
fla's ``KimiDeltaAttention`` itself).

A run: random weights under fla's key names (``state_dict``), a 64-token prompt that fla
prefills, then 16 decode tokens through fla and through the runtime (``engine.load``),
for the lower-bound gate (hidden 2048, 16 heads) or the softplus gate of a Kimi-Linear-shaped
layer (``lower_bound`` None; 32 heads, ``KIMI_LINEAR_HIDDEN``; loaded under Kimi-Linear's
names, ``kimi_linear_names``),
which starts from fla's prefill state and conv windows. ``Trace`` holds what fla computed at
each decode token; ``check`` compares the runtime's outputs with it within ``y_bound`` (the
layer output before ``o_proj``) and ``z_bound`` (after it), and the greedy argmax of a random
4096-word head on them token by token wherever fla's top-1 margin decides it (a near-tie
within ``TIE_SIGMAS`` of what the two outputs' difference can move is counted, not checked;
at most a quarter of the tokens may be ties).

fla is loaded by path where its package imports need more than this machine has: the naive
KDA functions from ``fla/ops/kda/naive.py`` (torch and einops only), the lower-bound gate's
naive function taken out of ``fla/ops/kda/gate.py`` (which imports triton) by its source, and
``KimiDeltaAttention`` without ``fla.layers``' package ``__init__`` (which imports
transformers for other layers).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from launch.checks import attn_drift, bf16_ulp
from tpcomm.oproj import reference as oref

HIDDEN, HEADS, K = 2048, 16, 128
KIMI_LINEAR_HEADS = 32


def _kimi_linear_hidden() -> int:
    """Kimi-Linear's hidden width, 2304 (9 x 256), where the o-projection takes it; 2048
    until then (a multiple of 1024: the widths it takes today)."""
    from tpcomm.oproj.plan import check_hidden

    try:
        check_hidden(2304)
    except ValueError:
        return 2048
    return 2304


KIMI_LINEAR_HIDDEN = _kimi_linear_hidden()
PROMPT, DECODE = 64, 16
LOWER_BOUND, NORM_EPS = -5.0, 1e-5
VOCAB = 4096
# A greedy token is a tie, not decided by the check, where fla's top-1 margin lies within
# TIE_SIGMAS standard deviations of the gap error the two paths' z difference gives the
# random head: its rows are independent of the layer, so a gap's error W_a . dz - W_b . dz
# is N(0, 2 |dz|^2) (at TP > 1 the partials' roundings alone put dz near 1 bf16 ulp in about
# 40% of the elements: near-ties do come up, at any seed).
TIE_SIGMAS = 6
U = 2.0**-24  # fp32 unit roundoff
BF16_U = 2.0**-8  # bf16 unit roundoff: |round(x) - x| <= 2^-8 |x|
# one recurrence step's fp32 error per unit of |S_r| + |v| + |v_new|: a K-term dot in any
# order, and 64u for the step's other roundings and Triton's approximate exp / sigmoid /
# sqrt (the decay lands within about 20u: sigmoid(x)(1 - sigmoid(x)) |x| <= 0.23)
STEP_FP32 = (K + 64) * U
# The softplus gate's decay in fla's Triton kernels: log(1 + exp(x)) with ex2 / lg2.approx
# (absolute error below 2^-22 of the log, plus the 2^-24 rounding of 1 + exp(x)), times
# exp(A_log): the decay moves by at most exp(A_log) * 2^-21 (first order, decay <= 1).
# fla's naive gate (CPU) evaluates softplus in fp32 to a few ulps: inside STEP_FP32.
TRITON_SOFTPLUS = 2.0**-21
SECOND_ORDER = 1 + 2.0**-5  # the bounds below are first order in the perturbations


def fla_dir() -> Path | None:
    """The installed ``fla`` package's first directory (None without fla-core), not imported."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def fla_file(relative: str) -> Path:
    """``fla/<relative>`` in whichever of fla's directories holds it (fla-core and
    flash-linear-attention may be installed apart)."""
    if "fla" in sys.modules:  # fla's __init__ extends its path over both installs
        locations = list(sys.modules["fla"].__path__)
    else:
        spec = importlib.util.find_spec("fla")
        locations = list(spec.submodule_search_locations or ()) if spec else []
    for location in locations:
        if (Path(location) / relative).is_file():
            return Path(location) / relative
    raise ImportError(f"fla/{relative} is not installed")


def _load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def naive():
    """fla's ``naive_recurrent_kda`` / ``naive_chunk_kda`` module, loaded by path."""
    return _load_file("fla_kda_naive", fla_file("ops/kda/naive.py"))


def gate_function(name="naive_kda_lowerbound_gate"):
    """A naive gate function of fla's ``fla/ops/kda/gate.py`` (``naive_kda_lowerbound_gate``,
    ``naive_kda_gate``: the softplus gate), compiled from its source alone: the file imports
    triton, the functions only torch."""
    path = fla_file("ops/kda/gate.py")
    tree = ast.parse(path.read_text())
    fn = [n for n in tree.body if getattr(n, "name", "") == name]
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=fn, type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def lower_bound_gate():
    """fla's ``naive_kda_lowerbound_gate``."""
    return gate_function("naive_kda_lowerbound_gate")


def softplus_gate():
    """fla's ``naive_kda_gate``: ``-exp(A_log) * softplus(g + dt_bias)`` (fp32)."""
    return gate_function("naive_kda_gate")


def kda_layer_class():
    """fla's ``KimiDeltaAttention``: imported, or loaded by path with a bare ``fla.layers``
    package when its ``__init__`` needs transformers."""
    try:
        from fla.layers.kda import KimiDeltaAttention
    except ImportError:
        path = fla_file("layers/kda.py")
        package = types.ModuleType("fla.layers")
        package.__path__ = [str(path.parent)]
        sys.modules["fla.layers"] = package
        module = _load_file("fla.layers.kda", path)
        sys.modules["fla.layers.kda"] = module
        KimiDeltaAttention = module.KimiDeltaAttention
    return KimiDeltaAttention


class Cache:
    """The part of fla's ``Cache`` its layers use (``len``, ``[layer_idx]``, ``update``),
    without transformers."""

    def __init__(self):
        self.layers: list[dict] = []

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, index):
        return self.layers[index]

    def update(self, layer_idx=0, recurrent_state=None, conv_state=None, offset=1, **_):
        while len(self.layers) <= layer_idx:
            self.layers.append({"recurrent_state": None, "conv_state": None})
        state = self.layers[layer_idx]
        if recurrent_state is not None:
            state["recurrent_state"] = recurrent_state
        if conv_state is not None:
            state["conv_state"] = conv_state
        return state


def state_dict(seed=0, hidden=HIDDEN, heads=HEADS, conv_bias=True, softplus=False) -> dict:
    """Random weights of a ``KimiDeltaAttention`` under its key names: bf16 as a served
    model, ``A_log`` and ``dt_bias`` fp32 (as Kimi checkpoints keep them); Linear weights at
    nn.Linear's scale, ``dt_bias`` ~ N(0, 1) and ``A_log`` = log U(1, 16) so the decays span
    (e^-5, 1) rather than fla's initial ~1. ``softplus``: the softplus gate's layer, whose
    ``dt_bias`` is fla's initial one (softplus^-1 of dt = log U(1e-3, 0.1)), so that its
    decays ``exp(-exp(A_log) softplus(g + dt_bias))`` mostly keep the state."""
    g = torch.Generator().manual_seed(seed)
    D = heads * K

    def lin(out, inp):
        return ((torch.rand(out, inp, generator=g) * 2 - 1) / math.sqrt(inp)).bfloat16()

    sd = {"q_proj.weight": lin(D, hidden), "k_proj.weight": lin(D, hidden)}
    sd["v_proj.weight"] = lin(D, hidden)
    for c in ("q_conv1d", "k_conv1d", "v_conv1d"):
        sd[f"{c}.weight"] = lin(D, 4).view(D, 1, 4)
        if conv_bias:
            sd[f"{c}.bias"] = (torch.randn(D, generator=g) * 0.1).bfloat16()
    sd["f_proj.0.weight"], sd["f_proj.1.weight"] = lin(K, hidden), lin(D, K)
    sd["b_proj.weight"] = lin(heads, hidden)
    sd["A_log"] = torch.log(torch.rand(heads, generator=g) * 15 + 1)
    sd["dt_bias"] = torch.randn(D, generator=g)
    if softplus:
        dt = torch.exp(torch.rand(D, generator=g) * math.log(100.0) + math.log(1e-3))
        sd["dt_bias"] = dt + torch.log(-torch.expm1(-dt))
    sd["g_proj.0.weight"], sd["g_proj.1.weight"] = lin(K, hidden), lin(D, K)
    sd["g_proj.1.bias"] = (torch.randn(D, generator=g) * 0.1).bfloat16()
    sd["o_norm.weight"] = (1 + 0.1 * torch.randn(K, generator=g)).bfloat16()
    sd["o_proj.weight"] = lin(hidden, D)
    return sd


def kimi_linear_names(sd, prefix="model.layers.0.self_attn.") -> dict:
    """``sd`` (fla's names) as a Kimi-Linear checkpoint names it: ``engine.KIMI_LINEAR_NAMES``
    under a model prefix, ``A_log`` as [1, 1, H, 1]."""
    from engine import KIMI_LINEAR_NAMES

    renamed = {prefix + KIMI_LINEAR_NAMES.get(n, n): t for n, t in sd.items()}
    renamed[prefix + "A_log"] = sd["A_log"].reshape(1, 1, -1, 1)
    return renamed


def hidden_states(seed=1, tokens=PROMPT + DECODE, hidden=HIDDEN) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).bfloat16()


def lm_head(seed=2, hidden=HIDDEN) -> torch.Tensor:
    """A random 4096-word output head [VOCAB, HID] (fp32)."""
    return torch.randn(VOCAB, hidden, generator=torch.Generator().manual_seed(seed))


@dataclass
class Trace:
    """What fla computed: its prefill's hand-off (``recurrent_state`` [1, H, 128, 128] fp32,
    V-first when ``v_first``; ``windows`` = its (q, k, v) conv caches [1, D, 4]) and, per
    decode token (rows), the projections the engine computes too (``q``, ``k``, ``v`` before
    the conv, ``f_a``, ``beta``, ``gate``), fla's own recurrence inputs (``raw_g`` =
    ``f_proj(h)``; ``qc``, ``kc``, ``vc`` after conv + SiLU), its output before ``o_proj``
    (``y`` [N, D]) and after (``z`` [N, HID]); all bf16."""

    recurrent_state: torch.Tensor
    v_first: bool
    windows: tuple
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    f_a: torch.Tensor
    beta: torch.Tensor
    gate: torch.Tensor
    raw_g: torch.Tensor
    qc: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor
    y: torch.Tensor
    z: torch.Tensor

    def cpu(self) -> Trace:
        moved = {n: getattr(self, n) for n in self.__dataclass_fields__}
        for n, t in moved.items():
            if isinstance(t, torch.Tensor):
                moved[n] = t.detach().cpu()
        moved["windows"] = tuple(w.detach().cpu() for w in self.windows)
        return Trace(**moved)


def _l2(t):
    """fla's in-kernel q / k normalisation ``t / sqrt(sum t^2 + 1e-6)`` per head (fp32)."""
    t = t.float()
    return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)


def cpu_fla(sd, hs, *, lower_bound=LOWER_BOUND, eps=NORM_EPS) -> Trace:
    """fla's layer on the CPU, where it has no kernels: its naive functions
    (``naive_chunk_kda`` for the prompt, ``naive_recurrent_kda`` token by token with its
    state, ``naive_kda_lowerbound_gate``) and its kernels' rounding points written out
    (bf16 Linears; conv: fp32 products summed, bias, SiLU, one bf16 rounding; the chunk
    path's q, k normalised to bf16, the recurrent path's in fp32; o rounded to bf16; the
    sigmoid-gated RMSNorm in fp32, rounded to bf16). ``lower_bound`` None: the softplus gate
    (``naive_kda_gate``)."""
    nv = naive()
    if lower_bound is None:
        softplus = softplus_gate()
        gate_fn = lambda g, a_log, dt_bias, _: softplus(g, a_log, dt_bias)  # noqa: E731
    else:
        gate_fn = lower_bound_gate()
    H = sd["A_log"].numel()
    D, P = H * K, hs.shape[0] - DECODE
    scale = K**-0.5
    with torch.no_grad():
        q, k, v = (F.linear(hs, sd[f"{p}_proj.weight"]) for p in "qkv")
        f_a = F.linear(hs, sd["f_proj.0.weight"])
        raw_g = F.linear(f_a, sd["f_proj.1.weight"])
        beta = F.linear(hs, sd["b_proj.weight"])
        gate = F.linear(
            F.linear(hs, sd["g_proj.0.weight"]), sd["g_proj.1.weight"], sd["g_proj.1.bias"]
        )
        weights = [sd[f"{p}_conv1d.weight"][:, 0].float() for p in "qkv"]  # [D, 4]
        biases = [sd.get(f"{p}_conv1d.bias") for p in "qkv"]
        biases = [torch.zeros(D) if b is None else b.float() for b in biases]

        def conv(window, p):  # window [..., D, 4] -> bf16 [..., D]
            return F.silu((window.float() * weights[p]).sum(-1) + biases[p]).bfloat16()

        padded = [torch.cat([torch.zeros(3, D, dtype=x.dtype), x[:P]]) for x in (q, k, v)]
        prompt = [conv(x.unfold(0, 4, 1), p) for p, x in enumerate(padded)]  # [P, D]
        heads = lambda t: t.reshape(1, -1, H, K)
        g = gate_fn(heads(raw_g[:P]), sd["A_log"], sd["dt_bias"], lower_bound)
        b = torch.sigmoid(beta[:P].float()).view(1, P, H)
        qn, kn = (_l2(heads(t)).bfloat16() for t in prompt[:2])
        _, S = nv.naive_chunk_kda(qn, kn, heads(prompt[2]), g, b, scale, None, True)
        windows = tuple(x[P - 4 : P].T.contiguous()[None] for x in (q, k, v))  # [1, D, 4]
        handoff = (S.clone(), windows)
        caches = [w[0].clone() for w in windows]
        rec = {n: [] for n in ("qc", "kc", "vc", "y", "z")}
        for t in range(P, P + DECODE):
            outs = []
            for p, x in enumerate((q, k, v)):
                caches[p] = torch.cat([caches[p][:, 1:], x[t][:, None]], dim=1)
                outs.append(conv(caches[p], p))
            g = gate_fn(heads(raw_g[t : t + 1]), sd["A_log"], sd["dt_bias"], lower_bound)
            b = torch.sigmoid(beta[t : t + 1].float()).view(1, 1, H)
            qn, kn = (_l2(heads(o)) for o in outs[:2])
            o, S = nv.naive_recurrent_kda(qn, kn, heads(outs[2]), g, b, scale, S, True)
            of = o.float().view(H, K)
            gt = torch.sigmoid(gate[t].float().view(H, K))
            rstd = torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
            y = (of * rstd * sd["o_norm.weight"].float() * gt).bfloat16().view(1, D)
            for name, val in zip(("qc", "kc", "vc"), outs, strict=True):
                rec[name].append(val[None])
            rec["y"].append(y)
            rec["z"].append(F.linear(y, sd["o_proj.weight"]))
    rows = slice(P, P + DECODE)
    cat = {n: torch.cat(vals) for n, vals in rec.items()}
    return Trace(
        handoff[0],
        False,
        handoff[1],
        q[rows],
        k[rows],
        v[rows],
        f_a[rows],
        beta[rows],
        gate[rows],
        raw_g[rows],
        **cat,
    )


# fla's layer on a GPU: its module and Triton kernels ---------------------------------------
RECORDED = {  # trace field -> (submodule, output index or None)
    "q": ("q_proj", None),
    "k": ("k_proj", None),
    "v": ("v_proj", None),
    "f_a": ("f_proj.0", None),
    "raw_g": ("f_proj", None),
    "beta": ("b_proj", None),
    "gate": ("g_proj", None),
    "qc": ("q_conv1d", 0),
    "kc": ("k_conv1d", 0),
    "vc": ("v_conv1d", 0),
    "y": ("o_norm", None),
    "z": ("o_proj", None),
}


def gpu_fla(sd, hs, *, lower_bound=LOWER_BOUND, eps=NORM_EPS, device="cuda"):
    """fla's own ``KimiDeltaAttention`` (its Triton kernels) on ``device`` with the weights
    ``sd`` (``A_log`` / ``dt_bias`` kept fp32, as Kimi checkpoints keep them): it prefills
    the prompt ``hs[:-DECODE]`` in chunk mode (fla picks chunk mode for 64 tokens only with
    autograd on) and decodes the last ``DECODE`` tokens on its recurrent path with its
    cache, forward hooks recording ``RECORDED``. cuBLAS's reduced-precision (bf16) split-K
    reduction is off meanwhile, so ``f_proj`` and ``o_proj`` round once, as the bounds
    assume. Returns (the module, its ``Trace``). ImportError where fla's layer does not
    import (triton, einops)."""
    dev = torch.device(device)
    sd = {n: t.to(dev) for n, t in sd.items()}
    heads, hidden = sd["A_log"].numel(), sd["o_proj.weight"].shape[0]
    layer = kda_layer_class()(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=K,
        mode="chunk",
        lower_bound=lower_bound,
        conv_bias="q_conv1d.bias" in sd,
        layer_idx=0,
        norm_eps=eps,
    )
    assert set(layer.state_dict()) == set(sd), "the harness's names must be fla's"
    layer = layer.to(dev, torch.bfloat16)
    for name in ("A_log", "dt_bias"):
        setattr(layer, name, torch.nn.Parameter(sd[name].clone(), requires_grad=False))
    layer.load_state_dict(sd)
    layer.requires_grad_(False).eval()
    hs = hs.to(dev)[None]  # [1, tokens, HID]
    prompt = hs.shape[1] - DECODE
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        cache = Cache()
        with torch.enable_grad():  # chunk mode for the prompt
            layer(hs[:, :prompt], past_key_values=cache, use_cache=True)
        state = cache[0]["recurrent_state"].detach().clone()
        windows = tuple(w.detach().clone() for w in cache[0]["conv_state"])
        rec = {name: [] for name in RECORDED}
        hooks = []
        for name, (path, index) in RECORDED.items():

            def hook(module, args, out, name=name, index=index):
                t = out if index is None else out[index]
                rec[name].append(t.detach().reshape(1, -1).clone())

            hooks.append(layer.get_submodule(path).register_forward_hook(hook))
        with torch.no_grad():
            for t in range(prompt, hs.shape[1]):
                layer(hs[:, t : t + 1], past_key_values=cache, use_cache=True)
        for h in hooks:
            h.remove()
    finally:
        flags.allow_bf16_reduced_precision_reduction = saved
    torch.cuda.synchronize(dev)
    fields = {name: torch.cat(vals) for name, vals in rec.items()}
    return layer, Trace(recurrent_state=state, v_first=True, windows=windows, **fields)


# --- the runtime's side --------------------------------------------------------------------


def spec_conv(window, weight, bias):
    """The runtime's conv + SiLU (SPEC step 2, bit for bit ``kda.reference``'s and the
    kernels'): ``window`` [N, 4, C] (three taps, then the token), ``weight`` [4, C], ``bias``
    [C] or None -> bf16 [N, C]. ``acc = bias; acc = fma(w[i], coeff[i], acc)`` in fp32, then
    ``acc / (1 + exp(-acc))`` with exp evaluated in float64 and rounded to fp32."""
    acc = torch.zeros(window.shape[0], window.shape[2])
    if bias is not None:
        acc = acc + bias.float()
    for i in range(4):
        acc = (window[:, i].double() * weight[i].double() + acc.double()).float()
    return (acc / (1.0 + torch.exp(-acc.double()).float())).bfloat16()


def spec_raw_gate(f_a, f_b):
    """The runtime's raw gate ``bf16(f_a . f_b)``, the fp32 rounding of the exact dot."""
    return (f_a.double() @ f_b.double().T).float().bfloat16()


def our_inputs(trace: Trace, sd):
    """The runtime's recurrence inputs for fla's decode tokens: (qc, kc, vc, raw_g), from
    the conv windows handed over (fla's last three inputs) and the trace's projections."""
    outs = []
    for p, x in enumerate((trace.q, trace.k, trace.v)):
        name = "qkv"[p] + "_conv1d"
        seq = torch.cat([trace.windows[p][0, :, 1:].T, x])  # [3 + N, D]
        bias = sd.get(f"{name}.bias")
        outs.append(
            spec_conv(
                seq.unfold(0, 4, 1).transpose(1, 2),
                sd[f"{name}.weight"][:, 0].T,
                None if bias is None else bias,
            )
        )
    return (*outs, spec_raw_gate(trace.f_a, sd["f_proj.1.weight"]))


def exact_o(state, qc, kc, vc, raw_g, beta, sd, lower_bound, softplus_error=0.0):
    """The recurrence in float64 from ``state`` [H, 128 value rows, 128 keys] on given
    (bf16) inputs [N, D]: ``o`` [N, H, 128] before its bf16 rounding, and ``err`` [N, H, 128],
    the most an fp32 evaluation of it in any order can be off: ``STEP_FP32`` times
    ``sum_k |S[r, k] q^[k]|`` plus ``scale`` times the sum over the steps so far of
    ``|S_r| + |v_r| + |v_new_r|`` (each step's roundings; a step maps a state row by
    ``diag(decay) (I - beta k^ k^T)``, of norm <= 1, so earlier errors do not grow).
    ``lower_bound`` None: the softplus gate; ``softplus_error``: its decay's error beyond
    the fp32 roundings per unit of ``exp(A_log)`` (``TRITON_SOFTPLUS``), which adds
    ``softplus_error exp(A_log) |S_r|`` per step."""
    H = state.shape[0]
    view = lambda t: t.double().view(-1, H, K)
    q, k, v, raw = view(qc), view(kc), view(vc), view(raw_g)
    a = torch.exp(sd["A_log"].double().reshape(H, 1))
    dt = sd["dt_bias"].double().view(H, K)
    b = torch.sigmoid(beta.double().view(-1, H))
    scale = K**-0.5
    S = state.double().clone()
    carried = torch.zeros(H, K, dtype=torch.float64)
    o, err = torch.zeros_like(q), torch.zeros_like(q)
    for t in range(q.shape[0]):
        if lower_bound is None:  # torch's softplus: beta 1, x above 20
            decay = torch.exp(-a * F.softplus(raw[t] + dt))
            carried += S.norm(dim=-1) * a * (softplus_error / STEP_FP32)
        else:
            decay = torch.exp(lower_bound * torch.sigmoid(a * (raw[t] + dt)))
        kh = k[t] / torch.sqrt((k[t] ** 2).sum(-1, keepdim=True) + 1e-6)
        qh = q[t] / torch.sqrt((q[t] ** 2).sum(-1, keepdim=True) + 1e-6) * scale
        carried += S.norm(dim=-1)
        S = S * decay[:, None, :]
        v_new = (v[t] - (S @ kh[..., None])[..., 0]) * b[t][:, None]
        S = S + v_new[..., None] * kh[:, None, :]
        carried += S.norm(dim=-1) + v[t].abs() + v_new.abs()
        o[t] = (S @ qh[..., None])[..., 0]
        o_abs = (S.abs() @ qh.abs()[..., None])[..., 0]
        err[t] = STEP_FP32 * (o_abs + scale * carried)
    return o, err


def y_bound(o_f, o_o, err, y_f, y_o, gate, norm_weight, eps):
    """How far the runtime's layer output before ``o_proj`` may lie from fla's, per element
    [N, D], from the two paths' rounding points.

    Both round the recurrence output ``o`` to bf16 (fla: ``fused_recurrent_kda``'s output;
    ours: SPEC step 6), then ``y = o * rho * w * sigmoid(gate)``, ``rho = (mean o^2 +
    eps)^-1/2`` in fp32, rounded to bf16 (fla: ``FusedRMSNormGated``; ours: step 8). Before
    that the exact ``o`` of each path differs by ``|o_f - o_o|``: fla rounds its recurrence
    inputs at other places than ours (its conv sums the four products then adds the bias,
    ours is an fma chain from the bias; its raw gate is the cuBLAS ``f_proj`` GEMM, ours the
    exactly rounded dot), so a q, k, v or raw gate value lying at a bf16 midpoint may round
    to the neighbour; ``exact_o`` carries each path's own inputs through the recurrence in
    float64. ``err``: both paths' fp32 evaluation (``exact_o``). Terms: ``o``'s two
    roundings (2^-8 of it each) and that difference, through the norm's factor ``w sigmoid
    (gate) rho`` and through ``rho`` (``|d rho| <= rho^3 |o| |d o| / 128``); the norm's fp32
    arithmetic, (128 + 64) u of ``y`` per path; the two bf16 roundings of ``y``, half an ulp
    each."""
    H = o_f.shape[1]
    om = torch.maximum(o_f.abs(), o_o.abs())
    E = (o_f - o_o).abs() + err
    c = norm_weight.double().abs() * torch.sigmoid(gate.double().view(-1, H, K))
    rho = torch.maximum(*((o.pow(2).mean(-1, keepdim=True) + eps).rsqrt() for o in (o_f, o_o)))
    d_o = 2 * BF16_U * (om + E) + E  # the two roundings of o and the exact difference
    direct = c * rho * d_o
    through_rho = c * om * rho**3 * om.norm(dim=-1, keepdim=True) * d_o.norm(dim=-1, keepdim=True)
    arithmetic = 2 * STEP_FP32 * c * rho * om
    ulp = bf16_ulp(torch.maximum(y_f.float().abs(), y_o.float().abs())).double()
    bound = (direct + through_rho / K + arithmetic) * SECOND_ORDER
    return bound.reshape(y_f.shape) + ulp


def z_bound(y_f, y_o, z_f, z_o, w_o, tp):
    """How far the runtime's ``o_proj`` output may lie from fla's, per element [N, HID].

    fla: one cuBLAS GEMM, ``bf16(sum_c y_c W[n, c])`` (fp32 accumulation). Ours (SPEC
    o-projection): each rank's ``partial_r = bf16(y_r @ W_r^T)``, summed in rank order in
    fp32 and rounded to bf16 (TP 1: the partial is the result). Terms: what the difference
    of the two ``y`` moves in exact arithmetic (``launch.checks.attn_drift``); each path's
    fp32 accumulation of D products in any order, ``2 D u sum_c |y_c W[n, c]|`` (2u: tensor
    cores may truncate their adds); at TP > 1 the partials' roundings (2^-8 of each) and
    their fp32 sum ((TP - 1) u); the two final bf16 roundings, half an ulp each."""
    D = w_o.shape[1]
    W = w_o.double().abs()
    drift = attn_drift(y_f.float(), y_o.float(), w_o.float())
    size = torch.maximum(y_f.double().abs(), y_o.double().abs()) @ W.T
    bound = drift + 2 * (2 * D * U) * size
    if tp > 1:
        per = D // tp
        p = torch.stack(
            [
                oref.project(
                    y_o[:, r * per : (r + 1) * per].contiguous(),
                    w_o[:, r * per : (r + 1) * per].contiguous(),
                )
                for r in range(tp)
            ]
        ).double()
        ulp = bf16_ulp(p.float()).double()
        bound = bound + (BF16_U * (p.abs() + ulp)).sum(0) + (tp - 1) * U * p.abs().sum(0)
    half_ulps = 0.5 * (bf16_ulp(z_f.float()) + bf16_ulp(z_o.float())).double()
    return bound * SECOND_ORDER + half_ulps


def _adjacent(a, b, slack):
    """Whether bf16 values ``a``, ``b`` are one rounding apart of reals within ``slack``:
    |a - b| <= ulp(max) + slack. Returns the worst ratio."""
    ulp = bf16_ulp(torch.maximum(a.float().abs(), b.float().abs())).double()
    return float(((a.double() - b.double()).abs() / (ulp + slack)).max())


def compare(
    trace: Trace, sd, y_ours, z_ours, tp, *, lower_bound=LOWER_BOUND, eps=NORM_EPS, triton=False
):
    """The runtime's outputs (``y_ours`` [N, D] before ``o_proj``, every rank's columns;
    ``z_ours`` [N, HID] after) against fla's ``trace`` (CPU tensors): a dict of worst
    error / bound ratios (``inputs``: fla's recurrence inputs against ours, each a bf16
    rounding of nearly the same fp32 value; ``y``, ``z``), the fraction of ``y`` / ``z``
    bitwise fla's, the number of recurrence inputs rounded apart (``flips``) and the greedy
    argmax of ``lm_head`` on ``z``: ``argmax_equal`` on every token the margin decides
    (``TIE_SIGMAS``), ``ties`` the tokens it does not, ``argmax_all`` whether every token's
    argmax is equal anyway, ``margin`` fla's smallest top-1 gap.
    ``lower_bound`` None: the softplus gate; ``triton``: ``trace`` from fla's kernels (their
    approximate softplus, ``TRITON_SOFTPLUS``), else from its naive functions."""
    sd = {n: t.detach().cpu() for n, t in sd.items()}
    H = sd["A_log"].numel()
    ours = our_inputs(trace, sd)
    theirs = (trace.qc, trace.kc, trace.vc, trace.raw_g)
    flips, worst = 0, 0.0
    for p, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if p < 3:  # conv: 4 products and a bias in fp32, SiLU's slope <= 1.1
            w = sd["qkv"[p] + "_conv1d.weight"][:, 0].double().abs()
            x = (trace.q, trace.k, trace.v)[p].double().abs()
            taps = trace.windows[p][0, :, 1:].T.double().abs()
            seq = torch.cat([taps, x]).unfold(0, 4, 1)  # [N, D, 4]
            slack = 2 * 1.1 * 8 * U * ((seq * w).sum(-1) + 1.0)
        else:  # a 128-term fp32 dot in any order (2u per add)
            slack = 2 * K * U * (trace.f_a.double().abs() @ sd["f_proj.1.weight"].double().abs().T)
        flips += int((a != b).sum())
        worst = max(worst, _adjacent(a, b, slack))
    S0 = trace.recurrent_state[0]
    S0 = S0 if trace.v_first else S0.transpose(-1, -2)
    softplus_error = TRITON_SOFTPLUS if triton else 0.0  # fla's kernels: approximate softplus
    o_f, err_f = exact_o(S0, *theirs, trace.beta, sd, lower_bound, softplus_error)
    o_o, err_o = exact_o(S0, *ours, trace.beta, sd, lower_bound)
    yb = y_bound(o_f, o_o, err_f + err_o, trace.y, y_ours, trace.gate, sd["o_norm.weight"], eps)
    y_ratio = (trace.y.double() - y_ours.double()).abs() / yb
    zb = z_bound(trace.y, y_ours, trace.z, z_ours, sd["o_proj.weight"], tp)
    z_ratio = (trace.z.double() - z_ours.double()).abs() / zb
    head = lm_head(hidden=trace.z.shape[1]).double()
    logits_f, logits_o = trace.z.double() @ head.T, z_ours.double() @ head.T
    top = logits_f.topk(2, dim=-1).values
    margins = top[:, 0] - top[:, 1]
    dz = (trace.z.double() - z_ours.double()).norm(dim=-1)
    decided = margins > TIE_SIGMAS * math.sqrt(2) * dz
    same = logits_f.argmax(-1) == logits_o.argmax(-1)
    return dict(
        inputs=worst,
        flips=flips,
        y=float(y_ratio.max()),
        z=float(z_ratio.max()),
        y_exact=float((trace.y == y_ours).float().mean()),
        z_exact=float((trace.z == z_ours).float().mean()),
        argmax_equal=bool(same[decided].all()),
        ties=int((~decided).sum()),
        argmax_all=bool(same.all()),
        margin=float(margins.min()),
        heads=H,
    )
