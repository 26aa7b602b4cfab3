"""Host entry of KdaRecover: ``kda.recover(...)``, the GPU commit of a recorded verify
step (``kda.reference.recover``'s contract; the kernel: ``kda.kernels.recover``)."""

from __future__ import annotations

import torch

from .operands import RecoverOperands, takes
from .validate import check_gate_form, check_options, check_recover


@takes(RecoverOperands, pdl=False, validate=None)
def recover(*args, pdl=False, validate=None, **kwargs):
    """GPU ``kda.reference.recover``: same arguments (``kda.operands.RecoverOperands``'s
    fields and ``validate``) plus ``pdl``; mutates ``state``. Calls the torch op
    ``kimi::kda_recover`` (``kda.custom_ops``), so ``torch.compile`` traces it as one op.

    Validation (``kda.validate.check_recover``) raises ``ValueError`` before any launch;
    the value checks (counts in 1..T, slots below the pool, no page shared by two live
    requests) read the index tensors on the host and are skipped while the current stream
    is capturing a CUDA graph (``validate="full"`` is refused then). The launch
    goes to ``torch.cuda.current_stream()`` (graph-capturable); compiled kernels are
    cached by (heads, tokens, pdl, arch).
    """
    op = RecoverOperands(*args, **kwargs)
    check_options(pdl=pdl, validate=validate)
    tensors = (
        op.state,
        op.slots,
        op.v_records,
        op.kg_records,
        op.a_log,
        op.dt_bias,
        op.accepted,
        op.checkpoint,
    )
    bound = check_gate_form(op.gate_form, op.lower_bound)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        check_recover(op, check_values=False)  # a non-tensor where a tensor goes: named
    lower_bound = None if op.lower_bound is None else bound  # a float for the op's schema
    torch.ops.kimi.kda_recover(*tensors, lower_bound, pdl, validate, op.gate_form)


__all__ = ["recover"]
