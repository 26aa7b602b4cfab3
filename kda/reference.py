"""Plain-torch reference of one KDA decode step, in place like the kernels (SPEC "KDA").

Layout: rows are ``B*T`` (request b, token t -> row ``b*T + t``), ``D = H*128`` local
channels, state pages ``[S, H, 128 value rows, 128 keys]`` fp32.

Rounding points, exactly the SPEC's:
- convolution ``acc = fma(w[t+i], coeff[i], acc)`` in fp32, then ``silu`` rounded to bf16;
- raw gate ``bf16(f_a . f_b)``; decay, beta and the q/k normalisation in fp32;
- recurrence in fp32 (``S *= decay``, ``v_new = (v - S.k) * beta``, ``S = fma(k, v_new, S)``),
  ``o`` rounded to bf16; gated RMSNorm in fp32, output bf16.

Dot products and the fp32 FMAs are evaluated in float64 and rounded once to fp32 (an
fp32 product is exact in float64): the result is the exactly rounded reduction, which
is independent of tensor shapes, so a head gives the same bits whatever shard it is in.
Kernels differ from this only in the order of their fp32 reductions.

A request whose state slot is <= 0 is a padding row: its output rows are zero and no
state page, conv page or record is touched.
"""

from __future__ import annotations

import torch

from .operands import DecodeOperands, RecoverOperands
from .validate import HEAD_DIM, check_decode, check_recover, mode, step_slots

__all__ = ["decode", "recover"]


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


def _decay(raw_g, a_log, dt_bias, lower_bound):
    """``exp(lower_bound * sigmoid(exp(a_log) * (raw_g + dt_bias)))``; raw_g [..., H, 128]."""
    heads = a_log.shape[0]
    gated = _exp(a_log.float()).view(heads, 1) * (raw_g + dt_bias.float().view(heads, HEAD_DIM))
    return _exp(lower_bound * _sigmoid(gated))


def _l2(v):
    """``rsqrt(sum v^2 + 1e-6)`` over the head's 128 keys, fp32, keeping the axis."""
    return _rsqrt(_dot(v, v) + 1e-6)[..., None]


def decode(*args, validate=None, **kwargs):
    """One decode (T = 1) or verify (T = 2..8) step; mutates ``state`` and ``conv_state``.

    Arguments: ``kda.operands.DecodeOperands``'s fields (13 tensors, then keywords), and
    ``validate`` (``"full"``: also refuse non-finite inputs; default ``$KDA_VALIDATE``).
    Returns ``output`` [B*T, H*128] bf16. ``records=(v_records, kg_records)`` selects
    record mode: the state is read from the checkpoint slot but not written.
    """
    full = mode(validate) == "full"
    op = DecodeOperands(*args, **kwargs)
    shape = check_decode(op, full=full)
    x, conv_weight, conv_bias, conv_state = op.x, op.conv_weight, op.conv_bias, op.conv_state
    f_a, beta, a_log, dt_bias, slots = op.f_a, op.beta, op.a_log, op.dt_bias, op.slots
    state, gate, norm_weight, f_b = op.state, op.gate, op.norm_weight, op.f_b
    lower_bound, scale, eps = op.lower_bound, op.scale, op.eps
    accepted, conv_dim_first, records = op.accepted, op.conv_dim_first, op.records
    B, T, H = shape.requests, shape.tokens, shape.heads
    D, device = shape.dim, state.device
    output = torch.zeros(B * T, D, dtype=torch.bfloat16, device=device)
    slot, conv_slot, offset = step_slots(slots, accepted, T)
    live = (slot > 0).nonzero()[:, 0]
    if live.numel() == 0:
        return output
    L = live.numel()
    lv = live.to(device)
    slot_l, conv_l, off_l = (v[live].to(device) for v in (slot, conv_slot, offset))

    # 1. Convolution window [tap0, tap1, tap2, x_0 .. x_{T-1}] per channel, fp32.
    page = conv_state[conv_l]
    if not conv_dim_first:
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
    fa = f_a.view(B, T, -1)[lv]  # [L, T, 128]
    raw_g = _bf16((fa.double() @ f_b.double().T).float()).view(L, T, H, HEAD_DIM)
    decay = _decay(raw_g, a_log, dt_bias, lower_bound).transpose(0, 1)  # [T, L, H, 128]
    beta_t = _sigmoid(beta.float().view(B, T, H)[lv]).transpose(0, 1)  # [T, L, H]
    q_hat = q * _l2(q) * scale
    k_hat = k * _l2(k)

    # 3. The recurrence, token by token.
    S = state[slot_l].clone()  # [L, H, 128 rows, 128 keys]
    o = torch.empty(T, L, H, HEAD_DIM, device=device)
    targets = None
    if records is None:
        s = slots.to(device=device, dtype=torch.int64)
        targets = s.view(B, -1)[lv, :T] if T > 1 else slot_l[:, None]
    for t in range(T):
        S = S * decay[t][:, :, None, :]
        v_new = (v[t] - _matvec(S, k_hat[t])) * beta_t[t][..., None]
        S = _fma(k_hat[t][:, :, None, :], v_new[..., None], S)
        o[t] = _bf16(_matvec(S, q_hat[t]))
        if records is None:
            keep = targets[:, t] > 0
            state[targets[keep, t]] = S[keep]
        else:
            v_rec, kg_rec = records
            v_rec[lv, :, t] = v_new
            kg_rec[lv, :, t, :HEAD_DIM] = k[t].to(torch.bfloat16)
            kg_rec[lv, :, t, HEAD_DIM:] = raw_g[:, t].to(torch.bfloat16)

    # 4. Gated RMSNorm over the head's 128 value rows.
    rstd = _rsqrt(_dot(o, o) * (1.0 / HEAD_DIM) + eps)[..., None]
    sig = _sigmoid(gate.float().view(B, T, H, HEAD_DIM)[lv].transpose(0, 1))
    result = ((o * rstd) * norm_weight.float()) * sig  # [T, L, H, 128]
    out = output.view(B, T, D)
    out[lv] = result.transpose(0, 1).reshape(L, T, D).to(torch.bfloat16)

    # 5. Conv page: [tap1, tap2, x_0 .. x_{T-1}] into window positions 0..T+1.
    new = torch.cat([taps[:, :, 1:], inputs.to(conv_state.dtype)], dim=2)  # [L, 3D, T+2]
    if conv_dim_first:
        conv_state[conv_l, :, : T + 2] = new.to(conv_state.dtype)
    else:
        conv_state[conv_l, : T + 2, :] = new.transpose(1, 2).to(conv_state.dtype)
    return output


def recover(*args, validate=None, **kwargs):
    """Commit the first ``accepted[b]`` tokens of a recorded verify step
    (arguments: ``kda.operands.RecoverOperands``'s fields and ``validate`` as ``decode``'s;
    mutates ``state``).

    ``checkpoint`` [B] is the ``accepted`` the verify step took, so the step read its state
    from ``slots[b, checkpoint[b] - 1]``; that state gets the tokens' updates (decay from the
    recorded raw gate, k^ from the recorded k, the recorded ``v_new``), and the state after
    token t goes to ``slots[b, t]`` when > 0, as a plain verify step writes it. Requests whose
    checkpoint slot is <= 0 (padding) are left alone.
    """
    full = mode(validate) == "full"
    op = RecoverOperands(*args, **kwargs)
    shape = check_recover(op, full=full)
    state, slots, v_records, kg_records = op.state, op.slots, op.v_records, op.kg_records
    a_log, dt_bias, accepted, checkpoint = op.a_log, op.dt_bias, op.accepted, op.checkpoint
    lower_bound = op.lower_bound
    T, device = shape.tokens, state.device
    s = slots.cpu().to(torch.int64)[:, :T]
    source = s.gather(1, checkpoint.cpu().to(torch.int64)[:, None] - 1)[:, 0]
    live = (source > 0).nonzero()[:, 0]
    if live.numel() == 0:
        return
    lv = live.to(device)
    n = accepted.to(torch.int64)[lv]
    targets = s[live].to(device)
    S = state[source[live].to(device)].clone()
    kg = kg_records[lv].float()  # [L, H, T, 256]
    for t in range(T):
        k = kg[:, :, t, :HEAD_DIM]
        decay = _decay(kg[:, :, t, HEAD_DIM:], a_log, dt_bias, lower_bound)
        k_hat = k * _l2(k)
        nxt = _fma(k_hat[:, :, None, :], v_records[lv, :, t][..., None], S * decay[:, :, None, :])
        active = n > t
        S = torch.where(active[:, None, None, None], nxt, S)
        keep = active & (targets[:, t] > 0)
        state[targets[keep, t]] = S[keep]
