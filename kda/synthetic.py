"""Synthetic KDA layers and decode steps (seeded random weights, pools, activations, slots).

``make_layer`` builds the weights and pools of one layer's head shard; ``make_step``
builds one step's activations and slot tables. Both are deterministic in ``seed`` and
independent of the device, so every TP rank can rebuild the same full-model tensors and
take its shard with ``kda.layer.shard_layer`` / ``shard_step``. Test and benchmark data
only: the containers and the sharding an engine uses live in ``kda.layer``.
"""

from __future__ import annotations

import torch

from .layer import EPS, SCALE, Layer, Step, step_operands, step_to
from .validate import GATE_RANK, HEAD_DIM


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _counts(**counts) -> None:
    """Each a positive int (not a bool); ValueError naming the first that is not."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")


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
    _counts(heads=heads, pages=pages, window=window)
    if window < 3:
        raise ValueError(f"window must be >= 3 (the conv's three taps); got {window}")
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


def extreme_dt_bias(layer: Layer, seed=0) -> None:
    """Test data for the softplus gate: dt_bias of a few channels (1 in 64) set far out,
    past softplus's threshold of 20 (a decay of about exp(-20 exp(a_log)), fp32 zero or
    subnormal further out) and far below (a decay of 1), a few around the threshold."""
    g = _gen(seed)
    D = layer.dt_bias.numel()
    for value in (25.0, 19.5, 20.3, -40.0, 60.0):
        channels = torch.randint(D, (max(1, D // 64),), generator=g)
        layer.dt_bias[channels.to(layer.dt_bias.device)] = value


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
    _counts(requests=requests, tokens=tokens, heads=heads, pages=pages)
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


def run_reference(
    layer: Layer,
    step: Step,
    records=None,
    *,
    lower_bound=None,
    scale=SCALE,
    eps=EPS,
    gate_form="lower-bound",
    **outputs,
):
    """``kda.reference.decode`` on a layer and a step (mutates the layer's pools); the
    scalars as ``kda.layer.step_operands``' (``lower_bound`` None: ``LOWER_BOUND`` with the
    lower-bound gate); ``outputs``: its ``o_fp32``, ``o_abs``, ``raw_gate``."""
    from .reference import decode

    scalars = dict(lower_bound=lower_bound, scale=scale, eps=eps, gate_form=gate_form)
    return decode(**step_operands(layer, step, **scalars), records=records, **outputs)
