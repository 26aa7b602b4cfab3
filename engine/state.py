"""KDA state as an engine manages it, on one rank's ``DecodeLayer``: slot copies (prefix
snapshots, forks), ring folds, swaps to host memory and back, and the prefill hand-off.

A slot's state is its state page ``shard.state[slot]`` ([H, 128 value rows, 128 keys],
fp32, V-first), its conv page ``shard.conv_state[slot]`` (the last inputs of the q, k, v
convolutions) and, in replay mode, its ring entries ``ring.v[slot]``, ``ring.kg[slot]``
and counters ``ring.length[slot]``. Every function here moves whole slots (docs/state.md):

- ``copy_state(layer, src, dst)``: slot ``src[p]`` into slot ``dst[p]``, bit for bit, ring
  included (a copied replay slot continues exactly as its source would, pending entries and
  all); one KdaCopy launch on the current stream, graph-capturable (``kda.copy_state``);
- ``fold(layer, slots, accepted=None)``: replay mode, the slots' rings folded into their
  pages (``kda.fold``: KdaFold, one launch, capturable, bitwise ``materialize``);
- ``export_state(layer, slots)`` / ``import_state(layer, slots, blob)``: the slots into /
  out of a ``StateBlob`` of pinned host buffers, asynchronous on a given stream, with the
  event to wait on; the blob records its ``StateLayout`` and a mismatching layer refuses it;
- ``handoff(shard, slots, recurrent_state, conv_state, ...)``: many prefilled requests'
  states (fla's ``chunk_kda`` final state, either layout) and conv windows into decode
  pages on the device (the state pages in one launch); ``prefill_state`` hands decode
  pages back as a prefill's initial state.

Bad input raises ``ValueError`` naming the argument before anything is written. The slot
checks read the slot tensors on the host, except while the current stream captures a CUDA
graph (``copy_state`` and ``fold`` only: the others are never captured).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

import kda
from kda.layer import head_columns
from kda.operands import Ring
from kda.validate import HEAD_DIM

__all__ = [
    "StateBlob",
    "StateLayout",
    "copy_state",
    "export_state",
    "fold",
    "handoff",
    "import_state",
    "layout_of",
    "prefill_state",
]


@dataclass(frozen=True)
class StateLayout:
    """What a slot's bytes mean: a blob is imported only into a layer of the same layout."""

    heads: int
    window: int
    conv_dim_first: bool
    conv_dtype: torch.dtype
    state_dtype: torch.dtype
    ring_size: int  # 0: per-step state (no ring)


def layout_of(layer) -> StateLayout:
    """The ``StateLayout`` of a ``DecodeLayer``'s pools."""
    S = layer.shard
    conv = S.conv_state
    window = conv.shape[2] if S.conv_dim_first else conv.shape[1]
    ring = layer.ring.size if layer.ring is not None else 0
    return StateLayout(S.heads, window, S.conv_dim_first, conv.dtype, S.state.dtype, ring)


@dataclass
class StateBlob:
    """``count`` slots of a layer's state in host memory (pinned when exported from a GPU):
    ``state`` [n, H, 128, 128], ``conv_state`` [n, ...] (the pool's page shape), ``ring``
    (replay: the n slots' entries and counters; None per-step); ``ready``: the event that
    completes the copy that filled it (None on the CPU)."""

    layout: StateLayout
    state: torch.Tensor
    conv_state: torch.Tensor
    ring: Ring | None = None
    ready: torch.cuda.Event | None = None

    @property
    def count(self) -> int:
        return self.state.shape[0]

    def tensors(self) -> tuple:
        return (self.state, self.conv_state) + (tuple(self.ring) if self.ring is not None else ())


def _pools(layer) -> tuple:
    S = layer.shard
    return (S.state, S.conv_state) + (tuple(layer.ring) if layer.ring is not None else ())


def empty_blob(layer, count: int, *, pin: bool | None = None) -> StateBlob:
    """A blob for ``count`` slots of ``layer``'s layout (pinned by default when the pools
    are on a GPU)."""
    pools = _pools(layer)
    pin = pools[0].is_cuda if pin is None else pin
    host = [torch.empty((count, *p.shape[1:]), dtype=p.dtype, pin_memory=pin) for p in pools]
    ring = Ring(*host[2:]) if layer.ring is not None else None
    return StateBlob(layout_of(layer), host[0], host[1], ring)


def _check_slots(name, slots, layer, *, unique: bool, values: bool = True) -> None:
    """``slots``: a 1-D int32 / int64 tensor on the pool's device, each in 1..S-1 (and
    unique when written to); values read unless ``values`` is False."""
    state = layer.shard.state
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 / int64 tensor; got {slots!r}")
    if slots.dim() != 1 or slots.device != state.device:
        raise ValueError(
            f"{name} must be 1-D on {state.device}; got shape "
            f"{tuple(slots.shape)} on {slots.device}"
        )
    if not values:
        return
    pages, host = state.shape[0], slots.cpu()
    if host.numel() and (int(host.min()) < 1 or int(host.max()) >= pages):
        raise ValueError(
            f"{name} must be in 1..{pages - 1} (page 0 is the padding page); "
            f"got {int(host.min())}..{int(host.max())}"
        )
    if unique and host.unique().numel() != host.numel():
        raise ValueError(f"{name}: a slot is named twice (each is written once)")


def copy_state(layer, src, dst, *, live=None) -> None:
    """Copy slot ``src[p]`` of ``layer`` into slot ``dst[p]`` ([P] int32 on the pool's
    device; a slot <= 0 makes the pair padding): state page, conv page and (replay) ring
    entries and counters, bit for bit; ``live``: the current step's slots, no destination
    among them. ``kda.copy_state``: one launch, capturable."""
    S = layer.shard
    kda.copy_state(S.state, S.conv_state, src, dst, ring=layer.ring, live=live)


def fold(layer, slots, accepted=None) -> None:
    """Replay mode: fold the rings of ``slots`` ([n] int32; <= 0 padding) into their pages
    (``accepted``: pending entries to commit first), ``kda.fold``: one launch, capturable,
    bitwise ``kda.reference.materialize``."""
    if layer.ring is None:
        raise ValueError(
            "fold: the layer keeps per-step state (kda_state='per-step'); there is no ring to fold"
        )
    S = layer.shard
    kda.fold(
        S.state,
        layer.ring,
        S.a_log,
        S.dt_bias,
        slots,
        lower_bound=layer.lower_bound,
        accepted=accepted,
        gate_form=layer.gate_form,
    )


def _check_blob(name, blob, layer, count) -> None:
    if not isinstance(blob, StateBlob):
        raise ValueError(f"{name} must be an engine.state.StateBlob; got {type(blob).__name__}")
    want = layout_of(layer)
    for f in fields(StateLayout):
        got, mine = getattr(blob.layout, f.name), getattr(want, f.name)
        if got != mine:
            raise ValueError(
                f"{name}: its {f.name} is {got}, the layer's {mine} (another layout: refused)"
            )
    if blob.count != count:
        raise ValueError(f"{name} holds {blob.count} slots; {count} given")
    pools = _pools(layer)
    host = blob.tensors()
    if len(host) != len(pools):
        raise ValueError(f"{name}: its ring does not match the layer's")
    for pool, t in zip(pools, host, strict=True):
        if t.shape[1:] != pool.shape[1:] or t.dtype != pool.dtype or t.device.type != "cpu":
            raise ValueError(
                f"{name}: a host tensor of shape {tuple(t.shape)} {t.dtype} on "
                f"{t.device} does not fit pages {tuple(pool.shape[1:])} "
                f"{pool.dtype}"
            )


def _side(stream, device):
    current = torch.cuda.current_stream(device)
    stream = current if stream is None else stream
    stream.wait_stream(current)  # the pages as the work queued so far leaves them
    return stream


def export_state(layer, slots, out: StateBlob | None = None, *, stream=None) -> StateBlob:
    """Copy ``slots`` ([n] int32 / int64 on the pool's device, in 1..S-1) of ``layer`` into
    a blob of pinned host buffers (``out``, reused, or a new one): on the GPU one gather per
    pool and one device-to-host copy each, queued on ``stream`` (default the current one)
    after the work already queued on the current stream; ``blob.ready`` is the event that
    completes them (wait on it before reading the blob, and before writing those slots
    again). Replay slots are exported with their rings (not folded)."""
    _check_slots("slots", slots, layer, unique=False)
    count = slots.shape[0]
    if out is None:
        out = empty_blob(layer, count)
    else:
        _check_blob("out", out, layer, count)
    pools, index = _pools(layer), slots.long()
    if not pools[0].is_cuda:
        for pool, host in zip(pools, out.tensors(), strict=True):
            torch.index_select(pool, 0, index, out=host)
        out.ready = None
        return out
    stream = _side(stream, pools[0].device)
    with torch.cuda.stream(stream):
        index = slots.long()
        for pool, host in zip(pools, out.tensors(), strict=True):
            host.copy_(pool.index_select(0, index), non_blocking=True)
        out.ready = torch.cuda.Event()
        out.ready.record(stream)
    slots.record_stream(stream)
    return out


def import_state(layer, slots, blob: StateBlob, *, stream=None, live=None):
    """Copy ``blob``'s slots into ``slots`` of ``layer`` ([n] int32 / int64, unique, in
    1..S-1, none in ``live``): one host-to-device copy per pool and one scatter each, queued
    on ``stream`` (default the current one) after the current stream's work; returns the
    event that completes them (None on the CPU): the next step must wait on it. A blob of
    another layout (heads, window, conv layout or dtype, state dtype, ring size) is refused
    before anything is copied."""
    _check_slots("slots", slots, layer, unique=True)
    _check_blob("blob", blob, layer, slots.shape[0])
    if live is not None:
        busy = set(slots.tolist()).intersection(live.cpu().flatten().tolist())
        if busy:
            raise ValueError(f"slots: slot {min(busy)} is live in the current step")
    pools = _pools(layer)
    if not pools[0].is_cuda:
        for pool, host in zip(pools, blob.tensors(), strict=True):
            pool.index_copy_(0, slots.long(), host)
        return None
    stream = _side(stream, pools[0].device)
    with torch.cuda.stream(stream):
        index = slots.long()
        for pool, host in zip(pools, blob.tensors(), strict=True):
            pool.index_copy_(0, index, host.to(pool.device, non_blocking=True))
        done = torch.cuda.Event()
        done.record(stream)
    slots.record_stream(stream)
    return done


def _prefill_heads(recurrent_state, shard, rank, tp):
    H = recurrent_state.shape[1] if isinstance(recurrent_state, torch.Tensor) else -1
    want = (H, HEAD_DIM, HEAD_DIM)
    if H < 1 or recurrent_state.dim() != 4 or tuple(recurrent_state.shape[1:]) != want:
        got = getattr(recurrent_state, "shape", type(recurrent_state).__name__)
        raise ValueError(f"recurrent_state must be [N, H, 128, 128]; got {got}")
    if recurrent_state.dtype != torch.float32:
        raise ValueError(f"recurrent_state must be fp32; got {recurrent_state.dtype}")
    if H % tp or not 0 <= rank < tp or H // tp != shard.heads:
        raise ValueError(
            f"recurrent_state: {H} heads cannot give rank {rank} of TP {tp} the "
            f"shard's {shard.heads}"
        )
    return rank * shard.heads, shard.heads


def handoff(
    shard,
    slots,
    recurrent_state,
    conv_state,
    *,
    rank=0,
    tp=1,
    state_v_first=True,
    ring: Ring | None = None,
) -> None:
    """Hand N prefilled requests over to decode pages ``slots`` ([N] int32 / int64 on the
    pool's device, unique, in 1..S-1; request i -> ``slots[i]``): ``recurrent_state``
    [N, H, 128, 128] fp32, V-first ([value row, key]: fla's ``state_v_first=True``, vLLM's,
    this runtime's) or, with ``state_v_first=False``, fla's default [key, value] (transposed
    here); rank ``rank`` of TP ``tp`` takes its heads. ``conv_state``: fla's (q, k, v)
    windows, each [N, H*128, W >= 3] (the last W inputs); their last three become the conv
    page's positions 0..2, the rest of the page zeroed. With ``ring`` (a replay layer's) the
    slots' counters are emptied. On the device: the state pages in one launch (an index copy
    from the strided view), the conv pages in three; ``engine.load.admit_prefill`` bit for
    bit for each request."""
    first, count = _prefill_heads(recurrent_state, shard, rank, tp)
    N = recurrent_state.shape[0]
    if not isinstance(slots, torch.Tensor) or tuple(slots.shape) != (N,):
        raise ValueError(
            f"slots must be [N] = [{N}] (one per prefilled request); got "
            f"{getattr(slots, 'shape', type(slots).__name__)}"
        )
    layer = _Pools(shard, ring)
    _check_slots("slots", slots, layer, unique=True)
    if not isinstance(conv_state, tuple | list) or len(conv_state) != 3:
        raise ValueError("conv_state must be fla's (q, k, v) conv windows")
    D = recurrent_state.shape[1] * HEAD_DIM
    for name, c in zip("qkv", conv_state, strict=True):
        if not isinstance(c, torch.Tensor) or c.dim() != 3 or c.shape[:2] != (N, D):
            raise ValueError(
                f"conv_state ({name}) must be [{N}, {D}, W]; got "
                f"{getattr(c, 'shape', type(c).__name__)}"
            )
        if c.shape[2] < 3:
            raise ValueError(f"conv_state ({name}): W must be >= 3; got {c.shape[2]}")
    pages, conv, index = shard.state, shard.conv_state, slots.long()
    source = recurrent_state.narrow(1, first, count)
    source = source if state_v_first else source.transpose(-1, -2)
    # one launch: the strided gather (a bf16 pool: the prefill state rounded once, RNE)
    pages.index_copy_(0, index, source.to(pages.device, pages.dtype))
    cols = head_columns(first, count).to(conv_state[0].device)
    taps = torch.cat([c.index_select(1, cols)[:, :, -3:] for c in conv_state], dim=1)
    taps = taps.to(conv.device, conv.dtype)  # [N, 3D, 3]
    conv.index_fill_(0, index, 0)
    if shard.conv_dim_first:
        conv.narrow(2, 0, 3).index_copy_(0, index, taps)
    else:
        conv.narrow(1, 0, 3).index_copy_(0, index, taps.transpose(1, 2))
    if ring is not None:
        ring.length.index_fill_(0, index, 0)


class _Pools:
    """A shard and its ring where the slot checks take a layer."""

    def __init__(self, shard, ring):
        self.shard, self.ring = shard, ring


def prefill_state(layer, slots, *, state_v_first=True, accepted=None) -> torch.Tensor:
    """Hand decode pages back to a (chunked) prefill: ``slots``' state pages as
    [n, H, 128, 128] fp32, V-first (fla's ``state_v_first=True``) or [key, value] with
    ``state_v_first=False``, for ``initial_state``. Replay mode folds the slots' rings
    first (``accepted`` as ``fold``'s), so the pages hold the plain state."""
    _check_slots("slots", slots, layer, unique=True)
    if layer.ring is not None:
        fold(layer, slots.int(), accepted)
    pages = layer.shard.state.index_select(0, slots.long()).float()  # bf16 pages: exact
    return pages if state_v_first else pages.transpose(-1, -2).contiguous()
