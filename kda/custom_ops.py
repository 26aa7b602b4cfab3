"""The KDA kernels as torch ops: ``kimi::kda_decode``, ``kimi::kda_recover`` and
``kimi::kda_replay_decode``.

Registered with ``torch.library.custom_op`` so that a ``torch.compile``d model calling
``kda.decode`` / ``kda.recover`` traces them as single ops (no graph break) and knows what
they write: ``mutates_args`` names the state and conv pools, the output and the records;
they return nothing (the entry points return the ``out`` they passed). The fake
implementations run the entry points' shape and option checks (``ValueError`` naming the
argument, also under fake tensors) and launch nothing; the real ones are the launchers of
``kda.kernels.launch`` (the route is one way: entry -> op -> launcher), which check
again, values included (and, with ``validate`` = ``"full"`` or ``$KDA_VALIDATE``, the
non-finite scan), before the launch.
Importing this module needs no CuTe DSL.
"""

from __future__ import annotations

import torch

from .dispatch import choose_replay
from .kernels.launch import launch_decode, launch_recover, launch_replay
from .operands import DecodeOperands, RecoverOperands, Ring
from .validate import (
    check_decode,
    check_options,
    check_out,
    check_recover,
    check_replay,
    check_replay_kernel,
)

NAMESPACE = "kimi"

_DECODE_MUTATES = ("conv_state", "state", "out", "v_records", "kg_records")


def _operands(x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, slots, state,
              gate, norm_weight, f_b, accepted, v_records, kg_records, lower_bound, scale, eps,
              conv_dim_first):  # fmt: skip
    records = None if v_records is None and kg_records is None else (v_records, kg_records)
    return DecodeOperands(
        x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, slots, state, gate,
        norm_weight, f_b, lower_bound=lower_bound, scale=scale, eps=eps, accepted=accepted,
        conv_dim_first=conv_dim_first, records=records,
    )  # fmt: skip


@torch.library.custom_op(f"{NAMESPACE}::kda_decode", mutates_args=_DECODE_MUTATES)
def kda_decode(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    f_a: torch.Tensor,
    beta: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    state: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    f_b: torch.Tensor,
    out: torch.Tensor,
    accepted: torch.Tensor | None,
    v_records: torch.Tensor | None,
    kg_records: torch.Tensor | None,
    lower_bound: float,
    scale: float,
    eps: float,
    conv_dim_first: bool,
    kernel: str,
    cluster: int | None,
    gate_mode: int,
    pdl: bool,
    validate: str | None = None,
) -> None:
    """``kda.decode`` into ``out`` (every mode the dispatcher offers; ``validate``: its
    checked mode)."""
    op = _operands(x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, slots,
                   state, gate, norm_weight, f_b, accepted, v_records, kg_records, lower_bound,
                   scale, eps, conv_dim_first)  # fmt: skip
    launch_decode(op, out, kernel=kernel, cluster=cluster, gate_mode=gate_mode, pdl=pdl,
               validate=validate)  # fmt: skip


@kda_decode.register_fake
def _kda_decode_fake(x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, slots,
                     state, gate, norm_weight, f_b, out, accepted, v_records, kg_records,
                     lower_bound, scale, eps, conv_dim_first, kernel, cluster, gate_mode,
                     pdl, validate=None):  # fmt: skip
    op = _operands(x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, slots,
                   state, gate, norm_weight, f_b, accepted, v_records, kg_records, lower_bound,
                   scale, eps, conv_dim_first)  # fmt: skip
    check_options(kernel, cluster, gate_mode, pdl, validate)
    check_out(out, check_decode(op, check_values=False), state.device)


@torch.library.custom_op(f"{NAMESPACE}::kda_recover", mutates_args=("state",))
def kda_recover(
    state: torch.Tensor,
    slots: torch.Tensor,
    v_records: torch.Tensor,
    kg_records: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    accepted: torch.Tensor,
    checkpoint: torch.Tensor,
    lower_bound: float,
    pdl: bool,
    validate: str | None = None,
) -> None:
    """``kda.recover``: commits the accepted tokens of a recorded verify step into ``state``."""
    op = RecoverOperands(state, slots, v_records, kg_records, a_log, dt_bias, accepted,
                         checkpoint, lower_bound=lower_bound)  # fmt: skip
    launch_recover(op, pdl=pdl, validate=validate)


@kda_recover.register_fake
def _kda_recover_fake(state, slots, v_records, kg_records, a_log, dt_bias, accepted, checkpoint,
                      lower_bound, pdl, validate=None):  # fmt: skip
    op = RecoverOperands(state, slots, v_records, kg_records, a_log, dt_bias, accepted,
                         checkpoint, lower_bound=lower_bound)  # fmt: skip
    check_options(pdl=pdl, validate=validate)
    check_recover(op, check_values=False)


_REPLAY_MUTATES = ("conv_state", "state", "out", "ring_v", "ring_kg", "ring_length")


@torch.library.custom_op(f"{NAMESPACE}::kda_replay_decode", mutates_args=_REPLAY_MUTATES)
def kda_replay_decode(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    f_a: torch.Tensor,
    beta: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    state: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    f_b: torch.Tensor,
    out: torch.Tensor,
    accepted: torch.Tensor | None,
    ring_v: torch.Tensor,
    ring_kg: torch.Tensor,
    ring_length: torch.Tensor,
    lower_bound: float,
    scale: float,
    eps: float,
    conv_dim_first: bool,
    gate_mode: int,
    pdl: bool,
    validate: str | None = None,
    kernel: str = "auto",
) -> None:
    """``kda.replay_decode`` into ``out``; the ring is passed as its three tensors."""
    op = _operands(x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, slots,
                   state, gate, norm_weight, f_b, accepted, None, None, lower_bound, scale, eps,
                   conv_dim_first)  # fmt: skip
    ring = Ring(ring_v, ring_kg, ring_length)
    launch_replay(op, ring, out, gate_mode=gate_mode, pdl=pdl, validate=validate, kernel=kernel)


@kda_replay_decode.register_fake
def _kda_replay_decode_fake(x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias,
                            slots, state, gate, norm_weight, f_b, out, accepted, ring_v, ring_kg,
                            ring_length, lower_bound, scale, eps, conv_dim_first, gate_mode, pdl,
                            validate=None, kernel="auto"):  # fmt: skip
    op = _operands(x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, slots,
                   state, gate, norm_weight, f_b, accepted, None, None, lower_bound, scale, eps,
                   conv_dim_first)  # fmt: skip
    check_options(gate_mode=gate_mode, pdl=pdl, validate=validate)
    check_replay_kernel(kernel)
    shape, size = check_replay(op, Ring(ring_v, ring_kg, ring_length), check_values=False)
    check_out(out, shape, state.device)
    choose_replay(shape.requests, shape.heads, shape.tokens, size, kernel=kernel)


__all__ = ["NAMESPACE", "kda_decode", "kda_recover", "kda_replay_decode"]
