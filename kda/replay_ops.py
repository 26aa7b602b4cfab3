"""Host entry of the replay decode kernel: ``kda.replay_decode(...)`` (KdaReplay, one CTA
per item; decode T = 1 and verify T = 2..8).

``kda.reference.replay_decode``'s arguments (``DecodeOperands``' fields and ``ring``) plus
``gate_mode`` and ``pdl`` (as ``kda.decode``'s), ``kernel`` ("auto" or "wide": KdaReplay;
``kda.dispatch.choose_replay``), ``out`` and ``validate``.
Calls the torch op ``kimi::kda_replay_decode`` (``kda.custom_ops``), whose implementation
is ``launch``: ``kda.validate.check_replay`` raises ``ValueError`` before any launch (slot
values and the ring's counters are not read while the stream captures a CUDA graph;
``validate="full"`` is refused then); compiled kernels are cached by (config, dtypes,
arch); launches go to ``torch.cuda.current_stream()``. Imports no CuTe DSL until the first
launch.
"""

from __future__ import annotations

import inspect

import torch

from . import dispatch
from .operands import DecodeOperands, ReplayKernelOperands, Ring, takes
from .ops import to_cute, typed
from .validate import capturing, check_options, check_out, check_replay, check_replay_kernel

_CACHE: dict = {}
_DUMMIES: dict = {}


def _dummy(device, dtype):
    """A stand-in for an absent operand (conv bias, accepted), one per device and dtype."""
    key = (device, dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(16, dtype=dtype, device=device)
    return _DUMMIES[key]


_VECTOR_ALIGNED = ("x", "f_a", "f_b", "state", "gate", "out")


@takes(DecodeOperands, ring=inspect.Parameter.empty, gate_mode=3, pdl=False, kernel="auto",
       out=None, validate=None)  # fmt: skip
def replay_decode(*args, ring: Ring, gate_mode=3, pdl=False, kernel="auto", out=None,
                  validate=None, **kwargs):  # fmt: skip
    """One replay decode (T = 1) or verify (T = 2..8) step on the GPU; returns ``output``
    [B*T, D] bf16 and mutates ``conv_state``, ``ring`` and, where a slot's ring is full,
    its checkpoint pages in ``state`` (``kda.reference.replay_decode``'s contract)."""
    op = DecodeOperands(*args, **kwargs)
    check_options(gate_mode=gate_mode, pdl=pdl, validate=validate)
    check_replay_kernel(kernel)
    if (
        op.records is not None  # the op takes no records: refused here
        or not typed(op)
        or not isinstance(ring, Ring)
        or not all(isinstance(t, torch.Tensor) for t in ring)
    ):  # a non-tensor where a tensor goes: the checks name it
        check_replay(op, ring, check_values=False)
    if out is not None and not isinstance(out, torch.Tensor):
        check_out(out, check_replay(op, ring, check_values=False)[0], op.state.device)
    if out is None:
        device = op.state.device
        out = torch.empty(op.x.shape[0], op.gate.shape[1], dtype=torch.bfloat16, device=device)
    torch.ops.kimi.kda_replay_decode(
        op.x, op.conv_weight, op.conv_bias, op.conv_state, op.f_a, op.beta, op.a_log,
        op.dt_bias, op.slots, op.state, op.gate, op.norm_weight, op.f_b, out, op.accepted,
        ring.v, ring.kg, ring.length, op.lower_bound, op.scale, op.eps, op.conv_dim_first,
        gate_mode, pdl, validate, kernel,
    )  # fmt: skip
    return out


def launch(op: DecodeOperands, ring: Ring, out, *, gate_mode, pdl, validate=None,
           kernel="auto") -> None:  # fmt: skip
    """``kimi::kda_replay_decode``'s implementation: validate, choose the kernel, compile
    once, launch."""
    full = check_options(gate_mode=gate_mode, pdl=pdl, validate=validate)
    check_replay_kernel(kernel)
    check_values = not capturing(op.state, full)
    shape, size = check_replay(op, ring, check_values=check_values, full=full)
    T = shape.tokens
    state = op.state
    if state.device.type != "cuda":
        raise ValueError("state must be a CUDA tensor (kda.replay_decode runs the GPU kernel)")
    device = state.device
    check_out(out, shape, device)
    named = dict(x=op.x, f_a=op.f_a, f_b=op.f_b, state=state, gate=op.gate, out=out)
    for name in _VECTOR_ALIGNED:
        if named[name].data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (vector loads/stores)")
    arch = dispatch.arch_of(torch.cuda.get_device_capability(device))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    choice = dispatch.choose_replay(shape.requests, shape.heads, T, size, sms=sms, kernel=kernel)
    dim_first = bool(op.conv_dim_first)
    conv_view = op.conv_state if dim_first else op.conv_state.transpose(1, 2)
    bias, accepted = op.conv_bias, op.accepted
    if bias is None:
        bias = _dummy(device, torch.bfloat16)
    if accepted is None:
        accepted = _dummy(device, torch.int32)
    slots = op.slots
    if T == 1 and slots.dim() == 2:  # the kernel reads slots[b] at T = 1
        slots = slots[:, 0].contiguous()
    tensors = dict(
        x=op.x, conv_weight=op.conv_weight, conv_bias=bias, conv_state=conv_view, f_a=op.f_a,
        beta=op.beta, a_log=op.a_log, dt_bias=op.dt_bias, slots=slots, state=state,
        output=out, gate=op.gate, norm_weight=op.norm_weight, f_b=op.f_b, accepted=accepted,
        ring_v=ring.v, ring_kg=ring.kg, ring_length=ring.length,
    )  # fmt: skip
    has_bias = op.conv_bias is not None
    key = ((choice.kernel, shape.heads, size, T, gate_mode, has_bias, dim_first,
            bool(pdl), arch),
           tuple(t.dtype for t in tensors.values()))  # fmt: skip
    from cutlass import Float32

    operands = ReplayKernelOperands(
        **{
            name: to_cute(t, leading_dim=1 if t is conv_view and not dim_first else None,
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

        from .replay import KdaReplay

        built = KdaReplay(shape.heads, size, T, gate_mode, has_bias, arch=arch, pdl=bool(pdl))
        compiled = cute.compile(built, *ordered, options=f"--gpu-arch {arch}")
        _CACHE[key] = compiled
    compiled(*ordered)


__all__ = ["replay_decode", "launch"]
