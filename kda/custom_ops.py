"""The KDA kernels as torch ops: ``kimi::kda_decode``, ``kimi::kda_recover``,
``kimi::kda_replay_decode`` and the state-management ops ``kimi::kda_copy_state`` /
``kimi::kda_fold`` (``kda.state``; on a CPU pool these two run the references).

Registered with ``torch.library.custom_op`` so that a ``torch.compile``d model calling
``kda.decode`` / ``kda.recover`` traces them as single ops (no graph break) and knows what
they write: ``mutates_args`` names the state and conv pools, the output and the records;
they return nothing (the entry points return the ``out`` they passed). The fake
implementations run the entry points' shape and option checks (``ValueError`` naming the
argument, also under fake tensors) and launch nothing; the real ones are the launchers of
``kda.kernels.launch`` (the route is one way: entry -> op -> launcher), which check
again, values included (and, with ``validate`` = ``"full"`` or ``$KDA_VALIDATE``, the
non-finite scan), before the launch.

The schemas are written once, as parameter lists: a step's tensors (``STEP``), then each
op's own, then the step's scalars (``SCALARS``) and the options, last the decay's form
(``GATE``: ``gate_form``, default the lower-bound gate). ``step_arguments`` gives a
``DecodeOperands``' fields under those names, so the entries call the ops by keyword.
Importing this module needs no CuTe DSL.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from . import validate as checks
from .dispatch import choose_replay
from .kernels.launch import launch_copy, launch_decode, launch_fold, launch_recover, launch_replay
from .operands import DecodeOperands, RecoverOperands, Ring
from .state import check_copy, check_fold

NAMESPACE = "kimi"

Tensor, MaybeTensor = torch.Tensor, Optional[torch.Tensor]  # noqa: UP045 (the schema's type)

# (name, type[, default]) in schema order.
STEP = (
    ("x", Tensor),
    ("conv_weight", Tensor),
    ("conv_bias", MaybeTensor),
    ("conv_state", Tensor),
    ("f_a", Tensor),
    ("beta", Tensor),
    ("a_log", Tensor),
    ("dt_bias", Tensor),
    ("slots", Tensor),
    ("state", Tensor),
    ("gate", Tensor),
    ("norm_weight", Tensor),
    ("f_b", Tensor),
    ("out", Tensor),
    ("accepted", MaybeTensor),
)
# lower_bound: None with gate_form "softplus" (kda.validate.check_gate_form)
SCALARS = (
    ("lower_bound", Optional[float]),  # noqa: UP045
    ("scale", float),
    ("eps", float),
    ("conv_dim_first", bool),
)
# The decay's form (kda.validate.GATE_FORMS): the last parameter of each op, defaulted, so
# that calls written before it (positional ones included) keep the lower-bound gate.
GATE = (("gate_form", str, "lower-bound"),)
VALIDATE = (("validate", Optional[str], None),)  # noqa: UP045
RECORDS = (("v_records", MaybeTensor), ("kg_records", MaybeTensor))
RING = (("ring_v", Tensor), ("ring_kg", Tensor), ("ring_length", Tensor))
RECOVER = (
    ("state", Tensor),
    ("slots", Tensor),
    ("v_records", Tensor),
    ("kg_records", Tensor),
    ("a_log", Tensor),
    ("dt_bias", Tensor),
    ("accepted", Tensor),
    ("checkpoint", Tensor),
    ("lower_bound", Optional[float]),  # noqa: UP045
    ("pdl", bool),
)

_DECODE = (
    *STEP,
    *RECORDS,
    *SCALARS,
    ("kernel", str),
    ("cluster", Optional[int]),  # noqa: UP045
    ("gate_mode", int),
    ("pdl", bool),
    *VALIDATE,
    *GATE,
)
_REPLAY = (*STEP, *RING, *SCALARS, ("gate_mode", int), ("pdl", bool), *VALIDATE)
_REPLAY += (("kernel", str, "auto"), *GATE)
_RECOVER = (*RECOVER, *VALIDATE, *GATE)


def _signature(params) -> inspect.Signature:
    P = inspect.Parameter

    def parameter(name, kind, *default):
        return P(name, P.POSITIONAL_OR_KEYWORD, annotation=kind, default=(*default, P.empty)[0])

    return inspect.Signature([parameter(*p) for p in params], return_annotation=None)


def _custom_op(name, params, mutates, impl, fake):
    """``kimi::name`` of the schema ``params``; ``impl`` / ``fake`` take the arguments by
    name (bound to the schema, defaults applied)."""
    signature = _signature(params)

    def by_name(fn):
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            fn(**bound.arguments)

        call.__signature__ = signature
        call.__name__, call.__doc__ = name, fn.__doc__
        return call

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", by_name(impl), mutates_args=mutates)
    op.register_fake(by_name(fake))
    return op


def step_arguments(op: DecodeOperands, out) -> dict:
    """``op``'s step fields and scalars under the schemas' names (``STEP``, ``SCALARS`` and
    ``GATE``)."""
    names = [p[0] for p in STEP + SCALARS + GATE if p[0] != "out"]
    return {"out": out, **{name: getattr(op, name) for name in names}}


def ring_arguments(ring: Ring) -> dict:
    """``ring``'s tensors under the schema's names (``RING``)."""
    return {name: tensor for (name, _), tensor in zip(RING, ring, strict=True)}


def _operands(a: dict, records=None) -> DecodeOperands:
    fields = {p[0] for p in STEP + SCALARS + GATE} - {"out"}
    return DecodeOperands(**{name: a[name] for name in fields}, records=records)


def _records(a):
    v, kg = a["v_records"], a["kg_records"]
    return None if v is None and kg is None else (v, kg)


def _decode(**a) -> None:
    """``kda.decode`` into ``out`` (every mode the dispatcher offers; ``validate``: its
    checked mode)."""
    options = {k: a[k] for k in ("kernel", "cluster", "gate_mode", "pdl", "validate")}
    launch_decode(_operands(a, _records(a)), a["out"], **options)


def _decode_fake(**a) -> None:
    op = _operands(a, _records(a))
    checks.check_options(a["kernel"], a["cluster"], a["gate_mode"], a["pdl"], a["validate"])
    checks.check_out(a["out"], checks.check_decode(op, check_values=False), a["state"].device)
    checks.check_kernel_state(a["state"], "kda.decode")


def _recover_operands(a) -> RecoverOperands:
    names = [p[0] for p in RECOVER if p[0] not in ("lower_bound", "gate_form", "pdl")]
    gate = dict(lower_bound=a["lower_bound"], gate_form=a["gate_form"])
    return RecoverOperands(*(a[n] for n in names), **gate)


def _recover(**a) -> None:
    """``kda.recover``: commits the accepted tokens of a recorded verify step into ``state``."""
    launch_recover(_recover_operands(a), pdl=a["pdl"], validate=a["validate"])


def _recover_fake(**a) -> None:
    checks.check_options(pdl=a["pdl"], validate=a["validate"])
    checks.check_recover(_recover_operands(a), check_values=False)
    checks.check_kernel_state(a["state"], "kda.recover")


def _ring(a) -> Ring:
    return Ring(*(a[name] for name, _ in RING))


def _replay(**a) -> None:
    """``kda.replay_decode`` into ``out``; the ring is passed as its three tensors."""
    options = {k: a[k] for k in ("gate_mode", "pdl", "validate", "kernel")}
    launch_replay(_operands(a), _ring(a), a["out"], **options)


def _replay_fake(**a) -> None:
    op, kernel = _operands(a), a["kernel"]
    checks.check_options(gate_mode=a["gate_mode"], pdl=a["pdl"], validate=a["validate"])
    checks.check_replay_kernel(kernel)
    shape, size = checks.check_replay(op, _ring(a), check_values=False)
    checks.check_out(a["out"], shape, a["state"].device)
    checks.check_kernel_state(a["state"], "kda.replay_decode")
    choose_replay(shape.requests, shape.heads, shape.tokens, size, kernel=kernel)


COPY = (
    ("state", Tensor),
    ("conv_state", Tensor),
    ("src", Tensor),
    ("dst", Tensor),
    ("ring_v", MaybeTensor),
    ("ring_kg", MaybeTensor),
    ("ring_length", MaybeTensor),
    ("live", MaybeTensor),
)
FOLD = (
    ("state", Tensor),
    *RING,
    ("a_log", Tensor),
    ("dt_bias", Tensor),
    ("slots", Tensor),
    ("accepted", MaybeTensor),
    ("lower_bound", Optional[float]),  # noqa: UP045
    *GATE,
)


def _maybe_ring(a):
    parts = (a["ring_v"], a["ring_kg"], a["ring_length"])
    return None if all(t is None for t in parts) else Ring(*parts)


def _copy_args(a):
    return (a["state"], a["conv_state"], a["src"], a["dst"], _maybe_ring(a), a["live"])


def _copy_state(**a) -> None:
    """``kda.copy_state``: KdaCopy on a CUDA pool, ``kda.reference.copy_state`` on a CPU one."""
    if a["state"].is_cuda:
        launch_copy(*_copy_args(a))
    else:
        from .reference import copy_state

        state, conv, src, dst, ring, live = _copy_args(a)
        copy_state(state, conv, src, dst, ring=ring, live=live)


def _copy_state_fake(**a) -> None:
    check_copy(*_copy_args(a), check_values=False)


def _fold_args(a):
    names = ("a_log", "dt_bias", "slots", "accepted", "lower_bound", "gate_form")
    return (a["state"], _ring(a), *(a[n] for n in names))


def _fold(**a) -> None:
    """``kda.fold``: KdaFold on a CUDA pool, ``kda.reference.materialize`` of the listed
    slots (padding dropped) on a CPU one."""
    if a["state"].is_cuda:
        launch_fold(*_fold_args(a))
        return
    from .reference import materialize

    state, ring, a_log, dt_bias, slots, accepted, lower_bound, gate_form = _fold_args(a)
    check_fold(*_fold_args(a))
    keep = slots > 0
    committed = None if accepted is None else accepted[keep]
    options = dict(lower_bound=lower_bound, slots=slots[keep], accepted=committed)
    options["gate_form"] = gate_form
    materialize(state, ring, a_log, dt_bias, **options)


def _fold_fake(**a) -> None:
    check_fold(*_fold_args(a), check_values=False)
    if a["state"].is_cuda:  # fp32 or bf16 pages, as the reference (a CPU pool)
        checks.check_kernel_state(a["state"], "kda.fold")


_COPY_MUTATES = ("state", "conv_state", "ring_v", "ring_kg", "ring_length")
_DECODE_MUTATES = ("conv_state", "state", "out", "v_records", "kg_records")
_REPLAY_MUTATES = ("conv_state", "state", "out", "ring_v", "ring_kg", "ring_length")

kda_decode = _custom_op("kda_decode", _DECODE, _DECODE_MUTATES, _decode, _decode_fake)
kda_recover = _custom_op("kda_recover", _RECOVER, ("state",), _recover, _recover_fake)
kda_replay_decode = _custom_op("kda_replay_decode", _REPLAY, _REPLAY_MUTATES, _replay, _replay_fake)
kda_copy_state = _custom_op("kda_copy_state", COPY, _COPY_MUTATES, _copy_state, _copy_state_fake)
kda_fold = _custom_op("kda_fold", FOLD, ("state", "ring_length"), _fold, _fold_fake)

__all__ = [
    "NAMESPACE",
    "kda_copy_state",
    "kda_decode",
    "kda_fold",
    "kda_recover",
    "kda_replay_decode",
    "ring_arguments",
    "step_arguments",
]
