"""The KDA torch ops' implementations: validate, choose the kernel, compile once, launch.

``kda.custom_ops`` registers ``kimi::kda_decode``, ``kimi::kda_replay_decode`` and
``kimi::kda_recover`` with these functions as their bodies; the public entries
(``kda.decode``, ``kda.replay_decode``, ``kda.recover``) only call the ops, so a step goes
one way: entry -> op -> launcher -> kernel. State pools are fp32 or bf16 pages
(``kda.validate.check_kernel_state``, before the CUDA-device check; any other dtype is
refused naming ``state``): the pool's dtype is a compile-time property of the decode,
replay, recover and fold kernels (their ``state_dtype``, in the compile-cache key); copy
moves pages as words, whatever their dtype. Each launcher checks its operands again, values
included unless the stream is capturing a CUDA graph (``validate="full"`` adds the non-finite
scan and is refused while capturing), raises ``ValueError`` before any launch, compiles a
kernel once per (kernel, configuration, gate form, dtypes, arch) and launches it on
``torch.cuda.current_stream()``. The CuTe DSL is imported on the first launch only.
"""

from __future__ import annotations

import torch

from .. import dispatch
from ..operands import DecodeOperands, RecoverOperands, Ring
from ..state import check_copy, check_fold
from ..validate import (
    capturing,
    check_decode,
    check_gate_form,
    check_kernel_state,
    check_options,
    check_out,
    check_recover,
    check_replay,
    check_replay_kernel,
)

# Operands the kernels move with 16-byte vector loads / stores (checked, assumed aligned).
STEP_ALIGNED = ("x", "f_a", "f_b", "state", "gate", "output")
RECOVER_ALIGNED = ("state", "v_records", "kg_records")
COPY_ALIGNED = ("state", "conv_state", "ring_v", "ring_kg")
FOLD_ALIGNED = ("state", "ring_v", "ring_kg")

_DUMMIES: dict = {}
_SM_COUNT: dict = {}


def sms(device) -> int:
    """The SM count of ``device`` (cached)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _dummy(device, dtype):
    """A stand-in for an absent operand (conv bias, accepted, records), one per device and
    dtype."""
    key = (device, dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(16, dtype=dtype, device=device)
    return _DUMMIES[key]


def _on_cuda(state, entry):
    if state.device.type != "cuda":
        raise ValueError(f"state must be a CUDA tensor ({entry} runs the GPU kernels)")
    return state.device


def _check_aligned(tensors: dict, aligned) -> None:
    for name in aligned:
        if tensors[name].data_ptr() % 16:
            name = "out" if name == "output" else name  # the public argument's name
            raise ValueError(f"{name} must be 16-byte aligned (vector loads/stores)")


def _step_tensors(op: DecodeOperands, out, slots=None) -> dict:
    """The step fields of ``kda.operands.STEP_FIELDS`` as torch tensors (dummies for an
    absent conv bias or ``accepted``; the conv pool as the ``[S, 3D, W]`` view)."""
    device = op.state.device
    conv = op.conv_state if op.conv_dim_first else op.conv_state.transpose(1, 2)
    bias, accepted = op.conv_bias, op.accepted
    return dict(
        x=op.x,
        conv_weight=op.conv_weight,
        conv_bias=bias if bias is not None else _dummy(device, torch.bfloat16),
        conv_state=conv,
        f_a=op.f_a,
        beta=op.beta,
        a_log=op.a_log,
        dt_bias=op.dt_bias,
        slots=op.slots if slots is None else slots,
        state=op.state,
        output=out,
        gate=op.gate,
        norm_weight=op.norm_weight,
        f_b=op.f_b,
        accepted=accepted if accepted is not None else _dummy(device, torch.int32),
    )


def _cute_operands(kind, tensors: dict, scalars: dict, aligned, conv_dim_first=True):
    """``kind`` (a kernel family's operands NamedTuple) of CuTe views of ``tensors``: dynamic
    layouts, vector operands assumed 16-byte aligned, a ``[S, W, 3D]`` conv pool's view with
    its leading dimension 1; ``scalars`` as ``Float32``."""
    from cutlass import Float32

    from tpcomm.cuteutil import to_cute

    def view(name, t):
        align = 16 if name in aligned else t.element_size()
        leading = 1 if name == "conv_state" and not conv_dim_first else t.dim() - 1
        return to_cute(t, align=align, leading_dim=leading)

    values = {name: view(name, t) for name, t in tensors.items()}
    values.update({name: Float32(v) for name, v in scalars.items()})
    return kind(**values)


def _run(key, build, operands, device, arch) -> None:
    """Compile ``build()`` for ``operands`` once per ``key`` (``tpcomm.cuteutil``'s one
    compile cache); launch it on the current stream."""
    import cuda.bindings.driver as cuda

    from tpcomm.cuteutil import compile_cached

    stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
    compiled = compile_cached(("kda", key), lambda: (build(), (operands, stream)), arch=arch)
    compiled(operands, stream)


def _bound(op) -> float:
    """The kernels' ``lower_bound`` scalar of a checked step or recover call (softplus: 0.0,
    unread: its form is compiled in)."""
    return check_gate_form(op.gate_form, op.lower_bound)


def _arch(device) -> str:
    return dispatch.arch_of(torch.cuda.get_device_capability(device))


def _dtypes(tensors: dict) -> tuple:
    return tuple(t.dtype for t in tensors.values())


def launch_decode(op: DecodeOperands, out, *, kernel, cluster, gate_mode, pdl, validate=None):
    """``kimi::kda_decode``: KdaWide, KdaStream, KdaSplit or KdaPipe (``kda.dispatch.choose``)."""
    from ..operands import KernelOperands

    full = check_options(kernel, cluster, gate_mode, pdl, validate)
    shape = check_decode(op, check_values=not capturing(op.state, full), full=full)
    state_dtype = check_kernel_state(op.state, "kda.decode")  # before the device check
    device = _on_cuda(op.state, "kda.decode")
    check_out(out, shape, device)
    B, T, H = shape.requests, shape.tokens, shape.heads
    arch = _arch(device)
    record = op.records is not None
    where = dict(sms=sms(device), records=record)
    choice = dispatch.choose(B, H, T, **where, kernel=kernel, cluster=cluster)
    v_records, kg_records = op.records if record else (None, None)
    tensors = _step_tensors(op, out)
    tensors["v_records"] = v_records if record else _dummy(device, torch.float32)
    tensors["kg_records"] = kg_records if record else _dummy(device, torch.bfloat16)
    _check_aligned(tensors, STEP_ALIGNED)
    has_bias, dim_first = op.conv_bias is not None, bool(op.conv_dim_first)
    if choice.kernel == "pipe":
        conv_bytes = op.conv_state.element_size()
        refusal = pipe_refusal(tensors, record, T, shape.window, conv_bytes, dim_first)
        if refusal and kernel == "pipe":
            raise ValueError(f"kernel='pipe': {refusal} (use kernel='stream' or 'wide')")
        if refusal:  # "auto": KdaStream runs what KdaPipe cannot
            choice = dispatch.choose(B, H, T, **where, kernel="stream")
    config = (
        choice.kernel,
        H,
        T,
        record,
        gate_mode,
        has_bias,
        dim_first,
        shape.window,
        _knob(choice),
        pdl,
        arch,
        state_dtype,
        op.gate_form,
    )
    scalars = dict(lower_bound=_bound(op), scale=op.scale, eps=op.eps)
    operands = _cute_operands(KernelOperands, tensors, scalars, STEP_ALIGNED, dim_first)

    def build():
        common = dict(arch=arch, pdl=pdl, state_dtype=state_dtype, gate_form=op.gate_form)
        if choice.kernel == "split":
            from .split import KdaSplit

            return KdaSplit(H, T, record, gate_mode, has_bias, choice.cluster, **common)
        if choice.kernel == "wide":
            from .wide import KdaWide

            return KdaWide(H, T, record, gate_mode, has_bias, choice.ahead, **common)
        if choice.kernel == "pipe":
            from .pipe import KdaPipe

            window, conv_bytes = shape.window, op.conv_state.element_size()
            config = (gate_mode, has_bias, dim_first, window, choice.ctas)
            return KdaPipe(H, T, *config, **common, conv_bytes=conv_bytes)
        from .stream import KdaStream

        return KdaStream(
            H, T, record, gate_mode, has_bias, dim_first, shape.window, choice.ctas, **common
        )

    _run((config, _dtypes(tensors)), build, operands, device, arch)


# KdaPipe copies a head's parameters and each token's beta word by cp.async, with
# addresses computed from the row-major shapes: (name, alignment in bytes)
PIPE_COPIED = (
    ("conv_weight", 16),
    ("conv_bias", 16),
    ("dt_bias", 16),
    ("f_b", 16),
    ("a_log", 4),
    ("beta", 4),
)


def pipe_refusal(tensors: dict, record, tokens, window, conv_bytes, conv_dim_first):
    """Why KdaPipe cannot run this step (None: it can): record mode, a window past its
    shared memory (with the pool's page size: fp32 or bf16), or a parameter it copies that
    is not contiguous and aligned."""
    from .pipe import pipe_layout

    if record:
        return "no record mode (records=)"
    state_bytes = tensors["state"].element_size()
    if pipe_layout(tokens, window, conv_bytes, conv_dim_first, state_bytes)[0] == 0:
        return f"a conv window of {window} at T = {tokens} does not fit its shared memory"
    for name, align in PIPE_COPIED:
        t = tensors[name]
        if not t.is_contiguous() or t.data_ptr() % align:
            return f"{name} must be contiguous and {align}-byte aligned"
    return None


def _knob(choice):
    """The launch knob a compiled kernel depends on: wide's prefetch distance, stream's
    persistent CTAs, split's cluster size."""
    if choice.kernel == "wide":
        return choice.ahead
    if choice.kernel == "split":
        return choice.cluster
    return choice.ctas


def launch_replay(
    op: DecodeOperands, ring: Ring, out, *, gate_mode, pdl, validate=None, kernel="auto"
) -> None:
    """``kimi::kda_replay_decode``: KdaReplay (``kda.dispatch.choose_replay``)."""
    from ..operands import ReplayKernelOperands

    full = check_options(gate_mode=gate_mode, pdl=pdl, validate=validate)
    check_replay_kernel(kernel)
    shape, size = check_replay(op, ring, check_values=not capturing(op.state, full), full=full)
    state_dtype = check_kernel_state(op.state, "kda.replay_decode")
    device = _on_cuda(op.state, "kda.replay_decode")
    check_out(out, shape, device)
    H, T = shape.heads, shape.tokens
    arch = _arch(device)
    choice = dispatch.choose_replay(shape.requests, H, T, size, sms=sms(device), kernel=kernel)
    slots = op.slots
    if T == 1 and slots.dim() == 2:  # the kernel reads slots[b] at T = 1
        slots = slots[:, 0].contiguous()
    tensors = _step_tensors(op, out, slots)
    tensors.update(ring_v=ring.v, ring_kg=ring.kg, ring_length=ring.length)
    _check_aligned(tensors, STEP_ALIGNED)
    has_bias, dim_first = op.conv_bias is not None, bool(op.conv_dim_first)
    config = (choice.kernel, H, size, T, gate_mode, has_bias, dim_first, bool(pdl), arch)
    config += (state_dtype, op.gate_form)
    scalars = dict(lower_bound=_bound(op), scale=op.scale, eps=op.eps)
    operands = _cute_operands(ReplayKernelOperands, tensors, scalars, STEP_ALIGNED, dim_first)

    def build():
        from .replay import KdaReplay

        options = dict(arch=arch, pdl=bool(pdl), state_dtype=state_dtype)
        return KdaReplay(H, size, T, gate_mode, has_bias, **options, gate_form=op.gate_form)

    _run((config, _dtypes(tensors)), build, operands, device, arch)


def launch_recover(op: RecoverOperands, *, pdl, validate=None) -> None:
    """``kimi::kda_recover``: KdaRecover."""
    from ..operands import RecoverKernelOperands

    full = check_options(pdl=pdl, validate=validate)
    shape = check_recover(op, check_values=not capturing(op.state, full), full=full)
    state_dtype = check_kernel_state(op.state, "kda.recover")
    device = _on_cuda(op.state, "kda.recover")
    names = RecoverKernelOperands._fields[:-1]  # the tensors; lower_bound last
    tensors = {name: getattr(op, name) for name in names}
    _check_aligned(tensors, RECOVER_ALIGNED)
    arch = _arch(device)
    scalars = dict(lower_bound=_bound(op))
    operands = _cute_operands(RecoverKernelOperands, tensors, scalars, RECOVER_ALIGNED)
    gate_form = op.gate_form

    def build():
        from .recover import KdaRecover

        options = dict(arch=arch, pdl=bool(pdl), state_dtype=state_dtype, gate_form=gate_form)
        return KdaRecover(shape.heads, shape.tokens, **options)

    key = ("recover", shape.heads, shape.tokens, bool(pdl), arch, state_dtype, gate_form)
    _run(key, build, operands, device, arch)


def _page_words(pool):
    """A pool ``[S, ...]`` as the ``[S, words]`` int32 view of its pages."""
    return pool.view(pool.shape[0], -1).view(torch.int32)


def launch_copy(state, conv_state, src, dst, ring, live) -> None:
    """``kimi::kda_copy_state``: KdaCopy, one launch for every pair and pool."""
    from ..operands import CopyKernelOperands

    pairs = check_copy(state, conv_state, src, dst, ring, live, check_values=not capturing(state))
    device = _on_cuda(state, "kda.copy_state")
    if pairs == 0:
        return
    dummy = _dummy(device, torch.int32).view(1, -1)
    rings = (ring.v, ring.kg, ring.length) if ring is not None else (None,) * 3
    tensors = dict(src=src, dst=dst, state=_page_words(state), conv_state=_page_words(conv_state))
    for name, pool in zip(("ring_v", "ring_kg", "ring_length"), rings, strict=True):
        tensors[name] = _page_words(pool) if pool is not None else dummy
    _check_aligned(tensors, COPY_ALIGNED)
    present = ("state", "conv_state") + (("ring_v", "ring_kg") if ring is not None else ())
    words = tuple(tensors[n].shape[1] if n in present else 0 for n in COPY_ALIGNED)
    counters = tensors["ring_length"].shape[1] if ring is not None else 0
    arch = _arch(device)
    operands = _cute_operands(CopyKernelOperands, tensors, {}, COPY_ALIGNED)

    def build():
        from .copy import KdaCopy

        return KdaCopy(words, counters, arch=arch)

    _run(("copy", words, counters, arch), build, operands, device, arch)


def launch_fold(
    state, ring: Ring, a_log, dt_bias, slots, accepted, lower_bound, gate_form="lower-bound"
) -> None:
    """``kimi::kda_fold``: KdaFold, one CTA per (head, listed slot)."""
    from ..operands import FoldKernelOperands

    args = (state, ring, a_log, dt_bias, slots, accepted, lower_bound, gate_form)
    size = check_fold(*args, check_values=not capturing(state))
    state_dtype = check_kernel_state(state, "kda.fold")
    device = _on_cuda(state, "kda.fold")
    if slots.numel() == 0:
        return
    has_accepted = accepted is not None
    tensors = dict(state=state, ring_v=ring.v, ring_kg=ring.kg, ring_length=ring.length)
    tensors.update(a_log=a_log, dt_bias=dt_bias, slots=slots)
    tensors["accepted"] = accepted if has_accepted else _dummy(device, torch.int32)
    _check_aligned(tensors, FOLD_ALIGNED)
    arch, heads = _arch(device), state.shape[1]
    scalars = dict(lower_bound=check_gate_form(gate_form, lower_bound))
    operands = _cute_operands(FoldKernelOperands, tensors, scalars, FOLD_ALIGNED)
    options = dict(arch=arch, state_dtype=state_dtype, gate_form=gate_form)

    def build():
        from .fold import KdaFold

        return KdaFold(heads, size, has_accepted, **options)

    key = ("fold", heads, size, has_accepted, arch, state_dtype, gate_form)
    _run(key, build, operands, device, arch)
