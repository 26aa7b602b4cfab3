"""Synthetic KDA layers and decode steps (seeded random weights, pools, activations, slots).

``make_layer`` builds the weights and pools of one layer's head shard; ``make_step``
builds one step's activations and slot tables. Both are deterministic in ``seed`` and
independent of the device, so every TP rank can rebuild the same full-model tensors and
take its shard with ``shard_layer`` / ``shard_step``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .validate import GATE_RANK, HEAD_DIM

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
            self.conv_weight, self.conv_bias, self.a_log, self.dt_bias, self.norm_weight,
            self.f_b, self.state.clone(), self.conv_state.clone(), self.conv_dim_first,
        )  # fmt: skip


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


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_layer(
    heads,
    pages,
    *,
    window=10,
    conv_dim_first=True,
    bias=True,
    conv_dtype=torch.bfloat16,
    weight_dtype=torch.bfloat16,
    seed=0,
    device="cpu",
) -> Layer:
    """Random weights and pools (page 0 included: slot 0 is never a live page)."""
    g = _gen(seed)
    D = heads * HEAD_DIM

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    conv_shape = (pages, 3 * D, window) if conv_dim_first else (pages, window, 3 * D)
    layer = Layer(
        conv_weight=rnd(3, 4, D, s=0.5).to(weight_dtype),
        conv_bias=rnd(3 * D, s=0.1).to(weight_dtype) if bias else None,
        a_log=torch.log(torch.empty(heads).uniform_(1.0, 16.0, generator=g)),
        dt_bias=rnd(D, s=0.5),
        norm_weight=(1.0 + rnd(HEAD_DIM, s=0.1)).to(weight_dtype),
        f_b=rnd(D, GATE_RANK, s=GATE_RANK**-0.5).to(torch.bfloat16),
        state=rnd(pages, heads, HEAD_DIM, HEAD_DIM, s=0.05),
        conv_state=rnd(*conv_shape).to(conv_dtype),
        conv_dim_first=conv_dim_first,
    )
    return layer.to(device) if device != "cpu" else layer


def make_step(
    requests,
    tokens,
    heads,
    *,
    pages,
    slot_table=None,
    accepted=None,
    padding=(),
    beta_dtype=torch.bfloat16,
    seed=0,
    device="cpu",
) -> Step:
    """Random activations; ``slot_table`` [B, T] (default: request b owns pages
    1 + b*T ...), ``padding`` the requests whose slots are set to -1 (a padding row)."""
    g = _gen(seed)
    B, T, D = requests, tokens, heads * HEAD_DIM
    rows = B * T
    if slot_table is None:
        if pages < 1 + B * T:
            raise ValueError(f"pages ({pages}) must be >= 1 + B*T = {1 + B * T}")
        slot_table = 1 + torch.arange(B * T, dtype=torch.int32).view(B, T)
    slots = slot_table.clone().to(torch.int32)
    for b in padding:
        slots[b] = -1
    if T == 1:
        slots = slots[:, 0].contiguous()
    if T > 1 and accepted is None:
        accepted = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32)
    step = Step(
        x=torch.randn(rows, 3 * D, generator=g).to(torch.bfloat16),
        f_a=torch.randn(rows, GATE_RANK, generator=g).to(torch.bfloat16),
        beta=torch.randn(rows, heads, generator=g).to(beta_dtype),
        gate=torch.randn(rows, D, generator=g).to(torch.bfloat16),
        slots=slots.contiguous(),
        accepted=None if T == 1 else accepted.to(torch.int32).contiguous(),
    )
    return step_to(step, device)


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


def run_reference(layer: Layer, step: Step, records=None, *, lower_bound=LOWER_BOUND,
                  scale=SCALE, eps=EPS, o_fp32=None, o_abs=None, raw_gate=None):  # fmt: skip
    """``kda.reference.decode`` on a layer and a step (mutates the layer's pools)."""
    from .reference import decode

    return decode(
        step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
        layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
        layer.f_b, lower_bound=lower_bound, scale=scale, eps=eps, accepted=step.accepted,
        conv_dim_first=layer.conv_dim_first, records=records, o_fp32=o_fp32, o_abs=o_abs,
        raw_gate=raw_gate,
    )  # fmt: skip
