"""The operands of a decode step and of a recover call, defined once: ``DecodeOperands``
(the public arguments of ``kda.decode`` and ``kda.reference.decode``, torch tensors),
``KernelOperands`` (the same as CuTe values in the decode kernels' parameter order, built
by ``kda.kernels.launch``) and ``RecoverOperands`` (``kda.recover`` / ``kda.reference.recover``)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    import cutlass.cute as cute
    from cutlass import Float32


@dataclass(frozen=True)
class DecodeOperands:
    """A decode step's arguments, written once: ``kda.reference.decode(*args, **kwargs)``
    and ``kda.decode`` build this from theirs (shapes and dtypes: ``check_decode``)."""

    x: torch.Tensor  # [B*T, 3D] bf16: the q, k, v projections
    conv_weight: torch.Tensor  # [3, 4, D]
    conv_bias: torch.Tensor | None  # [3D] or None
    conv_state: torch.Tensor  # [S, 3D, W] (conv_dim_first) or [S, W, 3D]
    f_a: torch.Tensor  # [B*T, 128] bf16
    beta: torch.Tensor  # [B*T, H]
    a_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [D] fp32
    slots: torch.Tensor  # [B] (T = 1) or [B, >= T] int32; <= 0: padding
    state: torch.Tensor  # [S, H, 128, 128] fp32
    gate: torch.Tensor  # [B*T, D] bf16: the output gate
    norm_weight: torch.Tensor  # [128]
    f_b: torch.Tensor  # [D, 128] bf16
    _: KW_ONLY
    lower_bound: float | None = None  # the lower-bound gate's bound; None for softplus
    scale: float
    eps: float
    accepted: torch.Tensor | None = None  # [B] int32, T > 1 only
    conv_dim_first: bool = True
    records: tuple | None = None  # (v_records, kg_records): record mode, T > 1 only
    gate_form: str = "lower-bound"  # decay of the raw gate: "lower-bound" or "softplus"


# The decode step's operands as CuTe values, in the kernels' parameter order (the DSL passes
# a NamedTuple's fields as the kernel's parameters, in this order); a kernel family's
# operands are these fields followed by its own.
STEP_FIELDS = (
    ("x", "cute.Tensor"),
    ("conv_weight", "cute.Tensor"),
    ("conv_bias", "cute.Tensor"),
    ("conv_state", "cute.Tensor"),
    ("f_a", "cute.Tensor"),
    ("beta", "cute.Tensor"),
    ("a_log", "cute.Tensor"),
    ("dt_bias", "cute.Tensor"),
    ("slots", "cute.Tensor"),
    ("state", "cute.Tensor"),
    ("output", "cute.Tensor"),
    ("gate", "cute.Tensor"),
    ("norm_weight", "cute.Tensor"),
    ("lower_bound", "Float32"),
    ("scale", "Float32"),
    ("eps", "Float32"),
    ("f_b", "cute.Tensor"),
    ("accepted", "cute.Tensor"),
)

KernelOperands = NamedTuple(
    "KernelOperands", [*STEP_FIELDS, ("v_records", "cute.Tensor"), ("kg_records", "cute.Tensor")]
)
KernelOperands.__doc__ = """KdaWide / KdaStream / KdaSplit's operands: the step's fields, then
the records of a recorded verify step (dummies otherwise)."""


@dataclass(frozen=True)
class RecoverOperands:
    """A recover call's arguments (shapes and dtypes: ``kda.validate.check_recover``)."""

    state: torch.Tensor  # [S, H, 128, 128] fp32
    slots: torch.Tensor  # [B, >= T] int32
    v_records: torch.Tensor  # [B, H, T, 128] fp32
    kg_records: torch.Tensor  # [B, H, T, 256] bf16
    a_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [D] fp32
    accepted: torch.Tensor  # [B] int32: tokens to commit
    checkpoint: torch.Tensor  # [B] int32: the verify step's accepted (its state slot)
    _: KW_ONLY
    lower_bound: float | None = None
    gate_form: str = "lower-bound"


class RecoverKernelOperands(NamedTuple):
    """KdaRecover's operands as CuTe values, in ``KdaRecover.__call__``'s order (its
    kernel's one argument)."""

    state: cute.Tensor
    slots: cute.Tensor
    v_records: cute.Tensor
    kg_records: cute.Tensor
    a_log: cute.Tensor
    dt_bias: cute.Tensor
    accepted: cute.Tensor
    checkpoint: cute.Tensor
    lower_bound: Float32


ReplayKernelOperands = NamedTuple(
    "ReplayKernelOperands",
    [
        *STEP_FIELDS,
        ("ring_v", "cute.Tensor"),
        ("ring_kg", "cute.Tensor"),
        ("ring_length", "cute.Tensor"),
    ],
)
ReplayKernelOperands.__doc__ = """KdaReplay's operands: the step's fields, then the ring's three
tensors."""


class CopyKernelOperands(NamedTuple):
    """KdaCopy's operands (``kda.kernels.copy``): the slot pairs, then each pool as a
    ``[S, words]`` int32 view of its pages (one ``[1, 4]`` dummy for an absent ring)."""

    src: cute.Tensor  # [P] int32
    dst: cute.Tensor  # [P] int32
    state: cute.Tensor
    conv_state: cute.Tensor
    ring_v: cute.Tensor
    ring_kg: cute.Tensor
    ring_length: cute.Tensor


class FoldKernelOperands(NamedTuple):
    """KdaFold's operands (``kda.kernels.fold``): the pool, its ring, the gate weights, the
    slots to fold and the pending entries each commits (a dummy when none)."""

    state: cute.Tensor  # [S, H, 128, 128] fp32
    ring_v: cute.Tensor  # [S, R, H, 128] fp32
    ring_kg: cute.Tensor  # [S, R, H, 256] bf16
    ring_length: cute.Tensor  # [S, H, 2] int32
    a_log: cute.Tensor  # [H] fp32
    dt_bias: cute.Tensor  # [H*128] fp32
    slots: cute.Tensor  # [n] int32; <= 0: padding
    accepted: cute.Tensor  # [n] int32
    lower_bound: Float32


MIN_RING, MAX_RING = 2, 16


class Ring(NamedTuple):
    """Per state slot ``s``: ``v`` [S, R, H, 128] fp32 (v_new), ``kg`` [S, R, H, 256] bf16
    (k, raw gate), ``length`` [S, H, 2] int32 (committed, pending entries; one pair per
    head, all equal: each head's kernel item reads and writes only its own, so no item
    can see another's update within a step)."""

    v: torch.Tensor
    kg: torch.Tensor
    length: torch.Tensor

    @property
    def size(self) -> int:
        return self.v.shape[1]


def make_ring(state: torch.Tensor, size: int) -> Ring:
    """An empty ring of ``size`` entries for every page of the state pool ``state``."""
    if isinstance(size, bool) or not isinstance(size, int) or not MIN_RING <= size <= MAX_RING:
        raise ValueError(f"size must be an int in {MIN_RING}..{MAX_RING}; got {size!r}")
    pages, heads, _, dim = state.shape  # [S, H, 128, 128]
    return Ring(
        torch.zeros(pages, size, heads, dim, dtype=torch.float32, device=state.device),
        torch.zeros(pages, size, heads, 2 * dim, dtype=torch.bfloat16, device=state.device),
        torch.zeros(pages, heads, 2, dtype=torch.int32, device=state.device),
    )


def takes(operands, **options):
    """Give a function written ``f(*args, **kwargs)`` over ``operands``' fields the signature
    those fields spell (plus keyword ``options`` with their defaults; ``Parameter.empty``:
    required), for ``help`` and IDEs."""
    import dataclasses
    import inspect

    P = inspect.Parameter
    params = []
    for f in dataclasses.fields(operands):
        if f.name == "_":
            continue
        kind = P.KEYWORD_ONLY if f.kw_only else P.POSITIONAL_OR_KEYWORD
        default = P.empty if f.default is dataclasses.MISSING else f.default
        params.append(P(f.name, kind, default=default))
    params += [P(name, P.KEYWORD_ONLY, default=value) for name, value in options.items()]

    def wrap(fn):
        fn.__signature__ = inspect.Signature(params)
        return fn

    return wrap
