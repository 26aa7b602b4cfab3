"""Host entry of the replay decode kernel: ``kda.replay_decode(...)`` (KdaReplay, one CTA
per item; decode T = 1 and verify T = 2..8).

``kda.reference.replay_decode``'s arguments (``DecodeOperands``' fields and ``ring``) plus
``gate_mode`` and ``pdl`` (as ``kda.decode``'s), ``kernel`` ("auto" or "wide": KdaReplay;
``kda.dispatch.choose_replay``), ``out`` and ``validate``.
Calls the torch op ``kimi::kda_replay_decode`` (``kda.custom_ops``), whose implementation
is ``kda.kernels.launch.launch_replay``: ``kda.validate.check_replay`` raises
``ValueError`` before any launch (slot values and the ring's counters are not read while
the stream captures a CUDA graph; ``validate="full"`` is refused then); compiled kernels
are cached by (config, dtypes, arch); launches go to ``torch.cuda.current_stream()``.
Imports no CuTe DSL until the first launch.
"""

from __future__ import annotations

import inspect

import torch

from .custom_ops import ring_arguments, step_arguments
from .decode import typed
from .operands import DecodeOperands, Ring, takes
from .validate import check_options, check_out, check_replay, check_replay_kernel


@takes(
    DecodeOperands,
    ring=inspect.Parameter.empty,
    gate_mode=3,
    pdl=False,
    kernel="auto",
    out=None,
    validate=None,
)
def replay_decode(
    *args, ring: Ring, gate_mode=3, pdl=False, kernel="auto", out=None, validate=None, **kwargs
):
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
    options = {"gate_mode": gate_mode, "pdl": pdl, "validate": validate, "kernel": kernel}
    torch.ops.kimi.kda_replay_decode(**step_arguments(op, out), **ring_arguments(ring), **options)
    return out


__all__ = ["replay_decode"]
