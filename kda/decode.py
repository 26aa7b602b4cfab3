"""Host entry of the KDA decode kernels: ``kda.decode(...)``.

``kda.reference.decode``'s arguments plus ``kernel`` ("auto": ``kda.dispatch.choose``,
"wide", "stream", "split", "pipe"), ``cluster`` (KdaSplit's CTAs per item: 2, 4, 8), ``gate_mode``
(raw gate reduction: 3, the default, the mma.sync chain with an error bound and an exact
recompute of the rare values the bound leaves undecided, bitwise the reference's raw gate;
0 / 1 the seed's mma.sync chains, which may flip a raw gate's bf16 rounding now and then),
``pdl`` (the kernels read the state and conv pages before ``griddepcontrol.wait``: the
kernel right before must not write them), ``out`` (a preallocated ``[B*T, D]`` bf16
output) and ``validate`` (``kda.reference.decode``'s: ``"full"`` adds the non-finite scan).
``decode`` calls the torch op ``kimi::kda_decode`` (``kda.custom_ops``), whose
implementation is ``kda.kernels.launch.launch_decode``: validation raises ``ValueError``
before any launch (slot values are not read while the stream captures a CUDA graph;
``validate="full"`` is refused then); compiled kernels are cached by (kernel, config,
dtypes, layout, arch); launches go to ``torch.cuda.current_stream()`` (graph-capturable).
"""

from __future__ import annotations

import torch

from . import dispatch
from .custom_ops import step_arguments
from .operands import DecodeOperands, takes
from .validate import check_decode, check_options, check_out


def plan(
    requests, heads, tokens, device, kernel="auto", cluster=None, state_dtype="fp32", records=False
):
    """The dispatcher's ``Choice`` for a step on ``device`` (says why), whatever the
    pages' ``state_dtype`` (KdaPipe takes fp32 and bf16 pages); ``records``: a step that
    writes records (never KdaPipe). The launcher also falls back to KdaStream for a window
    past KdaPipe's shared memory and parameters it cannot copy."""
    from .kernels.launch import sms

    del state_dtype  # every kernel takes both page dtypes
    count = sms(device)
    where = dict(sms=count, kernel=kernel, cluster=cluster, records=records)
    return dispatch.choose(requests, heads, tokens, **where)


@takes(DecodeOperands, kernel="auto", cluster=None, gate_mode=3, pdl=False, out=None, validate=None)
def decode(
    *args, kernel="auto", cluster=None, gate_mode=3, pdl=False, out=None, validate=None, **kwargs
):
    """One fused KDA decode / verify step on the GPU; returns ``output`` [B*T, D] bf16.
    ``args`` / ``kwargs``: ``kda.operands.DecodeOperands``'s fields. Calls the torch op
    ``kimi::kda_decode`` (``kda.custom_ops``), so ``torch.compile`` traces it as one op."""
    op = DecodeOperands(*args, **kwargs)
    check_options(kernel, cluster, gate_mode, pdl, validate)
    if not typed(op):  # a non-tensor where a tensor goes: the check names it
        check_decode(op, check_values=False)
    if out is not None and not isinstance(out, torch.Tensor):
        check_out(out, check_decode(op, check_values=False), op.state.device)
    v_records, kg_records = (None, None) if op.records is None else op.records
    if out is None:
        device = op.state.device
        out = torch.empty(op.x.shape[0], op.gate.shape[1], dtype=torch.bfloat16, device=device)
    torch.ops.kimi.kda_decode(
        **step_arguments(op, out),
        v_records=v_records,
        kg_records=kg_records,
        kernel=kernel,
        cluster=cluster,
        gate_mode=gate_mode,
        pdl=pdl,
        validate=validate,
    )
    return out


def typed(op: DecodeOperands) -> bool:
    """Every operand the op's schema types is of that type (2-D ``x`` and ``gate``, a
    ``(v_records, kg_records)`` pair, real scalars and a bool ``conv_dim_first``), so the
    op call itself cannot raise a TypeError."""
    needed = (
        op.x,
        op.conv_weight,
        op.conv_state,
        op.f_a,
        op.beta,
        op.a_log,
        op.dt_bias,
        op.slots,
        op.state,
        op.gate,
        op.norm_weight,
        op.f_b,
    )
    optional = (op.conv_bias, op.accepted)
    if not all(isinstance(t, torch.Tensor) for t in needed) or op.x.dim() != 2:
        return False
    if op.gate.dim() != 2 or any(
        t is not None and not isinstance(t, torch.Tensor) for t in optional
    ):
        return False
    if op.records is not None and (
        not isinstance(op.records, tuple | list)
        or len(op.records) != 2
        or not all(isinstance(t, torch.Tensor) for t in op.records)
    ):
        return False
    scalars = (op.scale, op.eps) + (() if op.lower_bound is None else (op.lower_bound,))
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in scalars):
        return False
    return isinstance(op.conv_dim_first, bool) and isinstance(op.gate_form, str)


__all__ = ["decode", "plan", "typed"]
