"""Plain-torch reference of one KDA decode step, in place like the kernels (SPEC "KDA").

Layout: rows are ``B*T`` (request b, token t -> row ``b*T + t``), ``D = H*128`` local
channels, state pages ``[S, H, 128 value rows, 128 keys]`` fp32 or bf16.

State pages (``kda.validate.STATE_DTYPES``): the arithmetic is fp32 whatever the pool's
dtype. A bf16 page is widened to fp32 when loaded (exact) and rounded to nearest-even once
when stored (``.to(torch.bfloat16)``), at exactly the points where an fp32 pool is stored:
a decode / verify step's per-token pages, ``recover``'s committed pages, the fold of a
replay ring into its checkpoint. Within a step the state stays fp32 (a verify step's token
t + 1 starts from token t's fp32 state, not from its rounded page). Ring entries keep their
own dtypes (``v_new`` fp32, ``k`` / raw gate bf16) whatever the pool's.

Rounding points, exactly the SPEC's:
- convolution ``acc = fma(w[t+i], coeff[i], acc)`` in fp32, then ``silu`` rounded to bf16;
- raw gate ``bf16(f_a . f_b)``; decay, beta and the q/k normalisation in fp32. The decay is
  ``exp(g)`` of the log-decay ``g`` of ``gate_form`` (an argument of every entry here):
  "lower-bound" (the default, Kimi K3) ``g = lower_bound * sigmoid(exp(a_log) * (raw_g +
  dt_bias))``; "softplus" (fla's ``lower_bound=None``, Kimi-Linear; ``lower_bound`` must
  then be None) ``g = -exp(a_log) * softplus(raw_g + dt_bias)``, softplus as torch's
  (``x`` above 20, else ``log1p(exp(x))``). ``exp``, ``sigmoid`` and ``softplus`` are
  evaluated in float64 and rounded once to fp32; the sum, the products and the sign in fp32;
- recurrence in fp32 (``S *= decay``, ``v_new = (v - S.k) * beta``, ``S = fma(k, v_new, S)``),
  ``o`` rounded to bf16; gated RMSNorm in fp32, output bf16.

Dot products and the fp32 FMAs are evaluated in float64 and rounded once to fp32 (an
fp32 product is exact in float64): the result is the exactly rounded reduction, which
is independent of tensor shapes, so a head gives the same bits whatever shard it is in.
Kernels differ from this only in the order of their fp32 reductions.

A request whose state slot is <= 0 is a padding row: its output rows are zero and no
state page, conv page or record is touched.

``replay_decode`` / ``materialize``: the same step with the state kept as a checkpoint page
plus a ring of the steps' records (read the page, write a record; write the page back only
when the ring is full).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from tpcomm.checks import check_tensor

from .operands import DecodeOperands, RecoverOperands, Ring, takes
from .validate import (
    HEAD_DIM,
    STATE_DTYPES,
    check_decode,
    check_gate_form,
    check_recover,
    check_replay,
    check_ring,
    mode,
    step_slots,
)

__all__ = ["decode", "recover", "replay_decode", "materialize", "apply_record", "copy_state"]


def _fma(a, b, c):
    """fp32 fused multiply-add: the exact product plus ``c``, rounded to fp32."""
    return (a.double() * b.double() + c.double()).float()


def _dot(a, b):
    """fp32 dot product over the last axis (exactly rounded)."""
    return (a.double() * b.double()).sum(-1).float()


def _matvec(m, v):
    """``m @ v`` over the last axis of ``m`` [..., R, K] and ``v`` [..., K], float64 then fp32."""
    return (m.double() @ v.double()[..., None])[..., 0].float()


def _exp(t):
    """fp32 ``exp``, evaluated in float64 and rounded once (torch's fp32 CPU ``exp`` differs
    by an ulp between its vectorised and scalar loops, which would make bits depend on
    tensor sizes)."""
    return torch.exp(t.double()).float()


def _sigmoid(t):
    return (1.0 / (1.0 + torch.exp(-t.double()))).float()


def _rsqrt(t):
    return torch.rsqrt(t.double()).float()


def _bf16(t):
    return t.to(torch.bfloat16).float()


def _load(pages):
    """State pages as fp32 (a bf16 page widened exactly; an fp32 one copied)."""
    return pages.to(torch.float32, copy=True)


def _store(pool, index, S) -> None:
    """``pool[index] = S`` (fp32): the single rounding of a bf16 pool (nearest-even)."""
    pool[index] = S.to(pool.dtype)


SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default (beta 1), fla's gate: x above it


def _softplus(t):
    """``x`` where ``x > 20``, else ``log1p(exp(x))``, evaluated in float64 and rounded once
    to fp32 (torch's ``F.softplus`` with beta 1, threshold 20, as fla's gate calls it). Above
    about 15 both branches round to ``x`` in fp32, so the threshold never moves a bit."""
    d = t.double()
    return torch.where(d > SOFTPLUS_THRESHOLD, d, torch.log1p(torch.exp(d))).float()


def _log_decay(raw_g, a_log, dt_bias, lower_bound, gate_form="lower-bound"):
    """The log-decay ``g`` (fp32) of raw gates [..., H, 128]: ``lower_bound * sigmoid(exp(a_log)
    * (raw_g + dt_bias))`` (``gate_form`` "lower-bound") or ``-exp(a_log) * softplus(raw_g +
    dt_bias)`` ("softplus"); each fp32 operation rounded, exp / sigmoid / softplus exactly."""
    heads = a_log.shape[0]
    a = _exp(a_log.float()).view(heads, 1)
    x = raw_g + dt_bias.float().view(heads, HEAD_DIM)
    if gate_form == "softplus":
        return -a * _softplus(x)
    return lower_bound * _sigmoid(a * x)


def _decay(raw_g, a_log, dt_bias, lower_bound, gate_form="lower-bound"):
    """``exp(g)`` of ``_log_decay``; raw_g [..., H, 128]."""
    return _exp(_log_decay(raw_g, a_log, dt_bias, lower_bound, gate_form))


def _l2(v):
    """``rsqrt(sum v^2 + 1e-6)`` over the head's 128 keys, fp32, keeping the axis."""
    return _rsqrt(_dot(v, v) + 1e-6)[..., None]


class _Prologue(NamedTuple):
    """A step's per-token vectors of the live requests (fp32; ``[T, L, H, 128]``)."""

    q_hat: torch.Tensor
    k_hat: torch.Tensor
    v: torch.Tensor
    k: torch.Tensor  # post-SiLU, pre-norm (bf16 values): the record's k
    raw_g: torch.Tensor  # [L, T, H, 128] bf16 values
    decay: torch.Tensor
    beta_t: torch.Tensor  # [T, L, H]
    taps: torch.Tensor  # [L, 3D, 3] the conv window's taps
    inputs: torch.Tensor  # [L, 3D, T] bf16: the step's x


def _prologue(op, shape, lv, conv_l, off_l, raw_gate=None) -> _Prologue:
    """Steps 1-5 of the SPEC for the live requests ``lv``: conv + SiLU, gate, decay, beta,
    normalised q and k; ``raw_gate`` ([B*T, D] bf16, optional) replaces the gate's dot."""
    x, conv_weight, conv_bias, conv_state = op.x, op.conv_weight, op.conv_bias, op.conv_state
    B, T, H, D = shape.requests, shape.tokens, shape.heads, shape.dim
    L, device = lv.numel(), op.state.device
    # 1. Convolution window [tap0, tap1, tap2, x_0 .. x_{T-1}] per channel, fp32.
    page = conv_state[conv_l]
    if not op.conv_dim_first:
        page = page.transpose(1, 2)  # [L, 3D, W]
    positions = off_l[:, None] + torch.arange(3, device=device)
    taps = page.gather(2, positions[:, None, :].expand(L, 3 * D, 3))  # [L, 3D, 3]
    inputs = x.view(B, T, 3 * D)[lv].transpose(1, 2)  # [L, 3D, T] bf16
    window = torch.cat([taps.float(), inputs.float()], dim=2)
    coeff = conv_weight.float().permute(1, 0, 2).reshape(4, 3 * D)  # coeff[i, part*D + c]
    acc = torch.zeros(L, 3 * D, T, device=device)
    if conv_bias is not None:
        acc = acc + conv_bias.float()[None, :, None]
    for i in range(4):
        acc = _fma(window[:, :, i : i + T], coeff[i][None, :, None], acc)
    act = _bf16(acc / (1.0 + _exp(-acc)))  # SiLU, bf16-rounded
    act = act.view(L, 3, H, HEAD_DIM, T).permute(1, 4, 0, 2, 3)  # [part, T, L, H, 128]
    q, k, v = act[0], act[1], act[2]

    # 2. Gate, beta, normalised q and k.
    fa = op.f_a.view(B, T, -1)[lv]  # [L, T, 128]
    if raw_gate is None:
        raw_g = _bf16((fa.double() @ op.f_b.double().T).float()).view(L, T, H, HEAD_DIM)
    else:
        raw_g = raw_gate.float().view(B, T, H, HEAD_DIM)[lv]
    decay = _decay(raw_g, op.a_log, op.dt_bias, op.lower_bound, op.gate_form).transpose(0, 1)
    beta_t = _sigmoid(op.beta.float().view(B, T, H)[lv]).transpose(0, 1)  # [T, L, H]
    q_hat = q * _l2(q) * op.scale
    k_hat = k * _l2(k)
    return _Prologue(q_hat, k_hat, v, k, raw_g, decay, beta_t, taps, inputs)


def _finish(op, shape, lv, conv_l, o, pre: _Prologue, output) -> None:
    """Steps 8-9 of the SPEC: the gated RMSNorm of ``o`` [T, L, H, 128] into ``output``,
    the conv page of each live request."""
    B, T, H, D = shape.requests, shape.tokens, shape.heads, shape.dim
    L, conv_state = lv.numel(), op.conv_state
    # 4. Gated RMSNorm over the head's 128 value rows.
    rstd = _rsqrt(_dot(o, o) * (1.0 / HEAD_DIM) + op.eps)[..., None]
    sig = _sigmoid(op.gate.float().view(B, T, H, HEAD_DIM)[lv].transpose(0, 1))
    result = ((o * rstd) * op.norm_weight.float()) * sig  # [T, L, H, 128]
    out = output.view(B, T, D)
    out[lv] = result.transpose(0, 1).reshape(L, T, D).to(torch.bfloat16)

    # 5. Conv page: [tap1, tap2, x_0 .. x_{T-1}] into window positions 0..T+1.
    new = torch.cat([pre.taps[:, :, 1:], pre.inputs.to(conv_state.dtype)], dim=2)
    if op.conv_dim_first:
        conv_state[conv_l, :, : T + 2] = new.to(conv_state.dtype)
    else:
        conv_state[conv_l, : T + 2, :] = new.transpose(1, 2).to(conv_state.dtype)


@takes(DecodeOperands, validate=None, o_fp32=None, o_abs=None, raw_gate=None)
def decode(*args, validate=None, o_fp32=None, o_abs=None, raw_gate=None, **kwargs):
    """One decode (T = 1) or verify (T = 2..8) step; mutates ``state`` and ``conv_state``.

    Arguments: ``kda.operands.DecodeOperands``'s fields (13 tensors, then keywords), and
    ``validate`` (``"full"``: also refuse non-finite inputs; default ``$KDA_VALIDATE``).
    Returns ``output`` [B*T, H*128] bf16. ``records=(v_records, kg_records)`` selects
    record mode: the state is read from the checkpoint slot but not written. ``o_fp32``
    and ``o_abs`` ([B*T, H*128] fp32, optional) receive ``o`` before its bf16 rounding and
    ``sum_k |S[r, k] q^[k]|`` (live rows only): tests use them to tell where a kernel's
    reduction order may flip that rounding (within the sum's error bound of a midpoint).
    ``raw_gate`` ([B*T, H*128] bf16, optional) is used instead of ``bf16(f_a . f_b)``: tests
    of the seed-order gate modes feed a kernel's own raw gate (its ``kg_records``).
    ``state``: fp32 or bf16 pages (module docstring: one rounding per stored page).
    """
    full = mode(validate) == "full"
    op = DecodeOperands(*args, **kwargs)
    shape = check_decode(op, full=full)
    state, slots, accepted, records = op.state, op.slots, op.accepted, op.records
    B, T, H = shape.requests, shape.tokens, shape.heads
    D, device = shape.dim, state.device
    if raw_gate is not None:
        check_tensor("raw_gate", raw_gate, torch.bfloat16, shape=(B * T, D), device=device)
    output = torch.zeros(B * T, D, dtype=torch.bfloat16, device=device)
    slot, conv_slot, offset = step_slots(slots, accepted, T)
    live = (slot > 0).nonzero()[:, 0]
    if live.numel() == 0:
        return output
    L = live.numel()
    lv = live.to(device)
    slot_l, conv_l, off_l = (v[live].to(device) for v in (slot, conv_slot, offset))
    pre = _prologue(op, shape, lv, conv_l, off_l, raw_gate)
    q_hat, k_hat, v, k, raw_g, decay, beta_t = pre[:7]

    # 3. The recurrence, token by token.
    S = _load(state[slot_l])  # [L, H, 128 rows, 128 keys] fp32
    o = torch.empty(T, L, H, HEAD_DIM, device=device)
    targets = None
    if records is None:
        s = slots.to(device=device, dtype=torch.int64)
        targets = s.view(B, -1)[lv, :T] if T > 1 else slot_l[:, None]
    for t in range(T):
        S = S * decay[t][:, :, None, :]
        v_new = (v[t] - _matvec(S, k_hat[t])) * beta_t[t][..., None]
        S = _fma(k_hat[t][:, :, None, :], v_new[..., None], S)
        o_t = _matvec(S, q_hat[t])
        if o_fp32 is not None:
            o_fp32.view(B, T, D)[lv, t] = o_t.reshape(L, D).to(o_fp32.device)
        if o_abs is not None:
            o_abs.view(B, T, D)[lv, t] = _matvec(S.abs(), q_hat[t].abs()).reshape(L, D)
        o[t] = _bf16(o_t)
        if records is None:
            keep = targets[:, t] > 0
            _store(state, targets[keep, t], S[keep])
        else:
            v_rec, kg_rec = records
            v_rec[lv, :, t] = v_new
            kg_rec[lv, :, t, :HEAD_DIM] = k[t].to(torch.bfloat16)
            kg_rec[lv, :, t, HEAD_DIM:] = raw_g[:, t].to(torch.bfloat16)

    _finish(op, shape, lv, conv_l, o, pre, output)
    return output


def apply_record(S, kg, v_new, a_log, dt_bias, lower_bound, gate_form="lower-bound"):
    """One recorded token applied to states ``S`` [..., H, 128, 128]: ``S * decay`` then
    ``fma(k^, v_new, .)``, the decay from the recorded raw gate ``kg[..., 128:]`` and k^ from
    the recorded k ``kg[..., :128]`` (``kg`` [..., H, 256] bf16, ``v_new`` [..., H, 128])."""
    kg = kg.float()
    k = kg[..., :HEAD_DIM]
    decay = _decay(kg[..., HEAD_DIM:], a_log, dt_bias, lower_bound, gate_form)
    return _fma((k * _l2(k))[..., None, :], v_new[..., None], S * decay[..., None, :])


@takes(RecoverOperands, validate=None)
def recover(*args, validate=None, **kwargs):
    """Commit the first ``accepted[b]`` tokens of a recorded verify step
    (arguments: ``kda.operands.RecoverOperands``'s fields and ``validate`` as ``decode``'s;
    mutates ``state``).

    ``checkpoint`` [B] is the ``accepted`` the verify step took, so the step read its state
    from ``slots[b, checkpoint[b] - 1]``; that state gets the tokens' updates (decay from the
    recorded raw gate, k^ from the recorded k, the recorded ``v_new``), and the state after
    token t goes to ``slots[b, t]`` when > 0, as a plain verify step writes it. Requests whose
    checkpoint slot is <= 0 (padding) are left alone. ``state``: fp32 or bf16 pages (the
    tokens are applied in fp32; each stored page rounded once).
    """
    full = mode(validate) == "full"
    op = RecoverOperands(*args, **kwargs)
    shape = check_recover(op, full=full)
    state, slots, v_records, kg_records = op.state, op.slots, op.v_records, op.kg_records
    a_log, dt_bias, accepted, checkpoint = op.a_log, op.dt_bias, op.accepted, op.checkpoint
    gate = (op.lower_bound, op.gate_form)
    T, device = shape.tokens, state.device
    s = slots.cpu().to(torch.int64)[:, :T]
    source = s.gather(1, checkpoint.cpu().to(torch.int64)[:, None] - 1)[:, 0]
    live = (source > 0).nonzero()[:, 0]
    if live.numel() == 0:
        return
    lv = live.to(device)
    n = accepted.to(torch.int64)[lv]
    targets = s[live].to(device)
    S = _load(state[source[live].to(device)])
    for t in range(T):
        kg, v_new = kg_records[lv, :, t], v_records[lv, :, t]
        nxt = apply_record(S, kg, v_new, a_log, dt_bias, *gate)
        active = n > t
        S = torch.where(active[:, None, None, None], nxt, S)
        keep = active & (targets[:, t] > 0)
        _store(state, targets[keep, t], S[keep])


@takes(
    DecodeOperands, ring=inspect.Parameter.empty, o_out=None, o_abs=None, v_abs=None, validate=None
)
def replay_decode(*args, ring: Ring, o_out=None, o_abs=None, v_abs=None, validate=None, **kwargs):
    """One replay decode (T = 1) or verify (T = 2..8) step: ``decode``'s arguments
    (``state`` is the checkpoint pool; ``records`` must be None) plus ``ring``; mutates
    ``ring`` and ``conv_state``, and ``state`` only where a full ring is materialised.
    A request's slot is ``slots[b]`` (T = 1) or ``slots[b, 0]``. Returns ``output``;
    ``o_out`` ([B*T, H*128] fp32), if given, receives the fp32 ``o`` before its rounding;
    ``o_abs`` and ``v_abs`` (same shape) the sums of |terms| that ``o`` and ``v_new`` add up
    (tests bound another fp32 summation order's error by them).

    A slot's state is its checkpoint ``C`` and ring entries ``j < n`` (records:
    ``k_j``, ``raw_g_j`` bf16, ``v_new_j`` fp32). With the decays ``d_j`` (from ``raw_g_j``),
    the token's decay ``d``, the suffix products ``P_j = d * d_{n-1} * ... * d_{j+1}``
    (fp32, multiplied from the newest entry back, never divided) and ``D = P_0 * d_0``:
    ``S_{n-1} diag(d) = C diag(D) + sum_j v_new_j (P_j * k^_j)^T``, so ``S k^`` and
    ``S q^`` are ``C (D * k^)``, ``C (D * q^)`` plus ``n`` weighted ``v_new_j``: one read
    of the page, no write.

    Counters ``ring.length[s, h] = (committed, pending)`` (equal across heads): the step
    first commits pending entries (``accepted[b]`` of them; one at T = 1, as the per-step
    path reads ``slots[b]`` = ``slots[b, 0]`` with the conv window at offset 0), folds the
    committed ones into the checkpoint when ``committed + T > R``, then writes its T
    entries after them; a T = 1 entry is committed at once, a verify step's stay pending
    until the next step. ``validate`` as ``decode``'s (the checked mode also scans the
    live slots' pages and ring entries); live slots must be unique across requests.
    ``state``: fp32 or bf16 checkpoint pages (read widened; a fold rounds each folded page
    once); the ring's dtypes do not follow it (``kda.validate.check_ring``)."""
    full = mode(validate) == "full"
    op = DecodeOperands(*args, **kwargs)
    shape, size = check_replay(op, ring, full=full)
    B, T, H, D = shape.requests, shape.tokens, shape.heads, shape.dim
    _, slot, offset = step_slots(op.slots, op.accepted, T)
    for name, extra in (("o_out", o_out), ("o_abs", o_abs), ("v_abs", v_abs)):
        if extra is not None:
            check_tensor(name, extra, (torch.float32,), shape=(B * T, D), device=op.state.device)
    device = op.state.device
    output = torch.zeros(B * T, D, dtype=torch.bfloat16, device=device)
    live = (slot > 0).nonzero()[:, 0]
    if live.numel() == 0:
        return output
    lv = live.to(device)
    slot_l, off_l = slot[live].to(device), offset[live].to(device)
    pre = _prologue(op, shape, lv, slot_l, off_l)

    counts = ring.length[slot_l, 0].long()
    # T = 1 reads the conv window after the last step's token 0: one pending entry commits.
    commit = counts[:, 1].clamp(max=1) if op.accepted is None else op.accepted[lv].long()
    n = counts[:, 0] + torch.minimum(commit, counts[:, 1])
    full = n + T > size
    if full.any():
        gate = (op.lower_bound, op.gate_form)
        _fold(op.state, ring, slot_l[full], n[full], op.a_log, op.dt_bias, *gate)
        n = torch.where(full, 0, n)

    C = _load(op.state[slot_l])  # [L, H, 128, 128] fp32
    o = torch.empty(T, live.numel(), H, HEAD_DIM, device=device)
    sums = torch.empty(2, T, live.numel(), H, HEAD_DIM, device=device)
    for t in range(T):
        o[t], sums[0, t], sums[1, t] = _replay_token(C, ring, slot_l, n, pre, t, op, sums[1, :t])
    counters = (n + 1, n * 0) if T == 1 else (n, n * 0 + T)
    ring.length[slot_l] = torch.stack(counters, 1).int()[:, None, :].expand(-1, H, 2)
    for extra, value in ((o_out, o), (o_abs, sums[0]), (v_abs, sums[1])):
        if extra is not None:
            extra.view(B, T, D)[lv] = value.transpose(0, 1).reshape(-1, T, D)
    _finish(op, shape, lv, slot_l, _bf16(o), pre, output)
    return output


def _replay_token(C, ring, slot_l, kept, pre, t, op, v_abs_before):
    """Token ``t`` of the step for the live slots ``slot_l`` whose rings hold ``kept`` [L]
    entries before the step's: writes its ring entry, returns its fp32 ``o`` [L, H, 128]
    and the sums of |terms| of ``o`` and ``v_new`` (the earlier tokens' ``v_new``, entries
    ``kept + t'``, count with their own sums ``v_abs_before`` [t, L, H, 128])."""
    L, entries = slot_l.numel(), kept + t
    k_hat, q_hat, v, d = pre.k_hat[t], pre.q_hat[t], pre.v[t], pre.decay[t]
    kg = ring.kg[slot_l].float()  # [L, R, H, 256]
    k_j = kg[..., :HEAD_DIM]
    d_j = _decay(kg[..., HEAD_DIM:], op.a_log, op.dt_bias, op.lower_bound, op.gate_form)
    k_hat_j = k_j * _l2(k_j)  # as the step that wrote the entry (and apply_record) had it
    # Suffix products P_j over the entries j < entries (newest first), D = P_0 * d_0.
    prod = d.clone()
    dk = torch.zeros(L, ring.size, *d.shape[1:], device=d.device)  # P_j * k^_j
    rows = torch.arange(L, device=d.device)
    for j in range(int(entries.max()) - 1, -1, -1):
        has = entries > j
        dk[rows[has], j] = prod[has] * k_hat_j[has, j]
        prod = torch.where(has[:, None, None], prod * d_j[:, j], prod)
    held = torch.arange(ring.size, device=d.device)[None, :] < entries[:, None]  # [L, R]
    v_j = torch.where(held[..., None, None], ring.v[slot_l], 0.0).double()  # [L, R, H, 128]
    alpha = _dot(dk, k_hat[:, None]).double()  # [L, R, H]
    gamma = _dot(dk, q_hat[:, None]).double()
    s_k = (_matvec(C, prod * k_hat).double() + (v_j * alpha[..., None]).sum(1)).float()
    beta = pre.beta_t[t][..., None]
    v_new = (v - s_k) * beta
    kq = _dot(k_hat, q_hat).double()[..., None]
    s_q = _matvec(C, prod * q_hat).double() + (v_j * gamma[..., None]).sum(1)
    o = (s_q + v_new.double() * kq).float()
    # |terms|: C's dot, the ring's weighted v_j (their dots' terms), v_new's own terms.
    ka, qa, ca = k_hat.abs(), q_hat.abs(), C.abs()
    va = v_j.abs()
    for before in range(t):  # an earlier token's v_new carries its own error
        va[torch.arange(L, device=d.device), kept + before] += v_abs_before[before].double()
    sk_abs = _matvec(ca, prod * ka).double() + (va * _dot(dk.abs(), ka[:, None])[..., None]).sum(1)
    v_abs = ((v.abs().double() + sk_abs) * beta.double()).float()
    sq_abs = _matvec(ca, prod * qa).double() + (va * _dot(dk.abs(), qa[:, None])[..., None]).sum(1)
    kq_abs = _dot(ka, qa).double()[..., None]
    o_abs = (sq_abs + (v_new.abs().double() + v_abs.double()) * kq_abs).float()
    ring.v[slot_l, entries] = v_new
    ring.kg[slot_l, entries, :, :HEAD_DIM] = pre.k[t].to(torch.bfloat16)
    ring.kg[slot_l, entries, :, HEAD_DIM:] = pre.raw_g[:, t].to(torch.bfloat16)
    return o, o_abs, v_abs


def _fold(state, ring, slots, counts, a_log, dt_bias, lower_bound, gate_form):
    """Apply the first ``counts[i]`` ring entries of ``slots[i]`` to its checkpoint and
    empty its ring."""
    S = _load(state[slots])
    for j in range(int(counts.max()) if counts.numel() else 0):
        gate = (lower_bound, gate_form)
        nxt = apply_record(S, ring.kg[slots, j], ring.v[slots, j], a_log, dt_bias, *gate)
        S = torch.where((counts > j)[:, None, None, None], nxt, S)
    _store(state, slots, S)
    ring.length[slots] = 0


def materialize(
    state,
    ring: Ring,
    a_log,
    dt_bias,
    *,
    lower_bound=None,
    slots=None,
    accepted=None,
    gate_form="lower-bound",
):
    """Fold the committed ring entries of ``slots`` (default: every page but 0) into their
    checkpoint pages and empty those rings; ``accepted`` (per slot) first commits that many
    pending entries, the rest are dropped. Afterwards ``state`` holds the plain per-step
    state (for prefix caching, migration or ``recover``). ``state``: fp32 or bf16 pages (a
    bf16 page is rounded once, after all its entries are applied in fp32). ``gate_form`` /
    ``lower_bound``: the decay of the entries' raw gates, as ``decode``'s."""
    check_gate_form(gate_form, lower_bound)
    check_tensor("state", state, STATE_DTYPES, ndim=4)
    check_ring(ring, state)
    pages = state.shape[0]
    if slots is None:
        slots = torch.arange(1, pages, device=state.device)
    check_tensor("slots", slots, (torch.int32, torch.int64), ndim=1, device=state.device)
    s = slots.long()
    if s.numel() and (s.min() < 1 or s.max() >= pages):
        raise ValueError(f"slots must be in 1..{pages - 1}; got {s.min()}..{s.max()}")
    if s.unique().numel() != s.numel():
        raise ValueError("slots must be unique")
    counts = ring.length[s, 0].long()
    if accepted is not None:
        check_tensor("accepted", accepted, (torch.int32,), shape=s.shape, device=state.device)
        if (accepted < 0).any():
            raise ValueError("accepted must be >= 0")
        counts[:, 0] += torch.minimum(accepted.long(), counts[:, 1])
    _fold(state, ring, s, counts[:, 0], a_log, dt_bias, lower_bound, gate_form)


def copy_state(state, conv_state, src, dst, *, ring: Ring | None = None, live=None):
    """Copy slot ``src[p]`` into slot ``dst[p]`` for every pair whose slots are both > 0:
    ``state[dst] = state[src]``, ``conv_state[dst] = conv_state[src]`` and, with ``ring``,
    the ring's entries and counters (``ring.v``, ``ring.kg``, ``ring.length``) likewise,
    bit for bit. Checks: ``kda.state.check_copy`` (``live``: the current step's slots, no
    destination among them; no destination twice; none that is also a source)."""
    from .state import check_copy, live_pairs

    check_copy(state, conv_state, src, dst, ring, live)
    s, d = live_pairs(src, dst)
    pools = (state, conv_state) + (tuple(ring) if ring is not None else ())
    for pool in pools:
        pool.index_copy_(0, d, pool.index_select(0, s))
