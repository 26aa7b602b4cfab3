"""The decode job's check math (SPEC tolerances) and the checks of one GPU step.

KDA outputs within 1 bf16 ulp allowing o's own bf16 flip; state pages within 1e-5 of the
page's max |ref|, pages the step leaves alone bitwise; the o-projection prefix and output
within the bounds of ``oproj_bound_ratios``. With the seed's gate orders (``--gate-mode``
0/1) the gate inputs sit on grids where every fp32 order of the gate dot is exact
(``exact_gate_*``), so they round like the reference; mode 3 (the default) rounds the raw
gate exactly on any input, so the job keeps its random gate inputs.

Replay mode (``--kda-state replay``) against the per-step reference: ``o`` is a bf16
rounding of an fp32 value that the two paths sum differently (checkpoint and ring against
the state), and a head's output row is a function of its bf16 ``o`` row and the gate only;
so rows whose replay ``o`` lies away from every bf16 midpoint are bitwise the per-step
output (``replay_output_check``). Ring entries (``ring_check``) and materialised pages
(``materialized_check``) are state: within 1e-5 of the max.
"""

from __future__ import annotations

import functools

import torch

from kda import layer as kl
from kda.validate import HEAD_DIM

SEED_GATE_MODES = (0, 1)  # gate modes that need the exact grids


def exact_gate_weights(layer: kl.Layer) -> None:
    """``f_b`` on a 1/64 grid (with ``exact_gate_inputs``: every partial sum of the gate
    dot is a multiple of 2^-9 below 2^8, exact in fp32, whatever the order)."""
    layer.f_b = ((layer.f_b.float() * 64).round() / 64).to(torch.bfloat16)


def exact_gate_inputs(step: kl.Step) -> None:
    """``f_a`` on a 1/8 grid in [-4, 4]."""
    step.f_a = ((step.f_a.float() * 8).round().clamp(-32, 32) / 8).to(torch.bfloat16)


def bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp of each element of ``ref`` (fp32)."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126))) - 7)


def ulp_check(got, ref, row=None, o_flip=False, allow=None):
    """SPEC's 1-ulp rule over rows of ``row`` elements (default: the last dim): elements
    with |ref| >= 2^-10 rms(row) within 1 ulp, the others within 2^-17 rms(row). With
    ``o_flip`` (KDA outputs, rows = a head's 128 channels) every element may also move by
    one ulp of ``o`` (2^-7 of itself; o is an fp32 reduction rounded to bf16 whose order
    the SPEC leaves open), and 99.9% must be strictly within 1 ulp. ``allow``: elements
    that may be beyond it (the o-projection output where its terms cancel,
    ``tpcomm.oproj.bound.within``). Returns (ok, exact fraction, worst ulps, detail)."""
    row = ref.shape[-1] if row is None else row
    g, r = got.float().reshape(-1, row), ref.float().reshape(-1, row)
    if torch.isnan(g).any():
        return False, 0.0, float("inf"), "NaN in the result"
    rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    err, ulp = (g - r).abs(), bf16_ulp(r)
    big = r.abs() >= rms * 2.0**-10
    strict = torch.where(big, err <= ulp, err <= rms * 2.0**-17)
    if allow is not None:
        allow = allow.reshape(-1, row)
        strict, big = strict | allow, big & ~allow
    worst = float((err / ulp)[big].max()) if big.any() else 0.0
    exact = float((err == 0).float().mean())
    if o_flip:
        loose = torch.where(big, err <= ulp + r.abs() * 2.0**-7 * 1.01, err <= rms * 2.0**-16)
        within = float(strict.float().mean())
        ok = bool(loose.all()) and within >= 0.999
        detail = f"{within:.5f} within 1 ulp, max {worst:.2f} ulp"
    else:
        ok = bool(strict.all())
        detail = f"{int((~strict).sum())} elements beyond 1 ulp, max {worst:.2f} ulp"
    return ok, exact, worst, detail


def state_tolerance(state) -> str:
    """The state check's tolerance, as its check line says it."""
    return "1 bf16 ulp" if state.dtype == torch.bfloat16 else "1e-5 of page max"


def state_check(got, ref, before):
    """Pages the reference changed: fp32 within 1e-5 of the page's max |ref|; bf16 (one
    step from the same pages, each rounded once) within 1 bf16 ulp element by element
    (bitwise but where the fp32 value lies at a rounding midpoint); (page, head) blocks it
    left alone: bitwise ``before``. Returns (within, untouched, worst err/max or ulps)."""
    changed = (ref != before).flatten(2).any(-1)  # [S, H]
    if got.dtype == torch.bfloat16:
        bits = got.view(torch.int16).int() - ref.view(torch.int16).int()
        ulps = bits.abs().flatten(1).amax(-1).float()
        untouched = (got == before).flatten(2).all(-1) | changed
        return bool((ulps <= 1).all()), bool(untouched.all()), float(ulps.max())
    page_changed = changed.any(-1)
    scale = ref.abs().flatten(1).amax(-1)
    err = (got - ref).abs().flatten(1).amax(-1)
    ratio = torch.where(page_changed, err / scale.clamp_min(1e-30), torch.zeros_like(err))
    untouched = (got == before).flatten(2).all(-1) | changed
    return bool((ratio <= 1e-5).all()), bool(untouched.all()), float(ratio.max())


# How far apart the replay and per-step paths' fp32 ``o`` may lie, of the head row's max |o|
# (tests/test_kda_replay.py: over 64-step runs, folds included).
REPLAY_O_MARGIN = 2.0**-18


def near_midpoint(o32: torch.Tensor, margin: float = REPLAY_O_MARGIN) -> torch.Tensor:
    """Elements of head rows ``o32`` [..., 128] (fp32) within ``margin`` x the row's max |o|
    of a bf16 rounding midpoint: where two fp32 orders may round ``o`` differently."""
    bits = o32.contiguous().view(torch.int32)
    midpoint = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)
    return (o32 - midpoint).abs() <= margin * o32.abs().amax(-1, keepdim=True)


def replay_output_check(got, want, o32, live):
    """Replay KDA outputs ``got`` [N, D] against the per-step path's ``want``, with the
    replay reference's fp32 ``o`` ``o32`` [N, D] and the live rows ``live`` [N] (bool):
    head rows with no ``o`` element near a midpoint bitwise, the others within 1 ulp plus
    one ulp of ``o`` (SPEC); padding rows both zero. Returns (ok, rows not bitwise, detail)."""
    N = got.shape[0]
    g, w = got.float().view(N, -1, HEAD_DIM), want.float().view(N, -1, HEAD_DIM)
    if not (torch.equal(g[~live], w[~live]) and not g[~live].any()):
        return False, 0, "padding rows not zero"
    g, w = g[live], w[live]
    if torch.isnan(g).any():
        return False, 0, "NaN in the result"
    risky = near_midpoint(o32.view(N, -1, HEAD_DIM)[live]).any(-1)  # [rows, H]
    same = (g == w).all(-1)
    off = int((~same & ~risky).sum())
    rms = w.pow(2).mean(-1, keepdim=True).sqrt()
    err = (g - w).abs()
    big = w.abs() >= rms * 2.0**-10
    near = torch.where(big, err <= bf16_ulp(w) + w.abs() * 2.0**-7, err <= rms * 2.0**-17)
    far = int((~near).sum())
    detail = (
        f"{int((~same).sum())} of {same.numel()} head rows not bitwise ({off} away "
        f"from o's midpoints), {far} elements beyond 1 ulp + o's ulp"
    )
    return off == 0 and far == 0, int((~same).sum()), detail


def ring_check(got, want):
    """A ring (``kda.operands.Ring``, CPU) against the reference's from the same ring:
    counters and k / raw-gate entries bitwise, ``v_new`` entries within 1e-5 of each
    (page, head)'s max |ref| over its entries. Returns (ok, worst err/max, detail)."""
    if not torch.equal(got.length, want.length):
        return False, float("inf"), "counters differ"
    if not torch.equal(got.kg.view(torch.int16), want.kg.view(torch.int16)):
        return False, float("inf"), "k / raw-gate entries differ"
    err = (got.v - want.v).abs().amax(dim=(1, 3))  # [S, H]
    scale = want.v.abs().amax(dim=(1, 3))
    ratio = float(torch.where(err > 0, err / scale.clamp_min(1e-30), 0.0).max())
    return ratio <= 1e-5, ratio, f"v_new worst {ratio:.2e} of the max"


def materialized_check(state, replay_pages, want, want_pages):
    """Materialised replay pages ``state[replay_pages]`` against the per-step reference's
    ``want[want_pages]`` (request by request): within 1e-5 of the page's max |ref|.
    Returns (ok, worst err/max)."""
    got, ref = state[replay_pages], want[want_pages]
    err = (got - ref).abs().flatten(1).amax(-1)
    ratio = float((err / ref.abs().flatten(1).amax(-1).clamp_min(1e-30)).max())
    return ratio <= 1e-5, ratio


def attn_drift(attn, ref_attn, w_o) -> torch.Tensor:
    """``|attn - ref_attn| @ |w_o|^T`` in fp64 ([N, HID]): the most two o-projections of
    these KDA outputs can differ by in exact arithmetic. The kernels' KDA outputs are
    checked to 1 ulp + o's flip against the unsharded layer's, not bitwise, and a few ulps
    of attn move the projection by more than the prefix's rounding allowance where the
    row's products cancel (two H200, TP 2, 12 heads per rank, step 19 of 40: 1.24 of the
    allowance without this term). Sparse: the outputs agree bitwise almost everywhere."""
    diff = (attn.double() - ref_attn.double()).abs()
    drift = torch.zeros(attn.shape[0], w_o.shape[0], dtype=torch.float64)
    rows, cols = diff.nonzero(as_tuple=True)
    for i in range(0, rows.numel(), 1024):  # [k, HID] terms, bounded memory
        n, d = rows[i : i + 1024], cols[i : i + 1024]
        drift.index_add_(0, n, diff[n, d][:, None] * w_o[:, d].double().abs().T)
    return drift


def oproj_bound_ratios(partials, tp_prefix, tp_out, u_prefix, epilogue, drift=None):
    """Worst error / bound of a TP prefix against the unsharded fp32 o-proj, and of a TP
    output against ``epilogue(tp_prefix)``: the fp64 epilogue of that same prefix
    (``Model.epilogue``, a callable so it cannot be handed another prefix's).

    Prefix: each per-rank bf16 partial and each later bf16 rounding moves a value by at most
    2^-8 of its magnitude; ``drift`` (``attn_drift``, when the partials project KDA outputs
    other than the unsharded layer's) adds what the inputs' difference moves. Output: within
    2^-6 of each value plus 2^-8 of the row's rms (the output's bf16 rounding, the kernels'
    1 ulp, fp32 logits); per element, so it holds at any row count; a wrong formula, eps or
    weight is off by far more. The epilogue must be of the output's own prefix: a kernel's
    partials (from its KDA outputs, within 1 ulp + o's flip) give a prefix some ulps away
    from the reference's in many elements, and AttnRes logits of magnitude L amplify a
    prefix ulp by about L (the check once took the reference partials' epilogue and failed
    at 16+ rows).
    """
    prefix_bound = 2.0**-7 * (2 * partials.float().abs().sum(0) + u_prefix.float().abs())
    if drift is not None:
        prefix_bound = prefix_bound + drift.float()
    prefix_ratio = (tp_prefix.float() - u_prefix.float()).abs() / (prefix_bound + 2.0**-20)
    want = epilogue(tp_prefix).double()
    rms = want.pow(2).mean(-1, keepdim=True).sqrt()
    out_bound = 2.0**-6 * want.abs() + 2.0**-8 * rms
    out_ratio = (tp_out.double() - want).abs() / (out_bound + 2.0**-30)
    return float(prefix_ratio.max()), float(out_ratio.max())


def inject(fault: str, output: torch.Tensor, state: torch.Tensor, state_bit: int = 0) -> None:
    """``--fault``: flip one bit of ``output``'s first value or of an element of ``state``'s
    last page (the checks must catch it)."""
    if fault == "output":
        output.view(torch.int16)[0, 0] ^= 1
    elif fault == "state":
        state.view(torch.int32)[-1, 0, 0, 0] ^= 1 << state_bit


def check_step(runner, unsharded, bk, plan, step, prefix, blocks, before_state, check, worst):
    """One GPU step against the unsharded layer and the o-projection reference. Every
    process takes part (gathers, the mailbox read-back); process 0 compares. Replay: the
    unsharded layer is the replay reference (from the step's gathered pools and rings), and
    the KDA outputs are also checked against the per-step reference's."""
    cfg, model = runner.cfg, runner.model
    i = plan.index
    attn_all = runner.all_ranks(bk.attn)  # [TP, N, D_local]
    state, conv = runner.gather_pools()
    ring = runner.gather_ring() if cfg.replay else None
    armed = runner.procs.all_true(bk.comm.armed())
    partials, same = runner.partials(bk, plan.index & 1)
    if unsharded is None:
        return
    ref = unsharded.step(plan, step, prefix, blocks, groups=bk.comm.groups)
    attn = torch.cat(list(attn_all), dim=1)
    ok, exact, ulps, detail = ulp_check(attn, ref["attn"], row=HEAD_DIM, o_flip=True)
    check("kda outputs vs unsharded (1 ulp + o's flip)", ok, i, detail)
    worst["kda_ulp"] = max(worst["kda_ulp"], ulps)
    worst["kda_exact"] = min(worst["kda_exact"], exact)
    within, untouched, ratio = state_check(state, unsharded.kda.state, before_state)
    pages = "checkpoint pages" if cfg.replay else "state pages"
    check(f"{pages} vs unsharded ({state_tolerance(state)})", within, i, f"worst {ratio:.2e}")
    check(f"{pages} the step leaves alone unchanged (bitwise)", untouched, i)
    worst["state"] = max(worst["state"], ratio)
    check("conv pages == unsharded (bitwise)", torch.equal(conv, unsharded.kda.conv_state), i)
    if cfg.replay:
        ok, ratio, detail = ring_check(ring, unsharded.ring)
        check("ring vs unsharded (counters, k, raw gate bitwise; v_new 1e-5 of max)", ok, i, detail)
        worst["ring"] = max(worst["ring"], ratio)
    if cfg.cross_path:
        ok, _, ulps, detail = ulp_check(attn, ref["per_step_attn"], row=HEAD_DIM, o_flip=True)
        check("kda outputs vs per-step reference (1 ulp + o's flip)", ok, i, detail)
        worst["per_step_ulp"] = max(worst["per_step_ulp"], ulps)

    check("mailboxes re-armed", armed, i)
    if bk.comm.twoshot:  # each column lands in its owner's receive view alone
        check("partials landed in every receive view (twoshot)", same, i)
    else:
        check("partials identical in every rank's mailbox", same, i)
    from tpcomm.oproj import bound as oproj_bound
    from tpcomm.oproj import reference as oref

    bad = []
    for r in range(cfg.tp):
        want = oref.project(attn_all[r], runner.w_o_cpu(r))
        ok, _, ulps, detail = ulp_check(partials[r], want)
        bad += [] if ok else [f"rank {r}: {detail}"]
        worst["partial_ulp"] = max(worst["partial_ulp"], ulps)
    check("partials vs reference projection (1 ulp)", not bad, i, "; ".join(bad[:2]))
    groups, twoshot = bk.comm.groups, bk.comm.twoshot
    want_out, want_prefix = model.consume(partials, prefix, blocks, groups, twoshot)
    got_prefix, got_out = bk.prefix[0].cpu(), bk.output[0].cpu()  # rank 0: row 0 here
    check(
        "prefix == TP reference math (bitwise)",
        torch.equal(got_prefix.view(torch.int16), want_prefix.view(torch.int16)),
        i,
    )
    final, bound = model.allowance(want_prefix, blocks)  # cancelling terms (bound.py)
    allow = oproj_bound.within(got_out, final, bound)
    ok, _, ulps, detail = ulp_check(got_out, want_out, allow=allow)
    check("output vs TP reference math (1 ulp)", ok, i, detail)
    worst["output_ulp"] = max(worst["output_ulp"], ulps)
    # the fp64 epilogue of this very prefix (not the reference partials' prefix)
    epilogue = functools.partial(model.epilogue, blocks=blocks)
    drift = attn_drift(attn, ref["attn"], model.w_o)  # the KDA outputs' own difference
    p, o = oproj_bound_ratios(partials, got_prefix, got_out, ref["u_prefix"], epilogue, drift)
    check("prefix vs unsharded o-proj (within bound)", p <= 1, i, f"worst {p:.3f}")
    check("output vs fp64 epilogue of the prefix (within bound)", o <= 1, i, f"worst {o:.3f}")
    worst["prefix"], worst["output"] = max(worst["prefix"], p), max(worst["output"], o)
