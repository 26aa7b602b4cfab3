"""Argument checks shared by every public function: ``ValueError`` naming the argument.

The checked mode: ``validate="full"`` on ``kda.decode`` / ``kda.recover`` / their
references and the o-projection's ``consume`` / ``project``, or ``KDA_VALIDATE=full`` in the
environment, also scans the inputs for NaN / Inf (a host read of every input).
"""

from __future__ import annotations

import math
import os
from numbers import Real

import torch


def check_tensor(name, t, dtypes, *, shape=None, ndim=None, device=None, align=None) -> None:
    """``t`` is a contiguous tensor of one of ``dtypes`` (a dtype or a tuple of them),
    with ``shape`` / ``ndim``, on ``device`` and ``align``-byte aligned when given (a fake
    or meta tensor, which has no address, is checked for everything but alignment)."""
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}); got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}; got {t.device}")
    if align is not None and has_data(t) and t.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned")


def check_device_tensor(name, t, shape, dtype, device) -> None:
    """A kernel operand: ``check_tensor`` with ``shape`` on ``device``, 16-byte aligned."""
    check_tensor(name, t, dtype, shape=shape, device=device, align=16)


def check_stacked(name, t, shape) -> None:
    """Every rank's tensor stacked ``[TP, ...] = shape``, contiguous (one launch reads every
    rank's slice)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be [TP, ...] = {list(shape)}; got {got}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (one launch reads every rank's slice)")


def has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` has memory to launch on (not a fake tensor of torch.compile's tracing,
    nor a meta tensor): the ops' fake implementations check shapes only."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def check_is_tensor(optional=(), **named) -> None:
    """ValueError naming the first argument that is not a tensor (``optional``: or None),
    before a torch op's schema would refuse it with a TypeError."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name in optional):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")


MODES = ("fast", "full")
MODE_VARIABLE = "KDA_VALIDATE"


def mode(validate=None) -> str:
    """The validation mode: ``validate`` (``"fast"`` or ``"full"``), else ``$KDA_VALIDATE``
    (unset or empty: ``"fast"``)."""
    if validate is None:
        validate = os.environ.get(MODE_VARIABLE, "") or "fast"
        if validate not in MODES:
            raise ValueError(f"{MODE_VARIABLE} must be one of {MODES}; got {validate!r}")
    elif validate not in MODES:
        raise ValueError(f"validate must be one of {MODES} or None; got {validate!r}")
    return validate


def capturing(state, full=False) -> bool:
    """Whether the current CUDA stream of ``state``'s device is capturing a graph (the
    value checks' host reads are skipped then); ``full`` refuses capture."""
    if not isinstance(state, torch.Tensor) or state.device.type != "cuda":
        return False
    if not torch.cuda.is_current_stream_capturing():
        return False
    if full:
        raise ValueError(
            'validate="full" reads the inputs on the host: not while a CUDA graph is captured'
        )
    return True


def check_real(name, value, *, low=None, high=None, low_open=False) -> float:
    """A finite real number (not a bool) within ``[low, high]`` (``(low, ...`` with
    ``low_open``); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number; got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}; got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}; got {value!r}")
    return float(value)


def check_finite(name, t) -> None:
    """Checked mode: refuse NaN or Inf in ``t`` (a host read of the whole tensor; a fake or
    meta tensor has no values to read)."""
    if t is not None and t.numel() and has_data(t) and not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise ValueError(
            f"{name} holds a non-finite value ({float(t[tuple(bad)])} at {bad}); "
            "the kernels would propagate it (checked mode)"
        )


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)
