"""Host entry of the KDA decode kernels: ``kda.decode(...)``.

``kda.reference.decode``'s arguments plus ``kernel`` ("auto": ``kda.dispatch.choose``,
"wide", "stream", "split"), ``cluster`` (KdaSplit's CTAs per item: 2, 4, 8), ``gate_mode``
(raw gate reduction: 3, the default, the mma.sync chain with an error bound and an exact
recompute of the rare values the bound leaves undecided, bitwise the reference's raw gate;
0 / 1 the seed's mma.sync chains, which may flip a raw gate's bf16 rounding now and then),
``pdl`` (the kernels read the state and conv pages before ``griddepcontrol.wait``: the
kernel right before must not write them), ``out`` (a preallocated ``[B*T, D]`` bf16
output) and ``validate`` (``kda.reference.decode``'s: ``"full"`` adds the non-finite scan).
``decode`` calls the torch op ``kimi::kda_decode`` (``kda.custom_ops``), whose
implementation is ``launch``: validation raises ``ValueError`` before any launch (slot
values are not read while the stream captures a CUDA graph; ``validate="full"`` is refused
then); compiled kernels are cached by (kernel, config, dtypes, layout, arch); launches go to
``torch.cuda.current_stream()`` (graph-capturable).
"""

from __future__ import annotations

import torch

from . import dispatch
from .operands import DecodeOperands, KernelOperands, takes
from .validate import HEAD_DIM, capturing, check_decode, check_options, check_out

_CACHE: dict = {}
_DUMMIES: dict = {}
_SM_COUNT: dict = {}
_VECTOR_ALIGNED = ("x", "f_a", "f_b", "state", "gate", "out")


def _dummy(device, dtype):
    key = (device, dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(16, dtype=dtype, device=device)
    return _DUMMIES[key]


def _cute_dtype(dtype):
    from cutlass import BFloat16, Float16, Float32, Int32

    return {
        torch.bfloat16: BFloat16,
        torch.float16: Float16,
        torch.float32: Float32,
        torch.int32: Int32,
    }[dtype]


def to_cute(t, leading_dim=None, align=None):
    """A torch tensor as a CuTe tensor with a dynamic layout (``align``: assumed bytes)."""
    from cutlass.cute.runtime import from_dlpack

    if align is None:
        align = t.element_size()
    if leading_dim is None:
        leading_dim = t.dim() - 1
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=leading_dim)


def _sms(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def plan(requests, heads, tokens, device, kernel="auto", cluster=None):
    """The dispatcher's ``Choice`` for a step on ``device`` (says why)."""
    sms = _sms(torch.device(device))
    return dispatch.choose(requests, heads, tokens, sms=sms, kernel=kernel, cluster=cluster)


@takes(DecodeOperands, kernel="auto", cluster=None, gate_mode=3, pdl=False, out=None,
       validate=None)  # fmt: skip
def decode(*args, kernel="auto", cluster=None, gate_mode=3, pdl=False, out=None,
           validate=None, **kwargs):  # fmt: skip
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
        op.x, op.conv_weight, op.conv_bias, op.conv_state, op.f_a, op.beta, op.a_log,
        op.dt_bias, op.slots, op.state, op.gate, op.norm_weight, op.f_b, out, op.accepted,
        v_records, kg_records, op.lower_bound, op.scale, op.eps, op.conv_dim_first,
        kernel, cluster, gate_mode, pdl, validate,
    )  # fmt: skip
    return out


def typed(op: DecodeOperands) -> bool:
    """Every operand the op's schema types is of that type (2-D ``x`` and ``gate``, a
    ``(v_records, kg_records)`` pair, real scalars and a bool ``conv_dim_first``), so the
    op call itself cannot raise a TypeError."""
    needed = (op.x, op.conv_weight, op.conv_state, op.f_a, op.beta, op.a_log, op.dt_bias,
              op.slots, op.state, op.gate, op.norm_weight, op.f_b)  # fmt: skip
    optional = (op.conv_bias, op.accepted)
    if not all(isinstance(t, torch.Tensor) for t in needed) or op.x.dim() != 2:
        return False
    if op.gate.dim() != 2 or any(t is not None and not isinstance(t, torch.Tensor)
                                 for t in optional):  # fmt: skip
        return False
    if op.records is not None and (
        not isinstance(op.records, tuple | list)
        or len(op.records) != 2
        or not all(isinstance(t, torch.Tensor) for t in op.records)
    ):
        return False
    scalars = (op.lower_bound, op.scale, op.eps)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in scalars):
        return False
    return isinstance(op.conv_dim_first, bool)


def launch(op: DecodeOperands, out, *, kernel, cluster, gate_mode, pdl, validate=None) -> None:
    """``kimi::kda_decode``'s implementation: validate (values too, unless the stream is
    capturing; the non-finite scan with ``validate="full"``), choose the kernel, compile
    once, launch on the current stream."""
    full = check_options(kernel, cluster, gate_mode, pdl, validate)
    shape = check_decode(op, check_values=not capturing(op.state, full), full=full)
    if op.state.device.type != "cuda":
        raise ValueError("state must be a CUDA tensor (kda.decode runs the GPU kernels)")
    x, conv_weight, conv_bias, conv_state = op.x, op.conv_weight, op.conv_bias, op.conv_state
    state, gate, f_a, f_b = op.state, op.gate, op.f_a, op.f_b
    accepted, conv_dim_first, records = op.accepted, op.conv_dim_first, op.records
    B, T, H = shape.requests, shape.tokens, shape.heads
    device = state.device
    check_out(out, shape, device)
    named = dict(x=x, f_a=f_a, f_b=f_b, state=state, gate=gate, out=out)
    for name in _VECTOR_ALIGNED:
        if named[name].data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (vector loads/stores)")
    arch = dispatch.arch_of(torch.cuda.get_device_capability(device))
    choice = dispatch.choose(B, H, T, sms=_sms(device), kernel=kernel, cluster=cluster)

    record = records is not None
    v_records, kg_records = records if record else (None, None)
    conv_view = conv_state if conv_dim_first else conv_state.transpose(1, 2)
    # The kernels' tensors by name (KernelOperands' order); dummies for absent operands.
    tensors = dict(
        x=x, conv_weight=conv_weight,
        conv_bias=conv_bias if conv_bias is not None else _dummy(device, torch.bfloat16),
        conv_state=conv_view, f_a=f_a, beta=op.beta, a_log=op.a_log, dt_bias=op.dt_bias,
        slots=op.slots, state=state, output=out, gate=gate, norm_weight=op.norm_weight, f_b=f_b,
        accepted=accepted if accepted is not None else _dummy(device, torch.int32),
        v_records=v_records if record else _dummy(device, torch.float32),
        kg_records=kg_records if record else _dummy(device, torch.bfloat16),
    )  # fmt: skip
    config = (
        choice.kernel, H, T, record, gate_mode, conv_bias is not None, bool(conv_dim_first),
        shape.window, _knob(choice), pdl, arch,
    )  # fmt: skip
    dtypes = tuple(t.dtype for t in tensors.values())
    key = (config, dtypes)
    from cutlass import Float32

    operands = KernelOperands(
        **{
            name: to_cute(t, leading_dim=1 if t is conv_view and not conv_dim_first else None,
                          align=16 if any(t is named[n] for n in _VECTOR_ALIGNED) else None)
            for name, t in tensors.items()
        },
        lower_bound=Float32(op.lower_bound), scale=Float32(op.scale), eps=Float32(op.eps),
    )  # fmt: skip
    import cuda.bindings.driver as cuda

    stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
    ordered = [*operands, stream]
    compiled = _CACHE.get(key)
    if compiled is None:
        import cutlass.cute as cute

        kernel_obj = _build(choice, H, T, record, gate_mode, conv_bias is not None,
                            bool(conv_dim_first), shape.window, arch, pdl)  # fmt: skip
        compiled = cute.compile(kernel_obj, *ordered, options=f"--gpu-arch {arch}")
        _CACHE[key] = compiled
    compiled(*ordered)


def _knob(choice):
    """The launch knob a compiled kernel depends on: wide's prefetch distance, stream's
    persistent CTAs, split's cluster size."""
    if choice.kernel == "wide":
        return choice.ahead
    if choice.kernel == "split":
        return choice.cluster
    return choice.ctas


def _build(choice, heads, tokens, record, gate_mode, has_bias, dim_first, window, arch, pdl):
    if choice.kernel == "split":
        from .split import KdaSplit

        return KdaSplit(
            heads, tokens, record, gate_mode, has_bias, choice.cluster, arch=arch, pdl=pdl
        )
    if choice.kernel == "wide":
        from .wide import KdaWide

        return KdaWide(heads, tokens, record, gate_mode, has_bias, choice.ahead, arch=arch, pdl=pdl)
    from .stream import KdaStream

    return KdaStream(
        heads, tokens, record, gate_mode, has_bias, dim_first, window, choice.ctas,
        arch=arch, pdl=pdl,
    )  # fmt: skip


__all__ = ["decode", "launch", "plan", "to_cute", "HEAD_DIM"]
