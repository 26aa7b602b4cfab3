"""Argument checks for a KDA decode step, shared by the reference and the kernels.

Every check raises ``ValueError`` naming the argument, before anything is written.
Always: shapes, dtypes, devices and the scalars (``gate_form`` one of ``GATE_FORMS``;
``lower_bound`` finite <= 0 with the lower-bound gate, None with softplus; ``scale`` finite
> 0, ``eps`` finite >= 0). The value checks (slots in range, ``accepted`` in 1..T,
no page shared by two live requests) read the index tensors on the host; kernels run them
outside CUDA-graph capture. The checked mode (``validate="full"``, or ``KDA_VALIDATE=full``
in the environment) also refuses non-finite values in what the step reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpcomm.checks import capturing, check_finite, check_real, check_tensor, mode

from .dispatch import CLUSTERS, GATE_MODES, KERNELS, REPLAY_KERNELS
from .operands import MAX_RING, MIN_RING, DecodeOperands, RecoverOperands, Ring

HEAD_DIM = 128
MAX_TOKENS = 8
CONV_TAPS = 4
GATE_RANK = 128

# The map from the raw gate to the decay (``kda.reference``'s module docstring):
# "lower-bound" exp(lower_bound * sigmoid(exp(a_log) * (g + dt_bias))) (Kimi K3),
# "softplus" exp(-exp(a_log) * softplus(g + dt_bias)) (fla's lower_bound=None, Kimi-Linear).
GATE_FORMS = ("lower-bound", "softplus")

_FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)
# State pool dtypes: fp32 or bf16 pages, in the reference and every kernel (arithmetic in
# fp32: a bf16 page is widened on load and rounded to nearest-even once where the fp32 path
# stores, see docs/contract.md "bf16 state pages").
STATE_DTYPES = (torch.float32, torch.bfloat16)
KERNEL_STATE_DTYPES = STATE_DTYPES
__all__ = [
    "CONV_TAPS",
    "GATE_FORMS",
    "GATE_RANK",
    "HEAD_DIM",
    "KERNEL_STATE_DTYPES",
    "MAX_TOKENS",
    "STATE_DTYPES",
    "DecodeShape",
    "RecoverShape",
    "capturing",
    "check_decode",
    "check_decode_finite",
    "check_gate_form",
    "check_kernel_state",
    "check_options",
    "check_out",
    "check_pages_shared",
    "check_recover",
    "check_ring",
    "check_ring_finite",
    "check_scalars",
    "check_slot_values",
    "mode",
    "step_slots",
]


def check_pages_shared(reads, writes) -> None:
    """No page written by one live request is read or written by another: ``reads`` and
    ``writes`` are per request lists of state pages (a race, and a torn page, otherwise)."""
    owner: dict[int, int] = {}
    for b, pages in enumerate(writes):
        for p in set(pages):
            if p in owner and owner[p] != b:
                raise ValueError(
                    f"slots: requests {owner[p]} and {b} both write state page {p} "
                    "(live slots must be unique across requests)"
                )
            owner[p] = b
    for b, pages in enumerate(reads):
        for p in set(pages):
            if owner.get(p, b) != b:
                raise ValueError(
                    f"slots: request {b} reads state page {p} that request {owner[p]} writes "
                    "(live slots must be unique across requests)"
                )


@dataclass(frozen=True)
class DecodeShape:
    """Static shape of a step: requests, tokens, local heads, channels, window, pools."""

    requests: int
    tokens: int
    heads: int
    window: int
    state_pages: int
    conv_pages: int
    has_bias: bool
    record: bool
    conv_dim_first: bool

    @property
    def dim(self) -> int:
        return self.heads * HEAD_DIM

    @property
    def rows(self) -> int:
        return self.requests * self.tokens


def _tensor(name, t, dtypes, ndim=None, shape=None, device=None):
    check_tensor(name, t, dtypes, shape=shape, ndim=ndim, device=device)


def check_decode(op: DecodeOperands, *, check_values=True, full=False) -> DecodeShape:
    """Validate a decode step's arguments; returns its ``DecodeShape``. ``full``: the
    checked mode's non-finite scan of what the step reads (needs ``check_values``)."""
    x, conv_weight, conv_bias, conv_state = op.x, op.conv_weight, op.conv_bias, op.conv_state
    f_a, beta, a_log, dt_bias, slots = op.f_a, op.beta, op.a_log, op.dt_bias, op.slots
    state, gate, norm_weight, f_b = op.state, op.gate, op.norm_weight, op.f_b
    accepted, conv_dim_first, records = op.accepted, op.conv_dim_first, op.records
    check_scalars(op)
    if not isinstance(conv_dim_first, bool):
        raise ValueError(f"conv_dim_first must be a bool; got {conv_dim_first!r}")
    _tensor("state", state, STATE_DTYPES, ndim=4)
    pages, heads, rows_v, keys = state.shape
    if rows_v != HEAD_DIM or keys != HEAD_DIM:
        raise ValueError(f"state must be [S, H, 128, 128] (head dim 128); got {tuple(state.shape)}")
    if heads < 1 or pages < 1:
        raise ValueError(
            f"state must have at least one page and one head; got {tuple(state.shape)}"
        )
    device = state.device
    dim = heads * HEAD_DIM

    _tensor("slots", slots, (torch.int32,), device=device)
    if slots.dim() not in (1, 2) or slots.shape[0] < 1:
        raise ValueError(f"slots must be [B] or [B, >= T] with B >= 1; got {tuple(slots.shape)}")
    requests = slots.shape[0]
    _tensor("x", x, (torch.bfloat16,), ndim=2, device=device)
    if x.shape[1] != 3 * dim:
        raise ValueError(f"x must be [B*T, 3*H*128] = [*, {3 * dim}]; got {tuple(x.shape)}")
    if x.shape[0] % requests != 0 or x.shape[0] == 0:
        raise ValueError(f"x rows ({x.shape[0]}) must be a multiple of the requests ({requests})")
    tokens = x.shape[0] // requests
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens per request (x rows / requests) must be in 1..8; got {tokens}")
    if slots.dim() == 1 and tokens != 1:
        raise ValueError(f"slots must be [B, >= T] for T = {tokens} > 1; got {tuple(slots.shape)}")
    if slots.dim() == 2 and slots.shape[1] < tokens:
        raise ValueError(f"slots must have >= T = {tokens} columns; got {tuple(slots.shape)}")
    rows = requests * tokens

    _tensor("conv_weight", conv_weight, _FLOAT_IN, shape=(3, CONV_TAPS, dim), device=device)
    if conv_bias is not None:
        _tensor("conv_bias", conv_bias, _FLOAT_IN, shape=(3 * dim,), device=device)
    _tensor("conv_state", conv_state, (torch.bfloat16, torch.float32), ndim=3, device=device)
    if conv_dim_first:
        conv_pages, channels, window = conv_state.shape
    else:
        conv_pages, window, channels = conv_state.shape
    if channels != 3 * dim:
        layout = "[S, 3D, W]" if conv_dim_first else "[S, W, 3D]"
        raise ValueError(
            f"conv_state must be {layout} with 3D = {3 * dim}; got {tuple(conv_state.shape)}"
        )
    if window < tokens + 2:
        raise ValueError(f"conv_state window W = {window} must be >= T + 2 = {tokens + 2}")
    _tensor("f_a", f_a, (torch.bfloat16,), shape=(rows, GATE_RANK), device=device)
    _tensor("beta", beta, _FLOAT_IN, shape=(rows, heads), device=device)
    _tensor("a_log", a_log, (torch.float32,), shape=(heads,), device=device)
    _tensor("dt_bias", dt_bias, (torch.float32,), shape=(dim,), device=device)
    _tensor("gate", gate, (torch.bfloat16,), shape=(rows, dim), device=device)
    _tensor("norm_weight", norm_weight, _FLOAT_IN, shape=(HEAD_DIM,), device=device)
    _tensor("f_b", f_b, (torch.bfloat16,), shape=(dim, GATE_RANK), device=device)

    if accepted is not None:
        if tokens == 1:
            raise ValueError("accepted must be None for single-token decode (T = 1)")
        _tensor("accepted", accepted, (torch.int32,), shape=(requests,), device=device)
    elif tokens > 1:
        raise ValueError(f"accepted ([B] int32) is required for verify steps (T = {tokens})")
    record = records is not None
    if record:
        if tokens == 1:
            raise ValueError("records must be None for single-token decode (T = 1)")
        if not isinstance(records, tuple | list) or len(records) != 2:
            raise ValueError("records must be a (v_records, kg_records) pair")
        _check_records(*records, requests, heads, tokens, device)

    if check_values:
        check_slot_values(slots, accepted, tokens, pages, conv_pages, record=record)
        if full:
            check_decode_finite(op, tokens, conv_dim_first)
    return DecodeShape(
        requests=requests,
        tokens=tokens,
        heads=heads,
        window=window,
        state_pages=pages,
        conv_pages=conv_pages,
        has_bias=conv_bias is not None,
        record=record,
        conv_dim_first=bool(conv_dim_first),
    )


def check_kernel_state(state, entry) -> str:
    """The GPU launchers' pool dtype: fp32 or bf16 (``KERNEL_STATE_DTYPES``), else a
    ``ValueError`` naming ``state`` (before the CUDA-device check). Returns the kernels'
    ``state_dtype``: "fp32" or "bf16" (a compile-time property of the kernel)."""
    if isinstance(state, torch.Tensor) and state.dtype not in KERNEL_STATE_DTYPES:
        raise ValueError(
            f"state must be float32 or bfloat16 state pages ({entry}); got {state.dtype}"
        )
    check_tensor("state", state, KERNEL_STATE_DTYPES)
    return "bf16" if state.dtype == torch.bfloat16 else "fp32"


def check_options(kernel="auto", cluster=None, gate_mode=3, pdl=False, validate=None) -> bool:
    """The kernels' options (``kda.decode``'s; ``kda.recover`` takes ``pdl`` and
    ``validate``): ``kernel`` of ``KERNELS``, ``cluster`` (KdaSplit's CTAs per item) only
    with ``kernel="split"``, ``gate_mode`` 0, 1 or 3, ``pdl`` a bool, ``validate`` a mode
    (``tpcomm.checks.mode``). Returns whether the checked mode is on."""
    full = mode(validate) == "full"
    if not isinstance(pdl, bool):
        raise ValueError(f"pdl must be a bool; got {pdl!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
    if cluster is not None and (kernel != "split" or cluster not in CLUSTERS):
        raise ValueError(
            f"cluster must be None or one of {CLUSTERS} with kernel='split'; "
            f"got cluster={cluster!r}, kernel={kernel!r}"
        )
    if gate_mode not in GATE_MODES or isinstance(gate_mode, bool):
        raise ValueError(f"gate_mode must be 0, 1 or 3; got {gate_mode!r}")
    return full


def check_replay_kernel(kernel) -> None:
    """``kda.replay_decode``'s ``kernel``: one of ``REPLAY_KERNELS``."""
    if not isinstance(kernel, str) or kernel not in REPLAY_KERNELS:
        raise ValueError(f"kernel must be one of {REPLAY_KERNELS}; got {kernel!r}")


def check_out(out, shape: DecodeShape, device) -> None:
    """``kda.decode``'s output: a contiguous ``[B*T, D]`` bf16 tensor on ``device``."""
    B, T, D = shape.requests, shape.tokens, shape.dim
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != torch.bfloat16
        or tuple(out.shape) != (B * T, D)
        or not out.is_contiguous()
        or out.device != device
    ):
        raise ValueError(f"out must be a contiguous [{B * T}, {D}] bf16 tensor on {device}")


def step_slots(slots, accepted, tokens):
    """Per request: (state slot read, conv slot, window offset) as CPU int64 tensors."""
    s = slots.detach().to("cpu", torch.int64)
    if tokens == 1:
        slot = s if s.dim() == 1 else s[:, 0]
        return slot, slot.clone(), torch.zeros_like(slot)
    offset = accepted.detach().to("cpu", torch.int64) - 1
    slot = s.gather(1, offset.clamp(0, s.shape[1] - 1)[:, None])[:, 0]
    return slot, s[:, 0].clone(), offset


def _check_records(v_records, kg_records, requests, heads, tokens, device):
    """v_records [B, H, T, 128] fp32 and kg_records [B, H, T, 256] bf16 (k, raw gate)."""
    shape = (requests, heads, tokens, HEAD_DIM)
    _tensor("v_records", v_records, (torch.float32,), shape=shape, device=device)
    shape = (requests, heads, tokens, 2 * HEAD_DIM)
    _tensor("kg_records", kg_records, (torch.bfloat16,), shape=shape, device=device)


def check_gate_form(gate_form, lower_bound) -> float:
    """``gate_form`` one of ``GATE_FORMS``; ``lower_bound`` finite <= 0 (a decay <= 1) with
    "lower-bound", None with "softplus" (which has no bound). Returns the kernels'
    ``lower_bound`` scalar (0.0 for softplus: compiled out). ValueError naming the argument."""
    if not isinstance(gate_form, str) or gate_form not in GATE_FORMS:
        raise ValueError(f"gate_form must be one of {GATE_FORMS}; got {gate_form!r}")
    if gate_form == "softplus":
        if lower_bound is not None:
            raise ValueError(
                "lower_bound must be None with gate_form='softplus' (it has no bound); "
                f"got {lower_bound!r}"
            )
        return 0.0
    if lower_bound is None:
        raise ValueError(
            "lower_bound must be a finite real number <= 0 with gate_form='lower-bound'"
        )
    return check_real("lower_bound", lower_bound, high=0.0)


def check_scalars(op) -> None:
    """``gate_form`` and ``lower_bound`` (``check_gate_form``); decode's ``scale`` finite > 0
    and ``eps`` finite >= 0."""
    check_gate_form(op.gate_form, op.lower_bound)
    if isinstance(op, DecodeOperands):
        check_real("scale", op.scale, low=0.0, low_open=True)
        check_real("eps", op.eps, low=0.0)


def check_decode_finite(op: DecodeOperands, tokens, conv_dim_first, pages=None) -> None:
    """Checked mode: every value the step reads is finite (live rows and pages only).
    ``pages`` [B]: the state page each request reads (default ``step_slots``'s)."""
    slot, conv_slot, _ = step_slots(op.slots, op.accepted, tokens)
    slot = slot if pages is None else pages
    live = (slot > 0).nonzero()[:, 0]
    device = op.state.device
    rows = (live[:, None] * tokens + torch.arange(tokens)).reshape(-1).to(device)
    for name in ("x", "f_a", "beta", "gate"):
        check_finite(name, getattr(op, name).index_select(0, rows))
    for name in ("conv_weight", "conv_bias", "a_log", "dt_bias", "norm_weight", "f_b"):
        check_finite(name, getattr(op, name))
    check_finite("state", op.state.index_select(0, slot[live].to(device)))
    _, _, offset = step_slots(op.slots, op.accepted, tokens)
    for b in live.tolist():  # the three taps the step reads of the conv page
        page, first = op.conv_state[int(conv_slot[b])], int(offset[b])
        taps = page[:, first : first + 3] if conv_dim_first else page[first : first + 3]
        check_finite("conv_state", taps)


def check_slot_values(slots, accepted, tokens, state_pages, conv_pages, *, record=False):
    """Range checks of ``accepted`` and every slot value, and no page of a live request
    shared with another (host read). ``record``: the step writes no state page."""
    if accepted is not None:
        acc = accepted.detach().to("cpu", torch.int64)
        bad = (acc < 1) | (acc > tokens)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"accepted[{b}] = {int(acc[b])} is outside 1..T = 1..{tokens}")
    s = slots.detach().to("cpu", torch.int64)
    used = s if s.dim() == 1 else s[:, :tokens]
    over = used >= state_pages
    if bool(over.any()):
        idx = tuple(int(i) for i in over.nonzero()[0])
        raise ValueError(
            f"slots{list(idx)} = {int(used[idx])} is past the state pool ({state_pages})"
        )
    slot, conv_slot, _ = step_slots(slots, accepted, tokens)
    live = slot > 0
    dead_conv = live & (conv_slot <= 0)
    if bool(dead_conv.any()):
        b = int(dead_conv.nonzero()[0, 0])
        raise ValueError(
            f"slots[{b}, 0] = {int(conv_slot[b])} but request {b} is live "
            f"(state slot {int(slot[b])}): a live request needs a conv page"
        )
    past = live & (conv_slot >= conv_pages)
    if bool(past.any()):
        b = int(past.nonzero()[0, 0])
        raise ValueError(
            f"slots[{b}, 0] = {int(conv_slot[b])} is past the conv pool ({conv_pages})"
        )
    live_b = live.nonzero()[:, 0].tolist()
    conv_owner: dict[int, int] = {}
    for b in live_b:
        c = int(conv_slot[b])
        if c in conv_owner:
            raise ValueError(
                f"slots: requests {conv_owner[c]} and {b} both name conv page {c} "
                "(live slots must be unique across requests)"
            )
        conv_owner[c] = b
    reads = [[int(slot[b])] for b in live_b]
    if record:
        writes = [[] for _ in live_b]
    else:
        writes = [[p for p in used[b].reshape(-1).tolist() if p > 0] for b in live_b]
    check_pages_shared(reads, writes)


@dataclass(frozen=True)
class RecoverShape:
    """Static shape of a recover call: requests, recorded tokens, local heads, state pages."""

    requests: int
    tokens: int
    heads: int
    state_pages: int


def check_recover(op: RecoverOperands, *, check_values=True, full=False) -> RecoverShape:
    """Validate ``recover``'s arguments (shared by the reference and the kernel); ``full``:
    the checked mode's non-finite scan (needs ``check_values``)."""
    state, slots, v_records, kg_records = op.state, op.slots, op.v_records, op.kg_records
    a_log, dt_bias, accepted, checkpoint = op.a_log, op.dt_bias, op.accepted, op.checkpoint
    check_scalars(op)
    _tensor("state", state, STATE_DTYPES, ndim=4)
    pages, heads = state.shape[0], state.shape[1]
    if state.shape[2:] != (HEAD_DIM, HEAD_DIM):
        raise ValueError(f"state must be [S, H, 128, 128]; got {tuple(state.shape)}")
    device = state.device
    _tensor("slots", slots, (torch.int32,), ndim=2, device=device)
    requests = slots.shape[0]
    _tensor("v_records", v_records, (torch.float32,), ndim=4, device=device)
    tokens = v_records.shape[2]
    if not 2 <= tokens <= MAX_TOKENS:
        raise ValueError(
            f"v_records must be [B, H, T, 128] with T in 2..8; got {tuple(v_records.shape)}"
        )
    _check_records(v_records, kg_records, requests, heads, tokens, device)
    if slots.shape[1] < tokens:
        raise ValueError(f"slots must have >= T = {tokens} columns; got {tuple(slots.shape)}")
    _tensor("a_log", a_log, (torch.float32,), shape=(heads,), device=device)
    _tensor("dt_bias", dt_bias, (torch.float32,), shape=(heads * HEAD_DIM,), device=device)
    _tensor("accepted", accepted, (torch.int32,), shape=(requests,), device=device)
    _tensor("checkpoint", checkpoint, (torch.int32,), shape=(requests,), device=device)
    if check_values:
        for name, counts in (("accepted", accepted), ("checkpoint", checkpoint)):
            c = counts.detach().cpu()
            if bool(((c < 1) | (c > tokens)).any()):
                raise ValueError(f"{name} values must be in 1..T = 1..{tokens}; got {c.tolist()}")
        s = slots.detach().cpu().to(torch.int64)[:, :tokens]
        if bool((s >= pages).any()):
            raise ValueError(f"slots values must be below the state pool ({pages})")
        ckpt = checkpoint.detach().cpu().to(torch.int64)
        source = s.gather(1, ckpt[:, None] - 1)[:, 0]
        count = accepted.detach().cpu().tolist()
        live = [b for b in range(requests) if source[b] > 0]
        reads = [[int(source[b])] for b in live]
        writes = [[p for p in s[b, : count[b]].tolist() if p > 0] for b in live]
        check_pages_shared(reads, writes)
        if full:
            for b in live:  # the tokens a request commits
                check_finite("v_records", v_records[b, :, : count[b]])
                check_finite("kg_records", kg_records[b, :, : count[b]])
            check_finite("a_log", a_log)
            check_finite("dt_bias", dt_bias)
            check_finite("state", state.index_select(0, source[live].to(device)))
    return RecoverShape(requests=requests, tokens=tokens, heads=heads, state_pages=pages)


def check_ring(ring, state: torch.Tensor, tokens: int = 1, slots=None) -> int:
    """Validate ``ring`` against the state pool (and, with ``slots``, the live slots'
    counters: equal across heads, committed + pending <= R, slots unique); returns R.

    The ring's dtypes are fixed whatever the pool's (fp32 or bf16): ``ring.v`` fp32 (the
    step's fp32 ``v_new``, never rounded to the pool's dtype), ``ring.kg`` bf16, ``ring.length``
    int32. A ring in the pool's dtype (``ring.v`` bf16 beside a bf16 pool) is refused."""
    if not isinstance(ring, Ring):
        raise ValueError(f"ring must be a kda.operands.Ring; got {type(ring).__name__}")
    pages, heads = state.shape[:2]
    v_dtype = getattr(ring.v, "dtype", None)
    if isinstance(ring.v, torch.Tensor) and v_dtype != torch.float32:
        raise ValueError(
            f"ring.v must be float32 whatever the state pool's dtype ({state.dtype}); got "
            f"{v_dtype} (only the checkpoint pages take the pool's dtype)"
        )
    check_tensor("ring.v", ring.v, (torch.float32,), ndim=4, device=state.device)
    size = ring.v.shape[1]
    if not MIN_RING <= size <= MAX_RING:
        raise ValueError(f"ring.v must hold {MIN_RING}..{MAX_RING} entries; got {size}")
    shape = (pages, size, heads, HEAD_DIM)
    check_tensor("ring.v", ring.v, (torch.float32,), shape=shape, device=state.device)
    shape = (pages, size, heads, 2 * HEAD_DIM)
    check_tensor("ring.kg", ring.kg, (torch.bfloat16,), shape=shape, device=state.device)
    shape = (pages, heads, 2)
    check_tensor("ring.length", ring.length, (torch.int32,), shape=shape, device=state.device)
    if tokens > size:
        raise ValueError(f"ring size R = {size} must be >= the step's tokens T = {tokens}")
    if slots is not None:
        live = slots[slots > 0]
        if live.unique().numel() != live.numel():
            raise ValueError(
                "slots: two live requests name the same state slot (live slots must be "
                "unique across requests)"
            )
        counts = ring.length.cpu()[live]  # [L, H, 2]
        split = (counts != counts[:, :1]).any(2).any(1)
        if split.any():
            s = int(live[split.nonzero()[0, 0]])
            raise ValueError(f"ring.length[{s}]: the heads' counters differ (they move together)")
        counts = counts[:, 0]
        bad = (counts < 0).any(1) | (counts.sum(1) > size)
        if bad.any():
            s = int(live[bad.nonzero()[0, 0]])
            raise ValueError(
                f"ring.length[{s}] = {counts[bad][0].tolist()}: committed and pending must be "
                f">= 0 with committed + pending <= R = {size}"
            )
    return size


def check_ring_finite(ring, slots) -> None:
    """Checked mode: the ring entries (committed and pending) of the live ``slots`` are
    finite."""
    for s in slots[slots > 0].tolist():
        held = int(ring.length[s, 0].sum())
        check_finite("ring.v", ring.v[s, :held])
        check_finite("ring.kg", ring.kg[s, :held])


def check_replay(op: DecodeOperands, ring, *, check_values=True, full=False):
    """Validate a replay step's arguments (shared by ``kda.reference.replay_decode`` and
    ``kda.replay_decode``): ``check_decode``'s checks, no records, ``check_ring`` (the live
    slots' counters too with ``check_values``), and with ``full`` the non-finite scan of the
    checkpoint pages and held ring entries. Returns (``DecodeShape``, R)."""
    if op.records is not None:
        raise ValueError("records must be None in replay decode (the ring holds the records)")
    shape = check_decode(op, check_values=check_values)
    slot = None
    if check_values:
        _, slot, _ = step_slots(op.slots, op.accepted, shape.tokens)
    size = check_ring(ring, op.state, shape.tokens, slot)
    if full and check_values:
        check_decode_finite(op, shape.tokens, op.conv_dim_first, pages=slot)
        check_ring_finite(ring, slot)
    return shape, size
