"""KdaRecover: commit the accepted tokens of a recorded verify step (``kda.reference.recover``).

One CTA per (request b, head h) in ``kda.device``'s thread layout reads the checkpoint page
``slots[b, checkpoint[b] - 1]`` into registers; for token t < accepted[b]: decay from the
recorded bf16 raw gate (``kda.device.decay``), ``k^ = k * rsqrt(sum k^2 + 1e-6)`` from the
recorded k (``(w0 + w2) + (w1 + w3)`` of 32-lane butterflies, as KdaWide), ``S = S * decay``,
``S = fma(k^, v_new, S)`` with the recorded fp32 ``v_new``, stored to ``slots[b, t]`` when
> 0. Rounding: the reference's points; only the fp32 order of ``sum k^2`` differs. Padding
(checkpoint slot <= 0): no load, no store. Tokens t >= accepted[b] apply the neutral update
(``decay = 1``, ``k^ = -0.0``, ``v_new = +0.0``: ``S`` bit for bit) and store nothing, so no
data-dependent control flow; each thread writes back only what it read, so the checkpoint
page may also be a target. PDL: everything is read after ``griddepcontrol.wait``;
dependents are released once the page and the records are loaded.
"""

from __future__ import annotations

import torch

from .operands import RecoverOperands, takes
from .validate import capturing, check_options, check_recover


def _kernel_class():
    """KdaRecover, defined on first use so that ``import kda`` needs no CuTe DSL."""
    global _KdaRecover
    if _KdaRecover is None:
        from .recover_kernel import KdaRecover

        _KdaRecover = KdaRecover
    return _KdaRecover


_KdaRecover = None
_CACHE: dict = {}


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
    tensors = (op.state, op.slots, op.v_records, op.kg_records, op.a_log, op.dt_bias,
               op.accepted, op.checkpoint)  # fmt: skip
    lower_bound = op.lower_bound
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not (
        isinstance(lower_bound, int | float) and not isinstance(lower_bound, bool)
    ):
        check_recover(op, check_values=False)  # a non-tensor where a tensor goes: named
    torch.ops.kimi.kda_recover(*tensors, lower_bound, pdl, validate)


def launch(op: RecoverOperands, *, pdl, validate=None) -> None:
    """``kimi::kda_recover``'s implementation: validate (the non-finite scan too with
    ``validate="full"``), compile once, launch."""
    full = check_options(pdl=pdl, validate=validate)
    state, v_records, kg_records = op.state, op.v_records, op.kg_records
    shape = check_recover(op, check_values=not capturing(state, full), full=full)
    if state.device.type != "cuda":
        raise ValueError("state must be a CUDA tensor (kda.recover runs the GPU kernel)")
    for name, t in (("state", state), ("v_records", v_records), ("kg_records", kg_records)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (vector loads/stores)")
    from . import dispatch
    from .ops import to_cute

    device = state.device
    arch = dispatch.arch_of(torch.cuda.get_device_capability(device))
    key = (shape.heads, shape.tokens, bool(pdl), arch)
    tensors = [
        state, op.slots, v_records, kg_records, op.a_log, op.dt_bias, op.accepted, op.checkpoint
    ]  # fmt: skip
    aligned = (state, v_records, kg_records)
    cute_args = [to_cute(t, align=16 if any(t is a for a in aligned) else None) for t in tensors]
    import cuda.bindings.driver as cuda
    from cutlass import Float32

    stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
    ordered = [*cute_args, Float32(op.lower_bound), stream]
    compiled = _CACHE.get(key)
    if compiled is None:
        import cutlass.cute as cute

        kernel = _kernel_class()(shape.heads, shape.tokens, arch=arch, pdl=bool(pdl))
        compiled = cute.compile(kernel, *ordered, options=f"--gpu-arch {arch}")
        _CACHE[key] = compiled
    compiled(*ordered)


__all__ = ["recover", "launch"]
