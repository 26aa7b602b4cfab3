"""GPU tests (one H200, loopback backend): OprojFused, the producer + consumer in one launch.

Every TP rank launches its fused kernel on its own stream (``run_ranks(mode="fused")``).
Checks, per step: ``prefix`` and ``output`` (and the xmoe copies) bitwise equal to the
unfused ``OprojProducer`` + ``OprojConsumer`` pair on the same inputs; against
``tpcomm.oproj.reference`` fed the partials the producer publishes (themselves within
1 bf16 ulp of ``reference.project``): ``prefix_new`` bitwise, ``output`` within 1 bf16
ulp, every rank's output identical; outputs poisoned first, mailboxes re-armed after
each step, no error word, hints counted. Then many steps in a row, CUDA-graph replay,
PDL, twoshot, a rank that never launches (error words naming it, no hang, nothing
written), and a shape whose CTAs cannot all be resident on the one GPU (refused before
any launch).

    python -m pytest -q tests/test_oproj_fused_gpu.py
"""

import time

import pytest
import torch
from shared_gpu import poll_budget_ns
from test_oproj_consumer_gpu import EPS, OUT_EPS, poison, ulp_check

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import reference as R
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce
from tpcomm.oproj.plan import slicing

pytestmark = pytest.mark.gpu
KINDS = ("pair", "fused")


def random_inputs(tp, tokens, hid, nb, d_local, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def bf(*shape, s=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, device="cuda") * s + shift).to(torch.bfloat16)

    return dict(
        attn=bf(tp, tokens, d_local),
        prefix=bf(tokens, hid),
        blocks=bf(tokens, nb, hid) if nb else None,
        norm=bf(hid, s=0.1, shift=1.0),
        query=bf(hid, s=0.2),
        out_norm=bf(hid, s=0.1, shift=1.0),
    )


class _Setup:
    """One loopback all-reduce with result buffers for the unfused pair and the fused run."""

    def __init__(self, tp, tokens, hid, nb, d_local, *, groups=None, has_delta=True, xmoe=0,
                 **kw):  # fmt: skip
        self.backend = LoopbackBackend(tp)
        self.comm = OprojAllReduce(self.backend, tokens, hid, nb, has_delta=has_delta,
                                   groups=groups, xmoe_reps=xmoe, eps=EPS, out_eps=OUT_EPS,
                                   **kw)  # fmt: skip
        self.tp, self.tokens, self.hid, self.nb = tp, tokens, hid, nb
        self.has_delta, self.groups, self.xmoe = has_delta, self.comm.groups, xmoe
        g = torch.Generator(device="cuda").manual_seed(tp * 1000 + hid + d_local)
        w = torch.randn(tp, hid, d_local, generator=g, device="cuda") * d_local**-0.5
        self.w_os = w.to(torch.bfloat16)
        bf = dict(dtype=torch.bfloat16, device="cuda")
        self.prefixes = {k: torch.empty(tp, tokens, hid, **bf) for k in KINDS}
        self.outputs = {k: torch.empty(tp, tokens, hid, **bf) for k in KINDS}
        self.xmoes = {k: torch.empty(tp, xmoe, tokens, hid, **bf) for k in KINDS} if xmoe else None

    def start(self, kind, prefix):
        """Every rank's prefix set, outputs poisoned."""
        self.prefixes[kind].copy_(prefix[None].expand_as(self.prefixes[kind]))
        poison(self.outputs[kind])
        if self.xmoes is not None:
            poison(self.xmoes[kind])

    def run(self, kind, a, step, **kw):
        AllRanks(self.comm).run_ranks(
            a["attn"], self.prefixes[kind], a["blocks"], a["norm"], a["query"], a["out_norm"],
            self.outputs[kind], step, xmoes=None if self.xmoes is None else self.xmoes[kind],
            w_os=self.w_os, mode="fused" if kind == "fused" else "per-rank", **kw,
        )  # fmt: skip

    def published(self, attn, step):
        """The partials the producer publishes for ``attn`` [TP, HID] per rank, as the
        consumer reads them (twoshot: the owners' receive views side by side); re-armed."""
        for r in range(self.tp):
            self.comm.produce(attn[r], self.w_os[r], step, rank=r)
        torch.cuda.synchronize()
        if self.comm.twoshot:
            rows = self.comm.rows
            got = torch.cat([rows.receive_view(o)[step & 1] for o in range(self.tp)], dim=2)
            got = got.contiguous()
            rows.arm()
        else:
            got = self.comm.mailbox.local(0)[step & 1].clone()
            self.comm.mailbox.arm()
        return got

    def reference(self, partials, a, prefix):
        return R.consume(partials, prefix, a["blocks"], a["norm"], a["query"], a["out_norm"],
                         eps=EPS, out_eps=OUT_EPS, has_delta=self.has_delta, groups=self.groups,
                         twoshot=self.comm.twoshot)  # fmt: skip

    def no_errors(self):
        assert int(self.comm.errors.abs().sum()) == 0, (
            f"error words {self.comm.errors[:, 0].tolist()}"
        )

    def close(self):
        self.backend.teardown()


def _bits(t):
    return t.contiguous().view(torch.int16)


def _same(a, b, what):
    assert torch.equal(_bits(a), _bits(b)), what


def _check_against_reference(s, kind, want_out, want_prefix):
    for r in range(s.tp):
        _same(s.prefixes[kind][r], want_prefix, f"rank {r}: prefix_new not bitwise")
        _same(s.outputs[kind][r], s.outputs[kind][0], f"rank {r}: output differs from rank 0")
        for rep in range(s.xmoe):
            _same(s.xmoes[kind][r, rep], s.outputs[kind][r], f"rank {r}: xmoe copy {rep}")
    return ulp_check(s.outputs[kind][0], want_out)[1]


def _check_fused_is_pair(s):
    for r in range(s.tp):
        _same(s.prefixes["fused"][r], s.prefixes["pair"][r], f"rank {r}: prefix fused != pair")
        _same(s.outputs["fused"][r], s.outputs["pair"][r], f"rank {r}: output fused != pair")
        if s.xmoes is not None:
            _same(s.xmoes["fused"][r], s.xmoes["pair"][r], f"rank {r}: xmoe fused != pair")


# tp, tokens, nb, hid, groups, d_local, has_delta, xmoe: HID and groups chosen so that
# every rank's fused CTAs fit on the one GPU (TP16 at HID 7168 with 4 groups cannot)
CASES = [
    (2, 1, 0, 7168, None, 256, True, 0),
    (2, 1, 8, 7168, None, 512, True, 1),
    (2, 4, 0, 7168, None, 256, False, 0),
    (2, 4, 8, 7168, None, 256, True, 0),
    (2, 8, 0, 7168, None, 384, True, 0),
    (2, 8, 8, 7168, None, 256, True, 2),
    (8, 1, 0, 7168, None, 1536, True, 0),
    (8, 1, 8, 7168, None, 768, True, 1),
    (8, 4, 0, 7168, None, 256, True, 0),
    (8, 4, 8, 7168, None, 256, False, 0),
    (8, 8, 0, 2048, None, 256, True, 0),
    (8, 8, 8, 7168, 1, 256, True, 1),
    (16, 1, 0, 2048, None, 768, True, 0),
    (16, 1, 8, 7168, 1, 768, True, 1),
    (16, 4, 0, 2048, 4, 256, True, 0),
    (16, 4, 8, 7168, 1, 256, True, 0),
    (16, 8, 0, 1024, None, 256, True, 0),
    (16, 8, 8, 2048, 1, 256, False, 1),
    (1, 2, 1, 2048, None, 256, True, 0),  # TP 1
    (3, 4, 2, 2048, None, 256, True, 0),  # odd TP
    (5, 1, 8, 1024, None, 384, True, 1),
    # other multiples of 256: 3 CTAs of 768 columns, 4 x 96 threads = 3 producer teams
    (16, 2, 8, 2304, None, 256, True, 1),
    (8, 4, 3, 2304, 4, 256, False, 0),
    (4, 1, 2, 5120, None, 512, True, 0),  # 5 CTAs of 1024
    (2, 2, 1, 256, 4, 128, True, 0),  # one 32-thread group a CTA each: one team
]


@pytest.mark.parametrize("tp, tokens, nb, hid, groups, d_local, has_delta, xmoe", CASES)
def test_fused_matches_pair_and_reference(tp, tokens, nb, hid, groups, d_local, has_delta,
                                          xmoe):  # fmt: skip
    s = _Setup(tp, tokens, hid, nb, d_local, groups=groups, has_delta=has_delta, xmoe=xmoe)
    plan = s.comm.fused_plan()
    assert plan.launches == tp and tp * plan.ctas <= plan.capacity
    worst, worst_partial = 0.0, 0.0
    steps = 3  # both parities, odd count
    for step in range(steps):
        a = random_inputs(tp, tokens, hid, nb, d_local, seed=100 * tp + 10 * tokens + step)
        partials = s.published(a["attn"], step)
        for r in range(tp):
            got = ulp_check(partials[r], R.project(a["attn"][r], s.w_os[r]))[1]
            worst_partial = max(worst_partial, got)
        for kind in KINDS:
            s.start(kind, a["prefix"])
            s.run(kind, a, step)
            torch.cuda.synchronize()
            s.no_errors()
            assert s.comm.armed(), f"step {step} {kind}: mailbox not re-armed"
        _check_fused_is_pair(s)
        want_out, want_prefix = s.reference(partials, a, a["prefix"])
        worst = max(worst, _check_against_reference(s, "fused", want_out, want_prefix))
    if xmoe:
        want = len(KINDS) * steps * slicing(hid).ctas * tokens
        assert s.comm.hint_words[:, 0].tolist() == [want] * tp
    print(f"\nfused TP{tp} T{tokens} HID{hid} nb{nb} groups={s.groups} tiles={plan.tiles}: "
          f"worst {worst:.2f} ulp (partials {worst_partial:.2f})")  # fmt: skip
    s.close()


def _pool(s, d_local, n, seed):
    """``n`` input sets and the partials the producer publishes for each."""
    pool = [random_inputs(s.tp, s.tokens, s.hid, s.nb, d_local, seed=seed + i) for i in range(n)]
    return pool, [s.published(a["attn"], 0) for a in pool]


def test_fused_steps_in_a_row():
    tp, tokens, hid, nb, d_local, steps = 8, 2, 2048, 3, 512, 31
    s = _Setup(tp, tokens, hid, nb, d_local, groups=2, xmoe=1)
    pool, partials = _pool(s, d_local, 3, seed=7)
    shape = (steps, tp, tokens, hid)
    outs = {k: torch.empty(shape, dtype=torch.bfloat16, device="cuda") for k in KINDS}
    prefs = {k: torch.empty_like(outs[k]) for k in KINDS}
    for kind in KINDS:
        s.start(kind, pool[0]["prefix"])
        for step in range(steps):
            s.run(kind, pool[step % 3], step)
            outs[kind][step].copy_(s.outputs[kind])
            prefs[kind][step].copy_(s.prefixes[kind])
        torch.cuda.synchronize()
        s.no_errors()
        assert s.comm.armed()
    _same(outs["fused"], outs["pair"], "outputs: fused != pair")
    _same(prefs["fused"], prefs["pair"], "prefixes: fused != pair")
    prefix, worst = pool[0]["prefix"], 0.0
    for step in range(steps):
        want_out, prefix = s.reference(partials[step % 3], pool[step % 3], prefix)
        _same(prefs["fused"][step], prefix[None].expand(tp, -1, -1), f"step {step}: prefix")
        assert (_bits(outs["fused"][step]) == _bits(outs["fused"][step, 0])).all()
        worst = max(worst, ulp_check(outs["fused"][step, 0], want_out)[1])
    assert s.comm.hint_words[:, 0].tolist() == [2 * steps * 2 * tokens] * tp
    print(f"\n{steps} fused steps: worst {worst:.2f} ulp")
    s.close()


def test_fused_graph_replay():
    tp, tokens, hid, nb, d_local = 4, 2, 1024, 1, 256
    s = _Setup(tp, tokens, hid, nb, d_local, groups=2)
    pool, partials = _pool(s, d_local, 2, seed=50)
    s.start("fused", pool[0]["prefix"])
    for step in range(2):  # compile and load outside the capture
        s.run("fused", pool[step], step)
    torch.cuda.synchronize()
    prefix = pool[0]["prefix"]
    for step in range(2):
        _, prefix = s.reference(partials[step], pool[step], prefix)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in range(2):
            s.run("fused", pool[step], step)
    replays = 25
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    s.no_errors()
    assert s.comm.armed()
    for i in range(2 * replays):
        want_out, prefix = s.reference(partials[i % 2], pool[i % 2], prefix)
    for r in range(tp):
        _same(s.prefixes["fused"][r], prefix, f"rank {r}: prefix after replays")
        _same(s.outputs["fused"][r], s.outputs["fused"][0], f"rank {r}: output")
    ulp_check(s.outputs["fused"][0], want_out)
    s.close()


def test_fused_pdl_is_bitwise_the_same():
    tp, tokens, hid, nb, d_local = 8, 4, 2048, 8, 512
    s = _Setup(tp, tokens, hid, nb, d_local, groups=2, xmoe=1)
    a = random_inputs(tp, tokens, hid, nb, d_local, seed=11)
    for step, kind in enumerate(KINDS):  # "pair" slot holds the non-PDL fused run here
        s.start(kind, a["prefix"])
        AllRanks(s.comm).run_ranks(a["attn"], s.prefixes[kind], a["blocks"], a["norm"], a["query"],
                         a["out_norm"], s.outputs[kind], step, xmoes=s.xmoes[kind],
                         w_os=s.w_os, mode="fused", pdl=kind == "fused")  # fmt: skip
        torch.cuda.synchronize()
        s.no_errors()
        assert s.comm.armed()
    _check_fused_is_pair(s)
    s.close()


def test_fused_twoshot_matches_pair():
    tp, tokens, hid, nb, d_local = 8, 4, 2048, 3, 512
    s = _Setup(tp, tokens, hid, nb, d_local, groups=1, twoshot=True)
    for step in range(2):
        a = random_inputs(tp, tokens, hid, nb, d_local, seed=300 + step)
        partials = s.published(a["attn"], step)
        for kind in KINDS:
            s.start(kind, a["prefix"])
            s.run(kind, a, step)
            torch.cuda.synchronize()
            s.no_errors()
            assert s.comm.armed(), f"{kind}: receive views or gather rows not re-armed"
        _check_fused_is_pair(s)
        want_out, want_prefix = s.reference(partials, a, a["prefix"])
        _check_against_reference(s, "fused", want_out, want_prefix)
    s.close()


def test_fused_rank_that_never_launches_errors():
    tp, tokens, hid, nb, d_local, dead = 4, 2, 2048, 3, 256, 2
    budget_ns = poll_budget_ns(20_000_000)
    s = _Setup(tp, tokens, hid, nb, d_local, groups=2, xmoe=1, budget_ns=budget_ns)
    a = random_inputs(tp, tokens, hid, nb, d_local, seed=3)
    s.start("fused", a["prefix"])
    s.run("fused", a, 0)  # warm: compiled and loaded
    torch.cuda.synchronize()
    s.no_errors()
    before = s.prefixes["fused"].clone()
    poison(s.outputs["fused"])
    live = [r for r in range(tp) if r != dead]
    start = time.perf_counter()
    s.run("fused", a, 1, ranks=live)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    errors = s.comm.errors[:, 0].tolist()
    assert errors == [0 if r == dead else 1 << dead for r in range(tp)], errors
    assert elapsed < 20 * budget_ns / 1e9, f"took {elapsed:.3f} s"
    assert torch.equal(s.prefixes["fused"], before), "an erroring consumer wrote prefix"
    assert (_bits(s.outputs["fused"]) == 0x7F81).all(), "an erroring consumer wrote output"
    print(f"\nfused, dead rank {dead}: live ranks errored with {1 << dead:#x} "
          f"in {elapsed * 1e3:.1f} ms")  # fmt: skip
    s.comm.reset()
    assert s.comm.armed()
    partials = s.published(a["attn"], 2)
    s.start("fused", a["prefix"])
    s.run("fused", a, 2)
    torch.cuda.synchronize()
    s.no_errors()
    want_out, want_prefix = s.reference(partials, a, a["prefix"])
    _check_against_reference(s, "fused", want_out, want_prefix)
    s.close()


def test_fused_refuses_what_cannot_be_resident():
    """TP16 HID 7168 with 4 groups: 16 ranks x 7 x (1 + 1) CTAs of 512 threads do not fit
    on one GPU: refused before anything is launched (the consumer alone would fit)."""
    tp, tokens, hid, nb, d_local = 16, 1, 7168, 8, 256
    s = _Setup(tp, tokens, hid, nb, d_local, groups=4)
    a = random_inputs(tp, tokens, hid, nb, d_local, seed=5)
    s.start("fused", a["prefix"])
    with pytest.raises(ValueError, match="co-resident"):
        s.run("fused", a, 0)
    with pytest.raises(ValueError, match="co-resident"):
        s.comm.produce_consume(a["attn"][0], s.w_os[0], s.prefixes["fused"][0], a["blocks"],
                               a["norm"], a["query"], a["out_norm"], s.outputs["fused"][0], 0,
                               rank=0)  # fmt: skip
    torch.cuda.synchronize()
    assert (_bits(s.outputs["fused"]) == 0x7F81).all()
    assert s.comm.armed()
    assert s.comm.fused_plan(launches=1).tiles == 1  # one rank per GPU would fit
    s.close()
