"""Load a real KDA layer into the engine: one TP rank's weights from fla's
``KimiDeltaAttention`` (flash-linear-attention 0.6.0, ``fla/layers/kda.py``) or its
``state_dict``.

Source: the module, or a ``state_dict`` under fla's key names (``prefix`` + name, e.g.
``"model.layers.3.attn."``); a Kimi-Linear checkpoint names the low-rank factors apart
(``names=KIMI_LINEAR_NAMES``) and stores ``A_log`` as [1, 1, H, 1]. A ``state_dict`` does
not say which gate the layer was trained with nor its norm's eps: pass ``lower_bound`` (the
lower-bound gate, Kimi K3's ``gate_lower_bound``) or ``gate_form="softplus"`` (fla's
``lower_bound=None``: Kimi-Linear, whose config has no ``gate_lower_bound``), and ``eps``; a
module says both (``lower_bound=None`` is its softplus gate).

The runtime loads, for rank r of TP n (heads ``r*H/n .. (r+1)*H/n - 1``, ``D = H/n*128``
channels): the rank's channels of ``{q,k,v}_conv1d.weight`` [H*128, 1, 4] (-> ``conv_weight``
[3, 4, D]) and their biases, the rows of ``f_proj.1.weight`` (-> ``f_b`` [D, 128] bf16),
``dt_bias`` and ``A_log`` (-> fp32), ``o_norm.weight`` (shared by the heads) and the
columns of ``o_proj.weight`` (-> ``w_o`` [HID, D] bf16), plus zeroed state and conv pools.
The layer's other projections stay the engine's GEMMs; ``step_inputs`` cuts the rank's
columns of what it hands to ``DecodeLayer.step``: ``x = [q_proj(h) | k_proj(h) | v_proj(h)]``
(before the conv), ``f_a = f_proj[0](h)``, ``beta = b_proj(h)`` (raw: sigmoid inside) and
``gate = g_proj(h)`` (both Linears, bias included). ``admit_prefill`` hands a request that
fla prefilled over: its recurrent state (fla's layer keeps it V-first, [N, H, 128 value
rows, 128 keys], as the runtime) and the last three inputs of its conv windows.

Refused with ``ValueError`` naming the key (or the module attribute), before anything is
allocated: a missing tensor, a shape or dtype that does not fit (head dim != 128, conv
width != 4, f_b or o_proj not bf16, a hidden size the all-reduce cannot take), heads not
divisible by TP, grouped values (``num_v_heads``), ``allow_neg_eigval``, no short conv, an
output gate other than sigmoid, a gate form or bound that contradicts the module's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kda.layer import Layer, head_columns  # the runtime's layer container (one import)
from kda.validate import CONV_TAPS, GATE_FORMS, GATE_RANK, HEAD_DIM, MAX_TOKENS, check_gate_form
from tpcomm.oproj.plan import check_hidden

from .layer import DecodeLayer, check_state_dtype

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
CONV_KEYS = ("q_conv1d", "k_conv1d", "v_conv1d")
RUNTIME_KEYS = (
    *(f"{c}.weight" for c in CONV_KEYS),
    "f_proj.1.weight",
    "A_log",
    "dt_bias",
    "o_norm.weight",
    "o_proj.weight",
)
ENGINE_KEYS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "f_proj.0.weight",
    "b_proj.weight",
    "g_proj.0.weight",
    "g_proj.1.weight",
    "g_proj.1.bias",
)
KIMI_LINEAR_NAMES = {
    "f_proj.0.weight": "f_a_proj.weight",
    "f_proj.1.weight": "f_b_proj.weight",
    "g_proj.0.weight": "g_a_proj.weight",
    "g_proj.1.weight": "g_b_proj.weight",
    "g_proj.1.bias": "g_b_proj.bias",
}
DEFAULT_WINDOW = MAX_TOKENS + 2  # a verify step of T tokens needs a conv window of T + 2

__all__ = [
    "KIMI_LINEAR_NAMES",
    "RUNTIME_KEYS",
    "ENGINE_KEYS",
    "RankLayer",
    "load_rank",
    "step_inputs",
    "admit_prefill",
]


@dataclass
class RankLayer:
    """Rank ``rank`` of TP ``tp``: heads ``first .. first + shard.heads - 1`` of the source
    layer (``shard``: the weights and pools ``DecodeLayer`` takes), its ``w_o`` columns and
    the step's scalars (``gate_form`` with its ``lower_bound``, None for softplus; the
    norm's ``eps``, ``scale = 128 ** -0.5``)."""

    shard: Layer
    w_o: torch.Tensor
    rank: int
    tp: int
    first: int
    lower_bound: float | None
    eps: float
    scale: float = HEAD_DIM**-0.5
    gate_form: str = "lower-bound"

    def decode_layer(self, comms, *, norm, query, out_norm, **kwargs) -> DecodeLayer:
        """This rank's ``DecodeLayer`` with the layer's scalars (``kwargs``: its options)."""
        return DecodeLayer(
            self.shard,
            self.w_o,
            comms,
            rank=self.rank,
            norm=norm,
            query=query,
            out_norm=out_norm,
            lower_bound=self.lower_bound,
            gate_form=self.gate_form,
            scale=self.scale,
            eps=self.eps,
            **{"state_dtype": self.shard.state.dtype, **kwargs},
        )


def _module_scalars(module, lower_bound, eps, gate_form):
    """The module's gate form, bound and norm eps, after refusing what the kernels do not
    run."""
    refusals = (
        ("use_short_conv", lambda v: v is not True, "the kernels always run the short conv"),
        ("allow_neg_eigval", lambda v: v is not False, "beta = 2 sigmoid(b) is not implemented"),
        ("head_dim", lambda v: v != HEAD_DIM, f"the head dim must be {HEAD_DIM}"),
        ("num_v_heads", lambda v: v != module.num_heads, "grouped values are not implemented"),
        ("conv_size", lambda v: v != CONV_TAPS, f"the conv width must be {CONV_TAPS}"),
    )
    for attr, bad, why in refusals:
        value = getattr(module, attr, None)
        if bad(value):
            raise ValueError(f"{attr} = {value!r}: {why}")
    norm = module.o_norm
    if getattr(norm, "activation", None) != "sigmoid" or getattr(norm, "weight", None) is None:
        raise ValueError("o_norm must be a sigmoid-gated RMSNorm with a weight")
    own = "softplus" if module.lower_bound is None else "lower-bound"
    if gate_form is not None and gate_form != own:
        raise ValueError(
            f"gate_form ({gate_form!r}) differs from the module's ({own!r}: lower_bound = "
            f"{module.lower_bound})"
        )
    if lower_bound is not None and lower_bound != module.lower_bound:
        raise ValueError(
            f"lower_bound ({lower_bound}) differs from the module's ({module.lower_bound})"
        )
    if eps is not None and eps != norm.eps:
        raise ValueError(f"eps ({eps}) differs from the module's o_norm.eps ({norm.eps})")
    bound = None if module.lower_bound is None else float(module.lower_bound)
    return own, bound, float(norm.eps)


def _scalar(name, value, why):
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float ({why}); got {value!r}")
    return float(value)


class _Source:
    """The source's tensors by fla name (``prefix`` + the checkpoint's name)."""

    def __init__(self, state_dict: Mapping, prefix: str, names: Mapping[str, str] | None):
        self.sd, self.prefix, self.names = state_dict, prefix, dict(names or {})

    def key(self, name: str) -> str:
        return self.prefix + self.names.get(name, name)

    def get(self, name, dtypes=FLOATS, optional=False):
        key = self.key(name)
        t = self.sd.get(key)
        if t is None:
            if optional:
                return None
            raise ValueError(f"{key}: missing from the state_dict")
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{key}: dtype must be in ({names}); got {got}")
        return t.detach()

    def shape(self, name, t, want, why=""):
        if tuple(t.shape) != tuple(want):
            raise ValueError(
                f"{self.key(name)}: shape must be {tuple(want)}{why}; got {tuple(t.shape)}"
            )


def _heads(src: _Source, tp: int) -> int:
    """The layer's heads (``A_log``: [H], or Kimi-Linear's [1, 1, H, 1]), checked against TP
    and the head dim that ``dt_bias`` implies."""
    a_log = src.get("A_log")
    if a_log.dim() < 1 or sum(s != 1 for s in a_log.shape) > 1 or a_log.numel() < 1:
        raise ValueError(
            f"{src.key('A_log')}: shape must be [H] (or [1, 1, H, 1]); got {tuple(a_log.shape)}"
        )
    heads = a_log.numel()
    dt_bias = src.get("dt_bias")
    if dt_bias.dim() != 1 or dt_bias.numel() != heads * HEAD_DIM:
        raise ValueError(
            f"{src.key('dt_bias')}: shape must be [{heads} heads x {HEAD_DIM}] "
            f"(head dim {HEAD_DIM}); got {tuple(dt_bias.shape)}"
        )
    if heads % tp:
        raise ValueError(f"{src.key('A_log')}: {heads} heads are not divisible by TP {tp}")
    return heads


def load_rank(
    source,
    *,
    rank: int,
    tp: int,
    pages: int,
    window: int = DEFAULT_WINDOW,
    conv_dtype=torch.bfloat16,
    conv_dim_first: bool = True,
    lower_bound: float | None = None,
    eps: float | None = None,
    gate_form: str | None = None,
    prefix: str = "",
    names: Mapping[str, str] | None = None,
    device=None,
    state_dtype=torch.float32,
) -> RankLayer:
    """Rank ``rank`` of TP ``tp`` of a ``KimiDeltaAttention`` module or ``state_dict``
    (module docstring): contiguous copies of its weights on ``device`` (default: the
    source's) and zeroed pools, ``pages`` state pages [pages, H/tp, 128, 128] in
    ``state_dtype`` (fp32 or bf16; page 0 is the padding page) and conv pages of ``window``
    positions in ``conv_dtype``.
    ``eps`` and the gate (``lower_bound`` for the lower-bound gate, or ``gate_form=
    "softplus"`` with no bound) are required for a ``state_dict``; for a module they must be
    None or its own. ValueError naming the key, before anything is allocated."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int; got {tp!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank must be an int in 0..{tp - 1}; got {rank!r}")
    if isinstance(pages, bool) or not isinstance(pages, int) or pages < 2:
        raise ValueError(f"pages must be an int >= 2 (page 0 pads); got {pages!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 3:
        raise ValueError(f"window must be an int >= 3 (T + 2 for T tokens); got {window!r}")
    if conv_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"conv_dtype must be bfloat16 or float32; got {conv_dtype}")
    check_state_dtype(state_dtype)
    if isinstance(source, torch.nn.Module):
        if names is not None:
            raise ValueError("names: a module has fla's names (names= is for checkpoints)")
        gate_form, lower_bound, eps = _module_scalars(source, lower_bound, eps, gate_form)
        state_dict = source.state_dict()
    elif isinstance(source, Mapping):
        why = "a state_dict does not say"
        gate_form = "lower-bound" if gate_form is None else gate_form
        if gate_form not in GATE_FORMS:
            raise ValueError(f"gate_form must be one of {GATE_FORMS} or None; got {gate_form!r}")
        if gate_form == "lower-bound":
            lower_bound = _scalar(
                "lower_bound",
                lower_bound,
                f"{why} which gate: pass the lower-bound gate's bound, or gate_form='softplus'",
            )
        eps = _scalar("eps", eps, f"{why} the o_norm's eps")
        state_dict = source
    else:
        raise ValueError(
            f"source must be a KimiDeltaAttention or a state_dict; got {type(source).__name__}"
        )
    check_gate_form(gate_form, lower_bound)  # softplus: no bound; the bound <= 0
    src = _Source(state_dict, prefix, names)
    heads = _heads(src, tp)
    dim = heads * HEAD_DIM
    convs = [src.get(f"{c}.weight") for c in CONV_KEYS]
    for c, w in zip(CONV_KEYS, convs, strict=True):
        src.shape(f"{c}.weight", w, (dim, 1, CONV_TAPS), f" (depthwise, width {CONV_TAPS})")
        if w.dtype != convs[0].dtype:
            raise ValueError(
                f"{src.key(c + '.weight')}: dtype {w.dtype} differs from "
                f"{src.key(CONV_KEYS[0] + '.weight')}'s {convs[0].dtype}"
            )
    biases = [src.get(f"{c}.bias", optional=True) for c in CONV_KEYS]
    if any(b is not None for b in biases):
        for c, b in zip(CONV_KEYS, biases, strict=True):
            if b is None:
                raise ValueError(f"{src.key(c + '.bias')}: missing (the other convs have one)")
            src.shape(f"{c}.bias", b, (dim,))
            if b.dtype != biases[0].dtype:
                raise ValueError(
                    f"{src.key(c + '.bias')}: dtype {b.dtype} differs from "
                    f"{src.key(CONV_KEYS[0] + '.bias')}'s"
                )
    f_b = src.get("f_proj.1.weight", (torch.bfloat16,))
    src.shape("f_proj.1.weight", f_b, (dim, GATE_RANK))
    norm_weight = src.get("o_norm.weight")
    src.shape("o_norm.weight", norm_weight, (HEAD_DIM,), " (one gamma shared by the heads)")
    w_o = src.get("o_proj.weight", (torch.bfloat16,))
    if w_o.dim() != 2 or w_o.shape[1] != dim:
        raise ValueError(
            f"{src.key('o_proj.weight')}: shape must be [HID, {dim}]; got {tuple(w_o.shape)}"
        )
    check_hidden(w_o.shape[0], name=src.key("o_proj.weight") + " rows (the hidden size)")

    count = heads // tp
    first = rank * count
    local = count * HEAD_DIM
    device = f_b.device if device is None else torch.device(device)
    cols = head_columns(first, count).to(f_b.device)
    take = lambda t, idx: t.index_select(0, idx.to(t.device)).contiguous().to(device)
    conv_weight = torch.stack([take(w[:, 0, :], cols).T for w in convs]).contiguous()
    conv_bias = None
    if biases[0] is not None:
        conv_bias = torch.cat([take(b, cols) for b in biases])
    heads_r = torch.arange(first, first + count)
    conv_shape = (pages, 3 * local, window) if conv_dim_first else (pages, window, 3 * local)
    shard = Layer(
        conv_weight=conv_weight,
        conv_bias=conv_bias,
        a_log=take(src.get("A_log").reshape(heads), heads_r).float(),
        dt_bias=take(src.get("dt_bias"), cols).float(),
        norm_weight=norm_weight.to(device, copy=True),
        f_b=take(f_b, cols),
        state=torch.zeros(pages, count, HEAD_DIM, HEAD_DIM, dtype=state_dtype, device=device),
        conv_state=torch.zeros(conv_shape, dtype=conv_dtype, device=device),
        conv_dim_first=conv_dim_first,
    )
    w_o_r = w_o.index_select(1, cols.to(w_o.device)).contiguous().to(device)
    return RankLayer(shard, w_o_r, rank, tp, first, lower_bound, eps, gate_form=gate_form)


def _rank_span(heads: int, rank: int, tp: int, name: str):
    if heads % tp or not 0 <= rank < tp:
        raise ValueError(f"{name}: {heads} heads cannot give rank {rank} of TP {tp}")
    count = heads // tp
    return rank * count, count


def step_inputs(q, k, v, f_a, beta, gate, *, rank: int, tp: int):
    """What the engine hands to rank ``rank``'s ``DecodeLayer.step``, from its full-width
    projections of ``rows`` tokens: ``q``, ``k``, ``v`` [rows, H*128] bf16 (before the conv),
    ``f_a`` [rows, 128] bf16, ``beta`` [rows, H] (raw), ``gate`` [rows, H*128] bf16 ->
    ``(x, f_a, beta, gate)`` with ``x = [q | k | v]`` of the rank's heads [rows, 3D]."""
    for name, t in (("q", q), ("k", k), ("v", v), ("gate", gate)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != q.shape:
            raise ValueError(
                f"{name} must be [rows, H*128] like q; got {getattr(t, 'shape', type(t).__name__)}"
            )
    heads = q.shape[1] // HEAD_DIM
    if q.shape[1] != heads * HEAD_DIM or not isinstance(beta, torch.Tensor):
        raise ValueError(f"q must be [rows, H*{HEAD_DIM}]; got {tuple(q.shape)}")
    if tuple(beta.shape) != (q.shape[0], heads):
        raise ValueError(f"beta must be [rows, H] = {(q.shape[0], heads)}; got {tuple(beta.shape)}")
    first, count = _rank_span(heads, rank, tp, "q")
    cols = head_columns(first, count).to(q.device)
    x = torch.cat([t.index_select(1, cols) for t in (q, k, v)], dim=1)
    return (
        x.contiguous(),
        f_a.contiguous(),
        beta[:, first : first + count].contiguous(),
        gate.index_select(1, cols).contiguous(),
    )


def admit_prefill(
    shard: Layer,
    slot: int,
    recurrent_state,
    conv_state,
    *,
    rank: int,
    tp: int,
    index: int = 0,
    state_v_first: bool = True,
) -> None:
    """Hand request ``index`` of an fla prefill over to page ``slot`` of rank ``rank``'s
    ``shard``: ``recurrent_state`` [N, H, 128, 128] fp32 (V-first, [value row, key], as
    fla's layer keeps it; ``state_v_first=False``: [key, value], transposed here) and
    ``conv_state`` = fla's (q, k, v) windows, each [N, H*128, W >= 3] holding the last W
    inputs: their last three become the page's taps (positions 0..2; the rest zeroed).
    ValueError before anything is written."""
    H = recurrent_state.shape[1] if isinstance(recurrent_state, torch.Tensor) else -1
    want = (H, HEAD_DIM, HEAD_DIM)
    if H < 1 or recurrent_state.dim() != 4 or tuple(recurrent_state.shape[1:]) != want:
        got = getattr(recurrent_state, "shape", type(recurrent_state).__name__)
        raise ValueError(f"recurrent_state must be [N, H, 128, 128]; got {got}")
    first, count = _rank_span(H, rank, tp, "recurrent_state")
    if count != shard.heads:
        raise ValueError(
            f"recurrent_state: rank {rank} of TP {tp} has {count} heads; the "
            f"shard has {shard.heads}"
        )
    if not 0 <= index < recurrent_state.shape[0]:
        raise ValueError(f"index must be in 0..{recurrent_state.shape[0] - 1}; got {index}")
    if not isinstance(slot, int) or not 1 <= slot < shard.state.shape[0]:
        raise ValueError(f"slot must be in 1..{shard.state.shape[0] - 1}; got {slot!r}")
    if not isinstance(conv_state, tuple | list) or len(conv_state) != 3:
        raise ValueError("conv_state must be fla's (q, k, v) conv windows")
    for name, c in zip(("q", "k", "v"), conv_state, strict=True):
        if not isinstance(c, torch.Tensor) or c.dim() != 3 or c.shape[1] != H * HEAD_DIM:
            raise ValueError(
                f"conv_state ({name}) must be [N, {H * HEAD_DIM}, W]; got "
                f"{getattr(c, 'shape', type(c).__name__)}"
            )
        if c.shape[2] < 3 or c.shape[0] != recurrent_state.shape[0]:
            raise ValueError(
                f"conv_state ({name}): W >= 3 windows for the N requests; got {tuple(c.shape)}"
            )
    pages = shard.state
    page = recurrent_state[index, first : first + count].to(pages.device, torch.float32)
    pages[slot] = page if state_v_first else page.transpose(-1, -2)
    cols = head_columns(first, count)
    taps = torch.cat([c[index].index_select(0, cols.to(c.device))[:, -3:] for c in conv_state])
    conv = shard.conv_state
    taps = taps.to(conv.device, conv.dtype)  # [3D, 3]
    conv[slot].zero_()
    if shard.conv_dim_first:
        conv[slot, :, :3] = taps
    else:
        conv[slot, :3, :] = taps.T
