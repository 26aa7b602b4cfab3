"""tpcomm.oproj.reference: the consumer's sum, AttnRes and norm, twoshot, project."""

import math

import pytest
import torch

from tpcomm.oproj import reference as R

EPS, OUT_EPS = 1e-6, 1e-6
# (eps, out_eps): distinct, and visible on the small-rms token of ``make(small=True)``
SCALARS = [(1e-6, 1e-5), (2e-5, 1e-3), (1e-3, 3e-6)]


def make(tp, n, hidden, nb, seed=0, small=False):
    g = torch.Generator().manual_seed(seed)

    def bf(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)

    a = dict(
        partials=bf(tp, n, hidden, s=0.5),
        prefix=bf(n, hidden),
        blocks=bf(n, nb, hidden) if nb else None,
        norm=(1 + torch.randn(hidden, generator=g) * 0.1).to(torch.bfloat16),
        query=bf(hidden, s=0.2),
        out_norm=(1 + torch.randn(hidden, generator=g) * 0.1).to(torch.bfloat16),
    )
    if small:  # token 0: rms ~ 1e-3, where eps and out_eps decide the output
        a["partials"][:, 0] *= 2.0**-10
        a["prefix"][0] *= 2.0**-10
        if nb:
            a["blocks"][0] *= 2.0**-10
    return a


def call(a, **kw):
    kw.setdefault("eps", EPS)
    kw.setdefault("out_eps", OUT_EPS)
    return R.consume(a["partials"], a["prefix"], a["blocks"], a["norm"], a["query"],
                     a["out_norm"], **kw)  # fmt: skip


def naive(a, has_delta=True, groups=4, eps=EPS, out_eps=OUT_EPS):
    """Per-token loop of the SPEC's math written from the SPEC: the grouped rank-order
    sum with fp32 additions (``S = ceil(TP / groups)``, group sums in group order, an
    empty group adding +0.0), bf16 roundings, then AttnRes with the normalised softmax and
    the output RMSNorm in float64."""
    partials, prefix, blocks = a["partials"].float(), a["prefix"].double(), a["blocks"]
    tp, n, hidden = partials.shape
    size = -(-tp // groups)
    w = a["norm"].double() * a["query"].double()
    out = torch.empty(n, hidden, dtype=torch.bfloat16)
    pre = torch.empty(n, hidden, dtype=torch.bfloat16)
    for i in range(n):
        total = None
        for gi in range(groups):
            ranks = range(gi * size, min((gi + 1) * size, tp))
            if len(ranks) == 0:
                part = torch.zeros(hidden)  # +0.0
            else:
                part = partials[ranks[0], i].clone()
                for r in ranks[1:]:
                    part = part + partials[r, i]  # fp32 additions, rank order
            total = part if total is None else total + part
        attn = total.to(torch.bfloat16).double()
        p = (prefix[i] + attn).float().to(torch.bfloat16).double() if has_delta else attn
        pre[i] = p.to(torch.bfloat16)
        if blocks is None:
            h = p
            rms = math.sqrt(float(h @ h) / hidden + out_eps)
        else:
            vs = [blocks[i, b].double() for b in range(blocks.shape[1])] + [p]
            logits = [float(v @ w) / math.sqrt(float(v @ v) / hidden + eps) for v in vs]
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            h = sum(ei * v for ei, v in zip(e, vs, strict=True)) / sum(e)
            rms = math.sqrt(float(h @ h) / hidden + out_eps)
        out[i] = (h / rms * a["out_norm"].double()).to(torch.bfloat16)
    return out, pre


def ulps(got, ref):
    ref = ref.float()
    e = torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126)))
    return (got.float() - ref).abs() / torch.pow(2.0, e - 7)


def within_one_ulp(got, ref):
    """The SPEC's 1-ulp rule: |ref| >= 2^-10 rms(row): within 1 bf16 ulp; else within
    2^-17 rms(row)."""
    g, r = got.float(), ref.float()
    rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    big = r.abs() >= rms * 2.0**-10
    err = (g - r).abs()
    return torch.where(big, ulps(got, ref) <= 1, err <= rms * 2.0**-17)


CASES = [  # tp, n, hidden, nb, groups, has_delta
    (2, 1, 1024, 0, 4, True),
    (4, 3, 2048, 3, 4, True),
    (16, 2, 1024, 8, 3, True),
    (5, 2, 1024, 2, 2, False),
    (1, 2, 1024, 1, 1, True),
    (7, 3, 2048, 8, 4, True),
    (8, 2, 2304, 8, 2, True),  # Kimi-Linear's width
    (3, 2, 256, 2, 1, False),
]


@pytest.mark.parametrize("index,case", list(enumerate(CASES)))
def test_against_float64_loop(index, case):
    """prefix_new bitwise (the grouped fp32 sum is the SPEC's, in both), output within
    1 bf16 ulp; (eps, out_eps) = SCALARS[index % 3] on a small-rms token."""
    tp, n, hidden, nb, groups, has_delta = case
    eps, out_eps = SCALARS[index % len(SCALARS)]
    a = make(tp, n, hidden, nb, seed=tp + nb, small=True)
    out, pre = call(a, groups=groups, has_delta=has_delta, eps=eps, out_eps=out_eps)
    ref_out, ref_pre = naive(a, has_delta, groups, eps, out_eps)
    assert torch.equal(pre.view(torch.int16), ref_pre.view(torch.int16))
    ok = within_one_ulp(out, ref_out)
    assert ok.all(), f"{int((~ok).sum())} outputs beyond 1 ulp: {(~ok).nonzero()[:4].tolist()}"


def test_nb0_is_residual_plus_rmsnorm():
    a = make(4, 3, 2048, 0)
    out, pre = call(a)
    attn = R.rank_order_sum(a["partials"], groups=4).to(torch.bfloat16)
    expect_pre = (a["prefix"].float() + attn.float()).to(torch.bfloat16)
    assert torch.equal(pre, expect_pre)
    p = expect_pre.float()
    expect = p * torch.rsqrt((p * p).mean(-1, keepdim=True) + OUT_EPS) * a["out_norm"].float()
    assert (ulps(out, expect.to(torch.bfloat16)) <= 1).all()
    assert torch.equal(a["prefix"], make(4, 3, 2048, 0)["prefix"])  # prefix not modified


def test_without_delta_prefix_is_the_sum():
    a = make(3, 2, 1024, 2)
    _, pre = call(a, has_delta=False)
    assert torch.equal(pre, R.rank_order_sum(a["partials"], 4).to(torch.bfloat16))


def test_group_order():
    """fp32 sums where the grouping changes the bits: 2^24 + 1 + 1 + ..."""
    tp, hidden = 8, 1024
    partials = torch.ones(tp, 1, hidden, dtype=torch.bfloat16)
    partials[0] = 2.0**24
    # groups = 1: ((2^24 + 1) + 1) ... each +1 rounds away (ties to even): 2^24.
    assert R.rank_order_sum(partials, 1)[0, 0].item() == 2.0**24
    # groups = 4 (two ranks each): (2^24 + 1 = 2^24) + 2 + 2 + 2 = 2^24 + 6.
    assert R.rank_order_sum(partials, 4)[0, 0].item() == 2.0**24 + 6
    # groups = 2 (four each): (2^24 + 1 + 1 + 1) + (1 + 1 + 1 + 1) = 2^24 + 4.
    assert R.rank_order_sum(partials, 2)[0, 0].item() == 2.0**24 + 4
    # groups = 3 (three, three, two): (2^24 + 3 = 2^24 + 4, tie to even) + 2 = 2^24 + 6.
    assert R.rank_order_sum(partials, 3)[0, 0].item() == 2.0**24 + 6


def test_empty_group_adds_positive_zero():
    partials = torch.full((2, 1, 1024), -0.0, dtype=torch.bfloat16)
    # tp 2, groups 4: groups 2 and 3 are empty and add +0.0, so -0 + +0 = +0.
    total = R.rank_order_sum(partials, 4)
    assert not torch.signbit(total).any()
    assert torch.signbit(R.rank_order_sum(partials, 1)).all()


@pytest.mark.parametrize("tp,nb", [(2, 0), (8, 3), (16, 8)])
def test_twoshot_equals_oneshot_rank_order(tp, nb):
    a = make(tp, 3, 2048, nb, seed=7)
    out1, pre1 = call(a, groups=1)
    out2, pre2 = call(a, groups=1, twoshot=True)
    assert torch.equal(pre1, pre2) and torch.equal(out1, out2)
    row = R.twoshot_gather(a["partials"])
    assert torch.equal(row, R.rank_order_sum(a["partials"], 1).to(torch.bfloat16))


def test_project_is_fp32_accumulate():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(1024, 256, generator=g).to(torch.bfloat16)
    got = R.project(x, w)
    ref = (x.double() @ w.double().T).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and (ulps(got, ref) <= 1).all()
    with pytest.raises(ValueError, match="w_o"):
        R.project(x, w[:, :128].contiguous())
    with pytest.raises(ValueError, match="hidden"):
        R.project(x, w[:1000].contiguous())


BAD = [
    ("partials", lambda a: a.update(partials=a["partials"].float())),
    ("partials", lambda a: a.update(partials=torch.zeros(17, 2, 1024, dtype=torch.bfloat16))),
    ("hidden", lambda a: a.update(partials=a["partials"][:, :, :1000].contiguous())),
    ("prefix", lambda a: a.update(prefix=a["prefix"][:1].contiguous())),
    ("blocks", lambda a: a.update(blocks=torch.zeros(2, 9, 1024, dtype=torch.bfloat16))),
    ("blocks", lambda a: a.update(blocks=torch.zeros(2, 2, 2048, dtype=torch.bfloat16))),
    ("norm", lambda a: a.update(norm=a["norm"].float())),
    ("out_norm", lambda a: a.update(out_norm=a["out_norm"][:512].contiguous())),
    ("query", lambda a: a.update(query=torch.zeros(2048, dtype=torch.bfloat16)[::2])),
]


@pytest.mark.parametrize("name,mutate", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs(name, mutate):
    a = make(2, 2, 1024, 2)
    mutate(a)
    with pytest.raises(ValueError, match=name):
        call(a)


def test_bad_groups_and_eps():
    a = make(2, 2, 1024, 2)
    with pytest.raises(ValueError, match="groups"):
        call(a, groups=5)
    with pytest.raises(ValueError, match="out_eps"):
        call(a, out_eps=-1.0)
