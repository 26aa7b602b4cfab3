"""Mailbox and twoshot layouts: every byte offset of the protocol is defined here.

Mailbox (one-shot all-reduce)
    ``[2 parity, TP, rows, HID]`` bf16 in symmetric memory on every rank (rows: the
    step's tokens, 1..``MAX_ROWS``; every buffer is sized per rows bucket); slot
    ``[p, r]`` holds rank r's partial for a step of parity ``p = step & 1``. The unit of
    publication is a 16-byte group (8 bf16 = four 32-bit words): a group is *published*
    when none of its words equals ``SENTINEL`` (0xFFFFFFFF); an empty (armed) mailbox is
    all sentinel words. Producers replace a data word equal to the sentinel (two bf16
    0xFFFF NaNs) by ``CANONICAL_NAN_WORD`` (two quiet NaNs 0x7FC0) before storing; other
    words, other NaNs included, are stored unchanged. The consumer polls until all its
    groups are published, sums them in rank order in fp32 starting from rank 0's value,
    rounds once to bf16, then re-arms the groups it read. Double-buffering by parity
    keeps a fast peer's next step out of the slot being re-armed.

Twoshot
    Rank s owns columns ``[s*HID/TP, (s+1)*HID/TP)``. Receive view on rank s:
    ``[2 parity, TP, tokens, HID/TP]`` (slot r = rank r's shard s). Gather row on every
    rank: ``[2 parity, tokens, HID]``, one slot: rank s writes its reduced shard into
    columns of shard s of every rank's gather row; consumers poll that single slot.

This module is plain Python + torch (CPU-safe). ``Mailbox`` and ``TwoshotRows`` build
the buffers on any ``tpcomm.symm`` backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpcomm.checks import is_int

SENTINEL = 0xFFFFFFFF
CANONICAL_NAN_WORD = 0x7FC07FC0
GROUP_ELEMS = 8  # bf16 per 16-byte group
HID_STEP = 256  # a hidden width is whole warps of 16-byte groups: 32 threads x 8 columns
COLUMNS_PER_CTA = 1024  # the plain all-reduce's CTA: 128 threads x one group each
CTA_THREADS = COLUMNS_PER_CTA // GROUP_ELEMS
ALLREDUCE_BLOCKS_PER_SM = 8  # the all-reduce kernel's launch bound (<= 64 registers a thread)
MAX_TP = 16
MAX_ROWS = 1024  # rows (tokens) of one step: mailboxes, receive views, gather rows
MAX_TOKENS = 8  # rows the mma.sync producer (N = 8) and the fused kernel take
MAX_HID = 8192
POLL_CHUNK = 4  # mailbox slots a thread polls together (registers: 16 words)
DEFAULT_BUDGET_NS = 50_000_000  # a poll's budget: far above any healthy step, far below a hang


def parity(step: int) -> int:
    """Mailbox half used by ``step`` (0 or 1)."""
    if not is_int(step) or step < 0:
        raise ValueError(f"step must be an int >= 0; got {step!r}")
    return step & 1


def check_tp_hid(tp: int, hid: int) -> None:
    """TP group size 1..MAX_TP and a hidden width of whole 256-column warps."""
    if not is_int(tp) or not 1 <= tp <= MAX_TP:
        raise ValueError(f"tp must be an int in 1..{MAX_TP}; got {tp!r}")
    if not is_int(hid) or hid % HID_STEP or not 0 < hid <= MAX_HID:
        raise ValueError(f"hid must be a multiple of {HID_STEP} up to {MAX_HID}; got {hid!r}")


@dataclass(frozen=True)
class _Rows:
    """What both layouts hold: ``tp`` ranks' ``tokens`` rows of ``hid`` columns, checked."""

    tp: int
    tokens: int
    hid: int

    def __post_init__(self):
        check_tp_hid(self.tp, self.hid)
        if not is_int(self.tokens) or not 1 <= self.tokens <= MAX_ROWS:
            raise ValueError(f"tokens (rows) must be an int in 1..{MAX_ROWS}; got {self.tokens!r}")


@dataclass(frozen=True)
class MailboxLayout(_Rows):
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.tp, self.tokens, self.hid)

    @property
    def numel(self) -> int:
        return 2 * self.tp * self.tokens * self.hid

    @property
    def nbytes(self) -> int:
        return 2 * self.numel

    def offset(self, step: int, rank: int, token: int, column: int) -> int:
        """Element offset of ``[parity(step), rank, token, column]``."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank must be in 0..{self.tp - 1}; got {rank}")
        if not 0 <= token < self.tokens:
            raise ValueError(f"token must be in 0..{self.tokens - 1}; got {token}")
        if not 0 <= column < self.hid:
            raise ValueError(f"column must be in 0..{self.hid - 1}; got {column}")
        return ((parity(step) * self.tp + rank) * self.tokens + token) * self.hid + column

    def slot(self, buffer: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        """The ``[tokens, HID]`` slot of ``rank`` for ``step`` in a mailbox buffer."""
        return buffer.view(self.shape)[parity(step), rank]


@dataclass(frozen=True)
class TwoshotLayout(_Rows):
    def __post_init__(self):
        super().__post_init__()
        if self.hid % (self.tp * GROUP_ELEMS):
            raise ValueError(
                f"hid must split into tp shards of whole 16-byte groups; got hid={self.hid}, "
                f"tp={self.tp}"
            )

    @property
    def shard(self) -> int:
        return self.hid // self.tp

    @property
    def receive_shape(self) -> tuple[int, int, int, int]:
        return (2, self.tp, self.tokens, self.shard)

    @property
    def gather_shape(self) -> tuple[int, int, int]:
        return (2, self.tokens, self.hid)

    def owner(self, column: int) -> int:
        """Rank that reduces ``column``."""
        if not 0 <= column < self.hid:
            raise ValueError(f"column must be in 0..{self.hid - 1}; got {column}")
        return column // self.shard

    def columns(self, rank: int) -> slice:
        return slice(rank * self.shard, (rank + 1) * self.shard)

    @property
    def nbytes(self) -> int:
        """Bytes on every rank: receive view plus gather row (both ``2 * tokens * HID``)."""
        return 2 * (2 * self.tokens * self.hid) * 2


# --- host-side word operations (the device does the same in tpcomm.protocol) ------------


def _words(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.bfloat16:
        raise ValueError(f"tensor must be bf16; got {t.dtype}")
    if t.numel() % GROUP_ELEMS or not t.is_contiguous():
        raise ValueError("tensor must be contiguous with a multiple of 8 elements")
    return t.view(torch.int32)


def arm(t: torch.Tensor) -> torch.Tensor:
    """Fill a mailbox buffer (or part) with the sentinel, in place."""
    _words(t).fill_(-1)
    return t


def canonicalize(t: torch.Tensor) -> torch.Tensor:
    """Copy of ``t`` with every sentinel word replaced by two canonical NaNs."""
    out = t.clone()
    w = _words(out)
    w[w == -1] = CANONICAL_NAN_WORD
    return out


def published(t: torch.Tensor) -> torch.Tensor:
    """Per 16-byte group: True when none of its four words is the sentinel."""
    return (_words(t).view(-1, 4) != -1).all(dim=1)


def grouped_sum(partials: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``[TP, ...]`` bf16 -> fp32, not rounded: with ``S = ceil(TP / groups)`` group g sums
    ranks ``g*S ..`` in rank order from its first rank's value; the group sums are added in
    group order (an empty group adds +0.0). ``groups = 1``: the plain rank-order sum."""
    tp = partials.shape[0]
    per = -(-tp // groups)
    p = partials.float()
    total = None
    for g in range(groups):
        first, count = g * per, min(per, tp - g * per)
        if count <= 0:
            part = torch.zeros_like(p[0])
        else:
            part = p[first]
            for r in range(first + 1, first + count):
                part = part + p[r]
        total = part if total is None else total + part
    return total


def rank_order_sum(partials: torch.Tensor) -> torch.Tensor:
    """``[TP, ...]`` bf16 -> bf16: fp32 sum in rank order from rank 0's value, one rounding.

    Partials are canonicalised first, as the producers do.
    """
    if partials.dim() < 2 or partials.dtype != torch.bfloat16:
        raise ValueError("partials must be a bf16 tensor [TP, ...]")
    return grouped_sum(canonicalize(partials.contiguous()), groups=1).to(torch.bfloat16)


# --- buffers on a backend --------------------------------------------------------------


class Mailbox:
    """A double-buffered mailbox ``[2, TP, tokens, HID]`` on every rank of ``backend``."""

    def __init__(self, backend, tokens: int, hid: int):
        self.layout = MailboxLayout(backend.world, tokens, hid)
        self.backend = backend
        self.buffer = backend.allocate(self.layout.shape, torch.bfloat16)
        self.arm()

    def local(self, rank: int | None = None) -> torch.Tensor:
        return self.backend.local(self.buffer, rank)

    def peer(self, peer: int, rank: int | None = None) -> torch.Tensor:
        return self.backend.peer(self.buffer, peer, rank)

    def peer_pointers(self, rank: int | None = None) -> torch.Tensor:
        return self.backend.peer_pointers(self.buffer, rank)

    def multicast(self) -> torch.Tensor | None:
        return self.backend.multicast(self.buffer)

    def arm(self) -> None:
        """Re-arm every rank's whole mailbox hosted here (after an error, say), then barrier."""
        for rank in self.backend.ranks:
            arm(self.backend.local(self.buffer, rank))
        self.backend.barrier()


class TwoshotRows:
    """Twoshot receive views and one-slot gather rows on every rank of ``backend``."""

    def __init__(self, backend, tokens: int, hid: int):
        self.layout = TwoshotLayout(backend.world, tokens, hid)
        self.backend = backend
        self.receive = backend.allocate(self.layout.receive_shape, torch.bfloat16)
        self.gather = backend.allocate(self.layout.gather_shape, torch.bfloat16)
        self.arm()

    def receive_view(self, rank: int | None = None) -> torch.Tensor:
        return self.backend.local(self.receive, rank)

    def gather_row(self, rank: int | None = None) -> torch.Tensor:
        return self.backend.local(self.gather, rank)

    def arm(self) -> None:
        for rank in self.backend.ranks:
            arm(self.backend.local(self.receive, rank))
            arm(self.backend.local(self.gather, rank))
        self.backend.barrier()
