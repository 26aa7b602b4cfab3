"""GPU tests (one H200, loopback backend): OprojConsumer against tpcomm.oproj.reference.

Every TP rank runs on its own stream: a publisher puts the rank's partial into every
rank's mailbox slot, then the rank's consumer polls, sums, updates ``prefix`` and writes
``output``. Checks: ``prefix_new`` bitwise, ``output`` within 1 bf16 ulp (SPEC sense),
every rank's output bitwise identical, mailboxes re-armed, hints counted, no error word;
100 steps in a row, CUDA-graph replay, and a rank that never publishes (error, no hang).
The twoshot tests (``-k twoshot``) cover the two-hop path (receive views, gather rows).
"""

import time

import pytest
import torch
from shared_gpu import poll_budget_ns

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import reference as R
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce
from tpcomm.oproj.plan import slicing

pytestmark = pytest.mark.gpu
EPS, OUT_EPS = 1e-6, 1e-5
# (eps, out_eps): distinct, and large enough to decide the small-rms token's output (its
# mean square is ~1e-6), so zeroing, swapping or hard-coding them shows.
SCALARS = [(EPS, OUT_EPS), (2e-5, 1e-3), (1e-3, 3e-6)]


def random_inputs(tp, tokens, hid, nb, seed, small=True):
    """Random mailbox partials, prefix, blocks and gammas; with ``small`` token 0's
    partials, prefix and blocks are scaled by 2^-10 (rms ~ 1e-3: eps and out_eps matter)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def bf(*shape, s=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, device="cuda") * s + shift).to(torch.bfloat16)

    a = dict(
        partials=bf(tp, tokens, hid, s=0.5),
        prefix=bf(tokens, hid),
        blocks=bf(tokens, nb, hid) if nb else None,
        norm=bf(hid, s=0.1, shift=1.0),
        query=bf(hid, s=0.2),
        out_norm=bf(hid, s=0.1, shift=1.0),
    )
    if small:
        a["partials"][:, 0] *= 2.0**-10
        a["prefix"][0] *= 2.0**-10
        if nb:
            a["blocks"][0] *= 2.0**-10
    return a


def reference_step(a, prefix, has_delta, groups, eps=EPS, out_eps=OUT_EPS):
    return R.consume(a["partials"], prefix, a["blocks"], a["norm"], a["query"], a["out_norm"],
                     eps=eps, out_eps=out_eps, has_delta=has_delta, groups=groups)  # fmt: skip


def ulp_check(got, ref, allow=None):
    """SPEC's 1-ulp rule; returns (fraction at 0 ulp, worst ulps) or raises. ``allow``:
    elements that may be beyond it (``tpcomm.oproj.bound.within``: cancelling terms)."""
    g, r = got.float(), ref.float()
    rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    big = r.abs() >= rms * 2.0**-10
    exponent = torch.floor(torch.log2(r.abs().clamp_min(1e-30)))
    ulp = torch.pow(2.0, exponent - 7)
    diff = (g - r).abs()
    assert not torch.isnan(g).any(), "NaN in output"
    allow = torch.zeros_like(big) if allow is None else allow
    ok_big = (diff <= ulp) | ~big | allow
    ok_small = (diff <= rms * 2.0**-17) | big | allow
    assert ok_big.all() and ok_small.all(), (
        f"{int((~ok_big).sum() + (~ok_small).sum())} elements beyond 1 ulp"
    )
    ulps = torch.where(big & ~allow, diff / ulp, torch.zeros_like(diff))
    return float((diff == 0).float().mean()), float(ulps.max())


def poison(t):
    t.view(torch.int16).fill_(0x7F81)


class _Setup:
    def __init__(self, tp, tokens, hid, nb, *, has_delta=True, groups=None, xmoe=0,
                 scalars=(EPS, OUT_EPS), **kw):  # fmt: skip
        self.backend = LoopbackBackend(tp)
        self.eps, self.out_eps = scalars
        self.comm = OprojAllReduce(self.backend, tokens, hid, nb, has_delta=has_delta,
                                   groups=groups, xmoe_reps=xmoe, eps=self.eps,
                                   out_eps=self.out_eps, **kw)  # fmt: skip
        self.tp, self.tokens, self.hid, self.nb = tp, tokens, hid, nb
        self.has_delta, self.groups, self.xmoe = has_delta, self.comm.groups, xmoe
        bf = dict(dtype=torch.bfloat16, device="cuda")
        self.prefixes = torch.empty(tp, tokens, hid, **bf)
        self.outputs = torch.empty(tp, tokens, hid, **bf)
        self.xmoes = torch.empty(tp, max(1, xmoe), tokens, hid, **bf) if xmoe else None

    def step(self, a, step, **kw):
        AllRanks(self.comm).run_ranks(
            a["partials"],
            self.prefixes,
            a["blocks"],
            a["norm"],
            a["query"],
            a["out_norm"],
            self.outputs,
            step,
            xmoes=self.xmoes,
            **kw,
        )

    def armed(self):
        return self.comm.armed()

    def close(self):
        self.backend.teardown()


def _check_step(s, a, prefix_old, want_out, want_prefix):
    for r in range(s.tp):
        assert torch.equal(s.prefixes[r].view(torch.int16), want_prefix.view(torch.int16)), (
            f"rank {r}: prefix_new not bitwise"
        )
        assert torch.equal(s.outputs[r].view(torch.int16), s.outputs[0].view(torch.int16)), (
            f"rank {r}: output differs from rank 0"
        )
        if s.xmoe:
            for rep in range(s.xmoe):
                assert torch.equal(
                    s.xmoes[r, rep].view(torch.int16), s.outputs[r].view(torch.int16)
                )
    return ulp_check(s.outputs[0], want_out)


CASES = [  # tp, tokens, hid, nb, has_delta, groups, xmoe
    (2, 1, 1024, 0, True, 1, 0),
    (2, 3, 2048, 1, False, 2, 0),
    (4, 2, 2048, 3, True, 4, 1),
    (4, 8, 1024, 8, True, 3, 0),
    (8, 1, 7168, 8, True, 2, 2),
    (8, 5, 2048, 3, False, 4, 0),
    (16, 1, 7168, 8, True, 4, 1),
    (16, 4, 2048, 1, True, 3, 0),
    (16, 8, 1024, 0, True, 1, 0),
    (16, 2, 4096, 8, True, 2, 0),
    (4, 1, 8192, 8, True, 1, 0),
    (8, 6, 1024, 0, False, None, 1),
    (1, 2, 1024, 1, True, 1, 0),  # TP 1: one rank's own slot
    (3, 3, 2048, 2, True, 2, 1),  # odd TP: groups of 2 and 1
    (5, 4, 1024, 8, False, 3, 0),  # odd TP: groups of 2, 2, 1
    # other multiples of 256 (plan.slicing): 3 CTAs of 768 columns (Kimi-Linear), 5 of 1024,
    # 1 of 256, 5 of 256 (more exchange pushes than lead threads), 1 of 2816 (352 threads)
    (8, 2, 2304, 8, True, 4, 1),
    (16, 1, 5120, 3, True, None, 1),
    (2, 1, 256, 2, True, 1, 0),
    (5, 2, 1280, 8, False, 2, 0),
    (4, 2, 2816, 2, True, 2, 1),
]


@pytest.mark.parametrize(
    "index, case",
    list(enumerate(CASES)),
    ids=[f"c{i}-tp{c[0]}-hid{c[2]}" for i, c in enumerate(CASES)],
)
def test_consumer_matches_reference(index, case):
    """Four steps: parity 0 and parity 1 on clean data against the reference, a step with a
    sentinel word in a partial (parity 0: the publisher canonicalises it, nothing hangs),
    then parity 1 again with partials 0 and 1 cancelling at 2^20 (any other summation order
    than the rank order loses the other ranks' bits). (eps, out_eps) = SCALARS[index % 3]."""
    tp, tokens, hid, nb, has_delta, groups, xmoe = case
    eps, out_eps = SCALARS[index % len(SCALARS)]
    s = _Setup(tp, tokens, hid, nb, has_delta=has_delta, groups=groups, xmoe=xmoe,
               scalars=(eps, out_eps))  # fmt: skip
    worst, exact = 0.0, []
    for step in range(4):
        a = random_inputs(tp, tokens, hid, nb, seed=1000 * tp + 10 * tokens + step)
        if step == 2:  # a sentinel word in a partial must be canonicalised, not hang
            a["partials"].view(torch.int32)[tp - 1, tokens - 1, 3] = -1
        if step == 3 and tp >= 3:  # X - X + small: only the rank order keeps the small bits
            a["partials"][0] = (a["partials"][0].float() * 2.0**20).to(torch.bfloat16)
            a["partials"][1] = -a["partials"][0]
        s.prefixes.copy_(a["prefix"][None].expand_as(s.prefixes))
        poison(s.outputs)
        if s.xmoes is not None:
            poison(s.xmoes)
        s.step(a, step)
        torch.cuda.synchronize()
        assert int(s.comm.errors.abs().sum()) == 0, f"error words {s.comm.errors[:, 0].tolist()}"
        assert s.armed(), f"step {step}: mailbox not re-armed"
        if step == 2:
            _check_nan_step(s, tokens, hid)
            continue
        want_out, want_prefix = reference_step(a, a["prefix"], has_delta, s.groups, eps, out_eps)
        frac, ulps = _check_step(s, a, a["prefix"], want_out, want_prefix)
        exact.append(frac)
        worst = max(worst, ulps)
    if xmoe:
        want = 4 * slicing(hid).ctas * tokens  # 4 steps, one release increment per CTA
        got = s.comm.hint_words[:, 0].tolist()
        assert got == [want] * tp, f"hints {got} != {want}"
    print(f"\nTP{tp} T{tokens} HID{hid} nb{nb} delta={has_delta} groups={s.groups} xmoe={xmoe}: "
          f"exact fraction >= {min(exact):.5f}, worst {worst:.2f} ulp")  # fmt: skip
    s.close()


def _check_nan_step(s, tokens, hid):
    """Step with a sentinel word (0xFFFFFFFF, a NaN pair) in the last rank's partial: the
    publisher stores a canonical NaN instead, so the consumers complete; the NaN pair lands
    in prefix columns 6 and 7 of the last token (and nowhere else), ranks agree, re-armed."""
    for r in range(s.tp):
        assert torch.equal(s.prefixes[r].view(torch.int16), s.prefixes[0].view(torch.int16))
    nan = torch.isnan(s.prefixes[0].float())
    assert nan[tokens - 1, 6] and nan[tokens - 1, 7]
    assert int(nan.sum()) == 2, f"NaN beyond the poisoned pair: {nan.nonzero()[:4].tolist()}"
    assert nan.numel() == tokens * hid
    assert s.armed(), "NaN step: mailbox not re-armed"


def test_hundred_steps_in_a_row():
    tp, tokens, hid, nb = 8, 2, 2048, 3
    s = _Setup(tp, tokens, hid, nb, has_delta=True, groups=2, xmoe=1)
    pool = [random_inputs(tp, tokens, hid, nb, seed=7 + i) for i in range(3)]
    steps = 100
    outs = torch.empty(steps, tp, tokens, hid, dtype=torch.bfloat16, device="cuda")
    prefs = torch.empty_like(outs)
    s.prefixes.copy_(pool[0]["prefix"][None].expand_as(s.prefixes))
    for step in range(steps):
        s.step(pool[step % 3], step)
        outs[step].copy_(s.outputs)
        prefs[step].copy_(s.prefixes)
    torch.cuda.synchronize()
    assert int(s.comm.errors.abs().sum()) == 0
    assert s.armed()
    prefix = pool[0]["prefix"]
    worst = 0.0
    for step in range(steps):
        want_out, prefix = reference_step(pool[step % 3], prefix, True, s.groups)
        assert torch.equal(prefs[step].view(torch.int16),
                           prefix[None].expand_as(prefs[step]).contiguous().view(torch.int16)), (
            f"step {step}: prefix_new"
        )  # fmt: skip
        assert (outs[step].view(torch.int16) == outs[step, 0].view(torch.int16)).all()
        worst = max(worst, ulp_check(outs[step, 0], want_out)[1])
    assert s.comm.hint_words[:, 0].tolist() == [steps * 2 * tokens] * tp
    print(f"\n100 steps: worst {worst:.2f} ulp")
    s.close()


def test_graph_replay():
    tp, tokens, hid, nb = 4, 2, 1024, 1
    s = _Setup(tp, tokens, hid, nb, has_delta=True, groups=2)
    pool = [random_inputs(tp, tokens, hid, nb, seed=50 + i) for i in range(2)]
    s.prefixes.copy_(pool[0]["prefix"][None].expand_as(s.prefixes))
    for step in range(2):  # compile and load outside the capture
        s.step(pool[step], step)
    torch.cuda.synchronize()
    prefix = pool[0]["prefix"]
    for step in range(2):
        _, prefix = reference_step(pool[step], prefix, True, s.groups)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in range(2):
            s.step(pool[step], step)
    replays = 25
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    assert int(s.comm.errors.abs().sum()) == 0
    assert s.armed()
    for i in range(2 * replays):
        want_out, prefix = reference_step(pool[i % 2], prefix, True, s.groups)
    for r in range(tp):
        assert torch.equal(s.prefixes[r].view(torch.int16), prefix.view(torch.int16))
        assert torch.equal(s.outputs[r].view(torch.int16), s.outputs[0].view(torch.int16))
    ulp_check(s.outputs[0], want_out)
    s.close()


def test_never_publishing_rank_errors():
    tp, tokens, hid, nb, dead = 4, 2, 2048, 3, 2
    budget_ns = poll_budget_ns(20_000_000)
    s = _Setup(tp, tokens, hid, nb, groups=2, xmoe=1, budget_ns=budget_ns)
    a = random_inputs(tp, tokens, hid, nb, seed=3)
    s.prefixes.copy_(a["prefix"][None].expand_as(s.prefixes))
    s.step(a, 0)  # warm: compiled and loaded
    torch.cuda.synchronize()
    before = s.prefixes.clone()
    poison(s.outputs)
    live = [r for r in range(tp) if r != dead]
    start = time.perf_counter()
    s.step(a, 1, publishers=live)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    errors = s.comm.errors[:, 0].tolist()
    assert errors == [1 << dead] * tp, errors
    assert elapsed < 20 * budget_ns / 1e9, f"took {elapsed:.3f} s"
    assert torch.equal(s.prefixes, before), "an erroring consumer wrote prefix"
    assert (s.outputs.view(torch.int16) == 0x7F81).all(), "an erroring consumer wrote output"
    print(
        f"\ndead rank {dead}: every rank errored with mask {1 << dead:#x} in {elapsed * 1e3:.1f} ms"
    )
    s.comm.reset()
    s.prefixes.copy_(a["prefix"][None].expand_as(s.prefixes))
    s.step(a, 2)
    torch.cuda.synchronize()
    assert int(s.comm.errors.abs().sum()) == 0
    want_out, want_prefix = reference_step(a, a["prefix"], True, s.groups)
    _check_step(s, a, a["prefix"], want_out, want_prefix)
    s.close()


@pytest.mark.parametrize(
    "tp, tokens, hid, d_local, nb",
    [
        (2, 1, 1024, 128, 0),
        (4, 5, 2048, 384, 3),
        (16, 4, 2048, 768, 8),
        (8, 3, 7168, 1536, 1),
        (4, 8, 1024, 256, 0),
        (1, 3, 2048, 128, 1),  # TP 1
        (3, 2, 1024, 256, 2),  # odd TP
        (5, 4, 3072, 384, 0),
        (16, 2, 2304, 256, 8),
        (8, 3, 5120, 640, 1),
        (2, 2, 256, 128, 0),
    ],
)
def test_producer_publishes_projection(tp, tokens, hid, d_local, nb):
    """OprojProducer fills every rank's mailbox with bf16(attn_out @ w_o^T) (1 ulp), then
    the consumers take exactly those partials (prefix bitwise vs the reference)."""
    s = _Setup(tp, tokens, hid, nb, has_delta=True)
    g = torch.Generator(device="cuda").manual_seed(tp * 100 + tokens)
    attn = torch.randn(tp, tokens, d_local, generator=g, device="cuda").to(torch.bfloat16)
    w_os = (torch.randn(tp, hid, d_local, generator=g, device="cuda") * d_local**-0.5).to(
        torch.bfloat16
    )
    a = random_inputs(tp, tokens, hid, nb, seed=tp + tokens)
    worst = 0.0
    for step in range(2):
        for r in range(tp):
            s.comm.produce(attn[r], w_os[r], step, rank=r)
        torch.cuda.synchronize()
        boxes = [s.comm.mailbox.local(r)[step & 1].clone() for r in range(tp)]
        for r in range(1, tp):
            assert torch.equal(boxes[r].view(torch.int16), boxes[0].view(torch.int16))
        for r in range(tp):
            want = R.project(attn[r], w_os[r])
            worst = max(worst, ulp_check(boxes[0][r], want)[1])
        s.prefixes.copy_(a["prefix"][None].expand_as(s.prefixes))
        poison(s.outputs)
        s.step(dict(a, partials=None), step, publishers=())
        torch.cuda.synchronize()
        assert int(s.comm.errors.abs().sum()) == 0
        box = dict(a, partials=boxes[0])
        want_out, want_prefix = reference_step(box, a["prefix"], True, s.groups)
        _check_step(s, a, a["prefix"], want_out, want_prefix)
        assert s.armed()
    # the loopback run_ranks path with the producer
    s.prefixes.copy_(a["prefix"][None].expand_as(s.prefixes))
    AllRanks(s.comm).run_ranks(attn, s.prefixes, a["blocks"], a["norm"], a["query"], a["out_norm"],
                     s.outputs, 2, w_os=w_os)  # fmt: skip
    torch.cuda.synchronize()
    assert int(s.comm.errors.abs().sum()) == 0 and s.armed()
    print(f"\nproducer TP{tp} T{tokens} HID{hid} D{d_local}: worst {worst:.2f} ulp vs project")
    s.close()


TWOSHOT_CASES = [  # tp, tokens, hid, nb, has_delta, groups
    (8, 4, 2048, 3, True, 1),
    (16, 8, 2048, 8, True, 1),
    (4, 2, 1024, 0, False, 2),  # an empty group adds +0.0 to the gathered value
    (2, 1, 7168, 1, True, 1),
    (3, 2, 3072, 2, True, 1),  # odd TP: 1024 columns per shard
    (16, 4, 2304, 8, True, 1),  # 144-column shards: owners change inside a CTA's warps
    (10, 2, 5120, 2, True, 2),  # 512-column shards over 5 CTAs of 1024
    (8, 1, 256, 1, True, 1),  # 32-column shards: 4 threads each
]


@pytest.mark.parametrize("tp, tokens, hid, nb, has_delta, groups", TWOSHOT_CASES)
def test_twoshot_matches_reference(tp, tokens, hid, nb, has_delta, groups):
    s = _Setup(tp, tokens, hid, nb, has_delta=has_delta, groups=groups, twoshot=True)
    worst = 0.0
    for step in range(3):
        a = random_inputs(tp, tokens, hid, nb, seed=500 + 10 * tp + step)
        s.prefixes.copy_(a["prefix"][None].expand_as(s.prefixes))
        poison(s.outputs)
        s.step(a, step)
        torch.cuda.synchronize()
        assert int(s.comm.errors.abs().sum()) == 0, f"error words {s.comm.errors[:, 0].tolist()}"
        want_out, want_prefix = R.consume(
            a["partials"], a["prefix"], a["blocks"], a["norm"], a["query"], a["out_norm"],
            eps=EPS, out_eps=OUT_EPS, has_delta=has_delta, groups=groups, twoshot=True,
        )  # fmt: skip
        worst = max(worst, _check_step(s, a, a["prefix"], want_out, want_prefix)[1])
        assert s.armed(), f"step {step}: receive views or gather rows not re-armed"
    print(f"\ntwoshot TP{tp} T{tokens} HID{hid} nb{nb} groups={groups}: worst {worst:.2f} ulp")
    s.close()


def test_twoshot_producer_and_dead_rank():
    tp, tokens, hid, d_local, nb = 8, 4, 2048, 1536, 3
    s = _Setup(tp, tokens, hid, nb, twoshot=True, budget_ns=poll_budget_ns(20_000_000))
    g = torch.Generator(device="cuda").manual_seed(77)
    attn = torch.randn(tp, tokens, d_local, generator=g, device="cuda").to(torch.bfloat16)
    w_os = (torch.randn(tp, hid, d_local, generator=g, device="cuda") * d_local**-0.5).to(
        torch.bfloat16
    )
    a = random_inputs(tp, tokens, hid, nb, seed=78)
    width = hid // tp
    for step in range(2):
        for r in range(tp):
            s.comm.produce(attn[r], w_os[r], step, rank=r)
        torch.cuda.synchronize()
        # what each owner received, put back together as [TP, tokens, HID]
        delivered = torch.cat(
            [s.comm.rows.receive_view(o)[step & 1] for o in range(tp)], dim=2
        ).contiguous()
        for r in range(tp):
            ulp_check(delivered[r], R.project(attn[r], w_os[r]))
        s.prefixes.copy_(a["prefix"][None].expand_as(s.prefixes))
        s.step(dict(a, partials=None), step, publishers=())
        torch.cuda.synchronize()
        assert int(s.comm.errors.abs().sum()) == 0
        want_out, want_prefix = R.consume(
            delivered, a["prefix"], a["blocks"], a["norm"], a["query"], a["out_norm"],
            eps=EPS, out_eps=OUT_EPS, has_delta=True, groups=s.groups, twoshot=True,
        )  # fmt: skip
        _check_step(s, a, a["prefix"], want_out, want_prefix)
        assert s.armed() and delivered.shape[2] == width * tp
    # rank 5 never publishes: its shard's owner and every gather poll report it
    before = s.prefixes.clone()
    poison(s.outputs)
    s.step(a, 2, publishers=[r for r in range(tp) if r != 5])
    torch.cuda.synchronize()
    errors = s.comm.errors[:, 0].tolist()
    # every rank owns a shard and polls rank 5's receive slot: each names rank 5 (bit 5);
    # bit 0 (the gather row, which no owner could publish) may come with it; nothing else
    assert all(e & (1 << 5) and not e & ~((1 << 5) | 1) for e in errors), errors
    assert torch.equal(s.prefixes, before)
    s.comm.reset()
    assert s.armed()
    s.close()
