"""Host entries of the state-management ops: ``kda.copy_state`` (KdaCopy: whole slots of a
layer's KDA state, copied) and ``kda.fold`` (KdaFold: replay rings folded into their
checkpoint pages), and their argument checks, shared by the references
(``kda.reference.copy_state`` / ``materialize``) and the kernels.

Each entry calls its torch op (``kimi::kda_copy_state``, ``kimi::kda_fold``; registered in
``kda.custom_ops``): on a CUDA pool the op launches the kernel on the current stream
(graph-capturable: the slot tensors live on the device and their values are not read while
the stream captures), on a CPU pool it runs the reference. ``ValueError`` naming the
argument before anything is written: shapes, dtypes, devices always; outside graph capture
also the values (one host read of the slot tensors): slots past the pool, a destination
named twice, a destination that is also a source of the call, a destination in ``live``
(the slots the engine's current step reads or writes), duplicate slots to fold, a negative
``accepted``. A pair with a slot <= 0 (or a fold slot <= 0) is padding: skipped, so an
engine can keep fixed-size slot tensors for a captured graph.
"""

from __future__ import annotations

import torch

from tpcomm.checks import check_is_tensor, check_tensor

from .operands import Ring
from .validate import HEAD_DIM, STATE_DTYPES, check_gate_form, check_ring

# STATE_DTYPES: fp32 or bf16 pages; KdaCopy moves either as words, KdaFold folds either
# (a bf16 page rounded once per fold), as the reference does on a CPU pool.
CONV_DTYPES = (torch.bfloat16, torch.float32)

__all__ = ["check_copy", "check_fold", "copy_state", "fold", "STATE_DTYPES"]


def _check_pools(state, conv_state, ring) -> None:
    check_tensor("state", state, STATE_DTYPES, ndim=4)
    pages, heads = state.shape[:2]
    if tuple(state.shape[2:]) != (HEAD_DIM, HEAD_DIM) or heads < 1 or pages < 2:
        raise ValueError(f"state must be [S >= 2, H, 128, 128]; got {tuple(state.shape)}")
    check_tensor("conv_state", conv_state, CONV_DTYPES, ndim=3, device=state.device)
    channels = 3 * heads * HEAD_DIM
    if conv_state.shape[0] != pages or channels not in conv_state.shape[1:]:
        raise ValueError(
            f"conv_state must be [{pages}, {channels}, W] or [{pages}, W, {channels}] (the "
            f"state pool's pages and 3*H*128 channels); got {tuple(conv_state.shape)}"
        )
    if ring is not None:  # the ring's dtypes are fixed whatever the pool's (check_ring)
        check_ring(ring, state)


def _slot_values(name, t, pages):
    values = t.cpu().long()
    if values.numel() and int(values.max()) >= pages:
        raise ValueError(f"{name} must be < {pages} (the pool's pages); got {int(values.max())}")
    return values


def check_copy(state, conv_state, src, dst, ring=None, live=None, *, check_values=True) -> int:
    """Validate a ``copy_state`` call (module docstring); returns the number of pairs."""
    _check_pools(state, conv_state, ring)
    device, pages = state.device, state.shape[0]
    check_tensor("src", src, (torch.int32,), ndim=1, device=device)
    check_tensor("dst", dst, (torch.int32,), shape=src.shape, device=device)
    if live is not None:
        check_tensor("live", live, (torch.int32, torch.int64), device=device)
    if check_values:
        s, d = _slot_values("src", src, pages), _slot_values("dst", dst, pages)
        pair = (s > 0) & (d > 0)
        s, d = s[pair].tolist(), d[pair].tolist()
        seen: set[int] = set()
        for slot in d:
            if slot in seen:
                raise ValueError(f"dst: slot {slot} is a destination twice")
            seen.add(slot)
        both = seen.intersection(s)
        if both:
            raise ValueError(f"dst: slot {min(both)} is also a source of the copy (overlap)")
        if live is not None:
            busy = seen.intersection(live.cpu().flatten().tolist())
            if busy:
                raise ValueError(f"dst: slot {min(busy)} is live in the current step")
    return src.shape[0]


def check_fold(
    state, ring, a_log, dt_bias, slots, accepted, lower_bound, gate_form, *, check_values=True
):
    """Validate a ``fold`` call (module docstring); returns the ring size R."""
    check_tensor("state", state, STATE_DTYPES, ndim=4)  # KdaFold: fp32 only (its launcher)
    size = check_ring(ring, state)
    heads, device, pages = state.shape[1], state.device, state.shape[0]
    check_tensor("a_log", a_log, (torch.float32,), shape=(heads,), device=device)
    check_tensor("dt_bias", dt_bias, (torch.float32,), shape=(heads * HEAD_DIM,), device=device)
    check_tensor("slots", slots, (torch.int32,), ndim=1, device=device)
    if accepted is not None:
        check_tensor("accepted", accepted, (torch.int32,), shape=slots.shape, device=device)
    check_gate_form(gate_form, lower_bound)
    if check_values:
        live = _slot_values("slots", slots, pages)
        live = live[live > 0]
        if live.unique().numel() != live.numel():
            raise ValueError("slots: a slot is listed twice (each ring folds once)")
        if accepted is not None and accepted.numel() and int(accepted.min()) < 0:
            raise ValueError(f"accepted must be >= 0; got {int(accepted.min())}")
    return size


def _check_ring_type(ring) -> None:
    if not (isinstance(ring, Ring) and all(isinstance(t, torch.Tensor) for t in ring)):
        raise ValueError(f"ring must be a kda.operands.Ring of tensors; got {type(ring).__name__}")


def _ring_tensors(ring):
    return (None, None, None) if ring is None else (ring.v, ring.kg, ring.length)


def copy_state(state, conv_state, src, dst, *, ring: Ring | None = None, live=None):
    """Copy slot ``src[p]`` into slot ``dst[p]`` for every pair ``p`` (``src``, ``dst``:
    [P] int32 on the pool's device; a slot <= 0 makes the pair padding): the state page, the
    conv page and, with ``ring``, the slot's ring entries and counters, bit for bit.
    ``live``: the slots the current step uses (a destination among them is refused).
    GPU: one KdaCopy launch on the current stream, capturable; CPU: the reference."""
    check_is_tensor(("live",), state=state, conv_state=conv_state, src=src, dst=dst, live=live)
    if ring is not None:
        _check_ring_type(ring)
    torch.ops.kimi.kda_copy_state(state, conv_state, src, dst, *_ring_tensors(ring), live)


def fold(
    state,
    ring: Ring,
    a_log,
    dt_bias,
    slots,
    *,
    lower_bound=None,
    accepted=None,
    gate_form="lower-bound",
):
    """Fold the rings of ``slots`` ([n] int32 on the pool's device; <= 0: padding) into their
    checkpoint pages and empty them; ``accepted`` ([n] int32) first commits that many pending
    entries per slot, the rest are dropped: ``kda.reference.materialize``, bit for bit.
    GPU: one KdaFold launch on the current stream, capturable; CPU: the reference (fp32 or
    bf16 pages either way: a bf16 page rounded once per fold). ``gate_form`` /
    ``lower_bound``: the decay of the entries' raw gates (``kda.validate.check_gate_form``)."""
    tensors = dict(state=state, a_log=a_log, dt_bias=dt_bias, slots=slots, accepted=accepted)
    check_is_tensor(("accepted",), **tensors)
    _check_ring_type(ring)
    bound = check_gate_form(gate_form, lower_bound)
    lower_bound = None if lower_bound is None else bound  # a float for the op's schema
    args = (a_log, dt_bias, slots, accepted, lower_bound, gate_form)
    torch.ops.kimi.kda_fold(state, *ring, *args)


def live_pairs(src, dst):
    """The pairs of ``src`` / ``dst`` whose slots are both > 0 (index tensors, same device)."""
    keep = (src > 0) & (dst > 0)
    return src[keep].long(), dst[keep].long()
