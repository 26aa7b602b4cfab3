"""A KDA layer's weights and pools (``Layer``), one step's activations (``Step``), and
their head shards: what an engine holds for a layer and hands to ``engine.DecodeLayer``.

``Layer``: the conv, gate and norm weights of the layer's heads (or one TP rank's heads)
and its state and conv pools; ``Step``: the activations an engine computes before the KDA
step (``x`` = [q | k | v] projections, ``f_a``, ``beta``, the output gate) and the slot
tables. ``shard_layer`` / ``shard_step`` take heads ``first .. first+count-1``
(``head_columns``: their channels). Defaults of the Kimi layer: ``LOWER_BOUND``,
``SCALE``, ``EPS``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .operands import DecodeOperands
from .validate import HEAD_DIM

LOWER_BOUND = -5.0
SCALE = HEAD_DIM**-0.5
EPS = 1e-6


@dataclass
class Layer:
    conv_weight: torch.Tensor  # [3, 4, D]
    conv_bias: torch.Tensor | None  # [3D]
    a_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [D] fp32
    norm_weight: torch.Tensor  # [128]
    f_b: torch.Tensor  # [D, 128] bf16
    state: torch.Tensor  # [S, H, 128, 128] fp32
    conv_state: torch.Tensor  # [S, 3D, W] or [S, W, 3D]
    conv_dim_first: bool = True

    @property
    def heads(self) -> int:
        return self.state.shape[1]

    def to(self, device) -> Layer:
        def mv(t):
            return None if t is None else t.to(device)

        names = ("conv_weight", "conv_bias", "a_log", "dt_bias", "norm_weight", "f_b")
        return Layer(
            *(mv(getattr(self, n)) for n in names),
            state=self.state.to(device),
            conv_state=self.conv_state.to(device),
            conv_dim_first=self.conv_dim_first,
        )

    def clone(self) -> Layer:
        return Layer(
            self.conv_weight,
            self.conv_bias,
            self.a_log,
            self.dt_bias,
            self.norm_weight,
            self.f_b,
            self.state.clone(),
            self.conv_state.clone(),
            self.conv_dim_first,
        )


@dataclass
class Step:
    x: torch.Tensor  # [B*T, 3D] bf16
    f_a: torch.Tensor  # [B*T, 128] bf16
    beta: torch.Tensor  # [B*T, H]
    gate: torch.Tensor  # [B*T, D] bf16
    slots: torch.Tensor  # [B] or [B, T] int32
    accepted: torch.Tensor | None = None  # [B] int32 (T > 1)
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.x.shape[0] // self.slots.shape[0]


def step_to(step: Step, device) -> Step:
    return Step(
        x=step.x.to(device),
        f_a=step.f_a.to(device),
        beta=step.beta.to(device),
        gate=step.gate.to(device),
        slots=step.slots.to(device),
        accepted=None if step.accepted is None else step.accepted.to(device),
        extra=step.extra,
    )


def head_columns(first, count):
    """Channel indices of heads ``first .. first+count-1`` within a [*, H*128] tensor."""
    return torch.arange(first * HEAD_DIM, (first + count) * HEAD_DIM)


def shard_layer(layer: Layer, first, count, pool_state=None, pool_conv=None) -> Layer:
    """The weights of heads ``first .. first+count-1`` (contiguous copies) and their pools."""
    H = layer.heads
    cols = head_columns(first, count)
    part_cols = torch.cat([p * H * HEAD_DIM + cols for p in range(3)])
    conv = layer.conv_state
    conv_shard = conv[:, part_cols, :] if layer.conv_dim_first else conv[:, :, part_cols]
    return Layer(
        conv_weight=layer.conv_weight[:, :, cols].contiguous(),
        conv_bias=None if layer.conv_bias is None else layer.conv_bias[part_cols].contiguous(),
        a_log=layer.a_log[first : first + count].contiguous(),
        dt_bias=layer.dt_bias[cols].contiguous(),
        norm_weight=layer.norm_weight,
        f_b=layer.f_b[cols].contiguous(),
        state=layer.state[:, first : first + count].contiguous()
        if pool_state is None
        else pool_state,
        conv_state=conv_shard.contiguous() if pool_conv is None else pool_conv,
        conv_dim_first=layer.conv_dim_first,
    )


def shard_step(step: Step, heads_total, first, count) -> Step:
    """The activations of heads ``first .. first+count-1``; slot tables are shared."""
    H = heads_total
    cols = head_columns(first, count).to(step.x.device)
    part_cols = torch.cat([p * H * HEAD_DIM + cols for p in range(3)])
    return Step(
        x=step.x[:, part_cols].contiguous(),
        f_a=step.f_a,
        beta=step.beta[:, first : first + count].contiguous(),
        gate=step.gate[:, cols].contiguous(),
        slots=step.slots,
        accepted=step.accepted,
    )


def gate_scalars(gate_form="lower-bound", lower_bound=None) -> dict:
    """The gate keywords of the KDA entries (``gate_form``, ``lower_bound``) of a Kimi layer
    with ``gate_form``: the lower-bound gate's bound defaults to ``LOWER_BOUND``; the softplus
    gate has none (a bound given with it is refused by the entries)."""
    if gate_form == "lower-bound" and lower_bound is None:
        lower_bound = LOWER_BOUND
    return dict(gate_form=gate_form, lower_bound=lower_bound)


def step_operands(
    layer: Layer, step: Step, *, lower_bound=None, scale=SCALE, eps=EPS, gate_form="lower-bound"
):
    """``step`` on ``layer`` as keywords of ``kda.decode`` / ``kda.reference.decode`` (and of
    the replay entries, with ``ring=``): ``DecodeOperands``' fields from the layer or the
    step, ``accepted``, the conv layout and the scalars (``gate_scalars``)."""
    names = [f.name for f in dataclasses.fields(DecodeOperands) if not f.kw_only]
    named = {name: getattr(layer if hasattr(layer, name) else step, name) for name in names}
    scalars = dict(scale=scale, eps=eps) | gate_scalars(gate_form, lower_bound)
    return named | scalars | dict(accepted=step.accepted, conv_dim_first=layer.conv_dim_first)
