"""Plain-torch reference of the o-projection all-reduce and its consumer (SPEC, seed 004).

``project``: a rank's row-parallel partial ``bf16(attn_out @ w_o^T)`` (fp32 accumulate).

``consume``: what every rank's OprojConsumer computes from the mailbox ``partials``
[TP, N, HID]:
1. the grouped rank-order sum in fp32: with ``S = ceil(TP / groups)`` group g sums ranks
   ``g*S .. min((g+1)*S, TP) - 1`` in rank order starting from its first rank's value, the
   group sums are added in group order (an empty group adds +0.0); rounded to bf16;
   ``prefix_new = bf16(prefix + attn)`` with ``has_delta``, else ``attn``;
2. AttnRes over ``nb`` block snapshots with ``w = norm * query`` (fp32, not rounded), in the
   seed's unnormalised-exponential form, and the output RMSNorm, rounded to bf16.

``prefix_new`` depends only on the rank-order sum and is bitwise what kernels must give.
Dot products over HID are exactly rounded to fp32 (float64 then fp32), so the result does
not depend on tensor shapes; kernels differ only in the order of those reductions.
"""

from __future__ import annotations

import torch

from tpcomm.checks import check_finite, check_tensor, mode
from tpcomm.mailbox import grouped_sum
from tpcomm.oproj.checks import check_consume
from tpcomm.oproj.plan import check_hidden

__all__ = [
    "project",
    "rank_order_sum",
    "twoshot_gather",
    "consume",
    "check_consume",
    "check_hidden",
]


def _tensor(name, t, dtype, shape=None, ndim=None, device=None):
    check_tensor(name, t, dtype, shape=shape, ndim=ndim, device=device)


def _dot(a, b):
    return (a.double() * b.double()).sum(-1).float()


def _rstd(ss, eps, hidden):
    """``1 / sqrt(ss / HID + eps)`` in fp32."""
    return torch.rsqrt((ss / hidden + eps).double()).float()


def _exp(t):
    """fp32 exp evaluated in float64 (torch's fp32 CPU exp depends on the loop path)."""
    return torch.exp(t.double()).float()


def project(attn_out, w_o, *, validate=None):
    """A rank's partial ``bf16(attn_out @ w_o^T)``: attn_out [N, D_local], w_o [HID, D_local]
    on one device; ``validate="full"`` (or ``$KDA_VALIDATE``) refuses non-finite inputs."""
    full = mode(validate) == "full"
    _tensor("attn_out", attn_out, torch.bfloat16, ndim=2)
    _tensor("w_o", w_o, torch.bfloat16, ndim=2, device=attn_out.device)
    if w_o.shape[1] != attn_out.shape[1]:
        raise ValueError(
            f"w_o must be [HID, D_local = {attn_out.shape[1]}]; got {tuple(w_o.shape)}"
        )
    check_hidden(w_o.shape[0], "w_o rows (hidden)")
    if full:
        check_finite("attn_out", attn_out)
        check_finite("w_o", w_o)
    return (attn_out.double() @ w_o.double().T).float().to(torch.bfloat16)


def rank_order_sum(partials, groups=4):
    """The grouped rank-order sum of ``partials`` [TP, N, HID] bf16, fp32, not rounded."""
    return grouped_sum(partials, groups)


def twoshot_gather(partials):
    """The twoshot gather row [N, HID] bf16: rank s sums its columns
    ``[s*HID/TP, (s+1)*HID/TP)`` over the ranks' receive slots in rank order."""
    tp, hidden = partials.shape[0], partials.shape[2]
    if hidden % (8 * tp) != 0:
        raise ValueError(f"twoshot needs HID ({hidden}) divisible by 8 * TP ({8 * tp})")
    width = hidden // tp
    shards = []
    for s in range(tp):
        recv = partials[:, :, s * width : (s + 1) * width]  # rank s's receive view
        shards.append(rank_order_sum(recv, groups=1).to(torch.bfloat16))
    return torch.cat(shards, dim=1)


def consume(
    partials,
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    *,
    eps,
    out_eps,
    has_delta=True,
    groups=4,
    twoshot=False,
    validate=None,
):
    """The consumer's output [N, HID] bf16 and ``prefix_new`` [N, HID] bf16.

    ``prefix`` is not modified. With ``twoshot`` the ranks' partials are first reduced
    shard by shard into the one-slot gather row (``twoshot_gather``), which the consumer
    then reads as a one-rank mailbox. ``validate="full"`` (or ``$KDA_VALIDATE``) refuses
    non-finite inputs.
    """
    full = mode(validate) == "full"
    for name, flag in (("has_delta", has_delta), ("twoshot", twoshot)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool; got {flag!r}")
    operands = (partials, prefix, blocks, norm, query, out_norm)
    _, _, hidden, nb = check_consume(*operands, groups=groups, eps=eps, out_eps=out_eps, full=full)
    mailbox = twoshot_gather(partials)[None] if twoshot else partials
    attn = rank_order_sum(mailbox, groups).to(torch.bfloat16)
    prefix_new = (prefix.float() + attn.float()).to(torch.bfloat16) if has_delta else attn
    P = prefix_new.float()
    gamma = out_norm.float()
    if nb == 0:
        final = _rstd(_dot(P, P), out_eps, hidden)[:, None] * P * gamma
        return final.to(torch.bfloat16), prefix_new

    w = norm.float() * query.float()
    V = blocks.float()  # [N, nb, HID]
    logits = _dot(V, w) * _rstd(_dot(V, V), eps, hidden)  # [N, nb]
    top = logits.max(dim=1).values
    expo = _exp(logits - top[:, None])
    expo_sum = expo.sum(dim=1)
    mix = torch.zeros_like(P)
    for b in range(nb):
        mix = (expo[:, b, None].double() * V[:, b].double() + mix.double()).float()  # fma
    t0, t1, t2, t3 = _dot(mix, P), _dot(mix, mix), _dot(P, P), _dot(P, w)
    lp = t3 * _rstd(t2, eps, hidden)
    mx = torch.maximum(top, lp)
    alpha, ep = _exp(top - mx), _exp(lp - mx)
    den = alpha * expo_sum + ep
    quad = alpha * alpha * t1 + 2.0 * alpha * ep * t0 + ep * ep * t2  # |alpha mix + ep P|^2
    scale = _rstd(quad, out_eps * den * den, hidden)
    ca, cp = (alpha * scale)[:, None], (ep * scale)[:, None]
    final = (cp * P + ca * mix) * gamma
    return final.to(torch.bfloat16), prefix_new
