"""How far a consumer's output may legitimately lie from ``reference.consume``'s.

The kernels differ from the reference in the order of the HID-long fp32 dot products
(per thread 8 fma, a warp butterfly, warps then CTAs in order; SPEC, ``plan.slicing``) and
in exp / rsqrt (within 2 ulp; the reference rounds float64). Those move each logit by an absolute
amount (the dot's rounding grows with its partial sums, not with the logit), so every
softmax weight, and each output element ``y_i = sigma gamma_i sum_t pi_t v_t,i`` over the
terms t (blocks and ``prefix_new``) moves by a small *relative* amount of each term.
Where the terms cancel (|y_i| far below ``M_i = sigma |gamma_i| sum_t pi_t |v_t,i|``) that
is many ulps of y_i, beyond the SPEC's 1-ulp rule; at hundreds of rows such elements
occur (issue 13). ``allowance`` bounds the move per element, ``E M_i`` plus the fp32
roundings, from Higham's running error bound of the kernel's reduction tree; ``within``
accepts an output only as a bf16 rounding of a value that close to the reference's
fp32 output. An element that does not cancel gets far less than half an ulp.
"""

from __future__ import annotations

import torch

from tpcomm.mailbox import GROUP_ELEMS
from tpcomm.oproj.plan import slicing

__all__ = ["U", "tree_dot", "dot_error", "allowance", "within"]

U = 2.0**-24  # fp32 unit roundoff
LANES = 32


def tree_dot(a, b):
    """The consumer's fp32 dot of ``a`` and ``b`` [..., HID] (fp32 values), in its order:
    per thread a product and 7 fma over 8 columns, a 32-lane butterfly, the warps of a CTA
    in order, CTAs in order. (fma through float64: exact product, at most a double
    rounding.)"""
    warps = slicing(a.shape[-1]).warps
    a, b = a.unflatten(-1, (-1, GROUP_ELEMS)).double(), b.unflatten(-1, (-1, GROUP_ELEMS)).double()
    acc = (a[..., 0] * b[..., 0]).float()
    for j in range(1, GROUP_ELEMS):
        acc = (a[..., j] * b[..., j] + acc.double()).float()
    t = acc.unflatten(-1, (-1, warps, LANES))  # [..., CTA, warp, lane]
    while t.shape[-1] > 1:  # butterfly: lane l + lane l ^ half
        half = t.shape[-1] // 2
        t = t[..., :half] + t[..., half:]
    t = t[..., 0]
    cta = t[..., 0]
    for k in range(1, warps):
        cta = cta + t[..., k]
    out = cta[..., 0]
    for c in range(1, cta.shape[-1]):
        out = out + cta[..., c]
    return out


def dot_error(a, b):
    """|the consumer's fp32 dot - the exact dot| of fp32 ``a``, ``b``, plus 2u of the dot
    (a double rounding of the model, the reference's own fp32 rounding)."""
    exact = (a.double() * b.double()).sum(-1)
    return (tree_dot(a, b).double() - exact).abs() + 2 * U * exact.abs()


def _logits(V, w, eps, hidden):
    """Exact logits [..] of rows V [.., HID] and their error bound (kernel vs reference)."""
    D, S = (V * w).sum(-1), (V * V).sum(-1)
    r = torch.rsqrt(S / hidden + eps)
    L = D * r
    Vf, wf = V.float(), w.float().expand(V.shape)
    rho_r = dot_error(Vf, Vf) / S.clamp_min(1e-300) / 2 + 12 * U  # div, add, rsqrt 2 ulp
    err = r * dot_error(Vf, wf) + L.abs() * (rho_r + 2 * U)
    return L, err


def allowance(prefix_new, blocks, norm, query, out_norm, *, eps, out_eps):
    """(final, bound) [N, HID] float64: the consumer's output before its bf16 rounding,
    exactly, and the bound on a kernel's fp32 output's distance from the reference's."""
    P = prefix_new.double()
    hidden = P.shape[-1]
    gamma = out_norm.double().abs()
    if blocks is None or blocks.shape[1] == 0:
        ss = (P * P).sum(-1, keepdim=True)
        sigma = torch.rsqrt(ss / hidden + out_eps)
        final = sigma * P * out_norm.double()
        Pf = prefix_new.float()
        rho = dot_error(Pf, Pf)[:, None] / ss.clamp_min(1e-300) / 2 + 16 * U
        return final, final.abs() * rho
    nb = blocks.shape[1]
    w = norm.double() * query.double()
    V = torch.cat([blocks.double(), P[:, None]], dim=1)  # [N, nb + 1, HID]: blocks, then P
    L, dL = _logits(V, w, eps, hidden)
    mx = L.max(1, keepdim=True).values
    top = L[:, :nb].max(1, keepdim=True).values
    pi = torch.softmax(L, dim=1)  # [N, nb + 1]
    # each term's weight: its logit, top and mx (<= max error), the exponent roundings,
    # exp within 2 ulp (4u) in the kernel and 1u in the reference, the products
    E = dL + 3 * dL.max(1, keepdim=True).values + 2 * U * ((L - mx).abs() + (top - mx).abs())
    E = E + 16 * U  # [N, nb + 1]
    h = (pi[..., None] * V).sum(1)  # [N, HID], the normalised mix
    q = (h * h).sum(-1, keepdim=True)
    sigma = torch.rsqrt(q / hidden + out_eps)
    terms = pi[..., None] * V.abs()  # [N, nb + 1, HID]
    mass = terms.sum(1)  # sum_t pi_t |v_t,i|
    moved = (terms * E[..., None]).sum(1) + 2 * nb * U * terms[:, :nb].sum(1)  # mix's fma
    # the scale, common to the row: |h|^2 from three dots (t0, t1, t2) of the moved mix
    # and prefix in the kernel's order, the fma expansion; den within the largest error
    mix, pp = (pi[:, :nb, None] * V[:, :nb]).sum(1).float(), (pi[:, nb, None] * P).float()
    spread = (mix * mix).sum(-1) + 2 * (mix * pp).sum(-1).abs() + (pp * pp).sum(-1)
    rounding = dot_error(mix, mix) + 2 * dot_error(mix, pp) + dot_error(pp, pp)
    dq = 2 * q.sqrt() * moved.norm(dim=-1, keepdim=True) + (rounding + 4 * U * spread)[:, None]
    rho_sigma = (dq / q.clamp_min(1e-300) + 2 * E.max(1, keepdim=True).values) / 2 + 12 * U
    final = sigma * h * out_norm.double()
    bound = sigma * gamma * (moved + 8 * U * mass) + final.abs() * rho_sigma
    return final, bound


def within(got, final, bound):
    """Elements of ``got`` (bf16) that are a bf16 rounding of a value within ``bound``
    of ``final``: |got - final| <= bound + half an ulp of got."""
    g = got.double()
    half_ulp = torch.exp2(torch.floor(torch.log2(g.abs().clamp_min(2.0**-133))) - 8)
    return (g - final).abs() <= bound + half_ulp
