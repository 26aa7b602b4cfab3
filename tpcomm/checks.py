"""Argument checks shared by every public function: ``ValueError`` naming the argument."""

from __future__ import annotations

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
