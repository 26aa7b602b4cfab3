"""GPU tests (one H200, loopback backend): every rank in one launch
(``AllRanks.run_ranks(..., mode="one-launch")``: one publisher or producer launch and
one consumer launch for all TP ranks, grid rank index = rank).

Checks, over several steps (both mailbox parities, the prefix chained): prefixes, outputs,
xmoe copies and hint counters bitwise those of the per-rank launches on one stream each
(``run_ranks``), the prefix bitwise and the output within 1 bf16 ulp of
``tpcomm.oproj.reference``, every rank's output identical, the mailboxes re-armed, no error
word; outputs poisoned first, and a guard rank's row past the last rank (prefix, output,
xmoe, error and hint words) bitwise untouched; PDL between the launches; CUDA-graph replay.

    python -m pytest -q -s tests/test_oproj_one_launch_gpu.py
"""

import pytest
import torch
from test_oproj_consumer_gpu import EPS, OUT_EPS, poison, random_inputs, reference_step, ulp_check

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce

pytestmark = pytest.mark.gpu


def _bits(t):
    return t.contiguous().view(torch.int16)


class _Twin:
    """Two all-reduces on one loopback backend: per-rank launches and one launch."""

    def __init__(self, tp, tokens, hid, nb, d_local, xmoe, seed):
        self.backend = LoopbackBackend(tp)
        kw = dict(eps=EPS, out_eps=OUT_EPS, xmoe_reps=xmoe)
        self.comms = {m: OprojAllReduce(self.backend, tokens, hid, nb, **kw) for m in "po"}
        self.tp, self.tokens, self.hid, self.xmoe = tp, tokens, hid, xmoe
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.attn = torch.randn(tp, tokens, d_local, generator=g, device="cuda").to(torch.bfloat16)
        w = torch.randn(tp, hid, d_local, generator=g, device="cuda") * d_local**-0.5
        self.w_os = w.to(torch.bfloat16)
        bf = dict(dtype=torch.bfloat16, device="cuda")
        # one guard rank past the last: the one launch must never touch it
        self.prefixes = {m: torch.empty(tp + 1, tokens, hid, **bf) for m in "po"}
        self.outputs = {m: torch.empty(tp + 1, tokens, hid, **bf) for m in "po"}
        self.xmoes = {m: torch.empty(tp + 1, max(1, xmoe), tokens, hid, **bf) for m in "po"}

    def reset(self, prefix):
        for m in "po":
            self.prefixes[m].copy_(prefix[None].expand_as(self.prefixes[m]))
            poison(self.outputs[m])
            poison(self.xmoes[m])

    def step(self, mode, a, step, project, pdl=False):
        comm = self.comms[mode]
        tp = self.tp
        partials = self.attn if project else a["partials"]
        AllRanks(comm).run_ranks(
            partials,
            self.prefixes[mode][:tp],
            a["blocks"],
            a["norm"],
            a["query"],
            a["out_norm"],
            self.outputs[mode][:tp],
            step,
            xmoes=self.xmoes[mode][:tp] if self.xmoe else None,
            w_os=self.w_os if project else None,
            mode="one-launch" if mode == "o" else "per-rank",
            pdl=pdl and mode == "o",
        )

    def close(self):
        self.backend.teardown()


CASES = [  # tp, tokens, hid, nb, d_local, xmoe, project
    (16, 1, 7168, 8, 768, 0, True),  # the TP16 decode shape
    (16, 4, 2048, 3, 256, 1, True),
    (8, 3, 7168, 0, 1536, 0, True),
    (8, 8, 1024, 1, 128, 2, False),  # publisher of ready partials
    (2, 2, 1024, 8, 128, 0, False),
    (4, 5, 8192, 2, 512, 0, True),
]


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("tp, tokens, hid, nb, d_local, xmoe, project", CASES)
def test_one_launch_bitwise_per_rank_launches(tp, tokens, hid, nb, d_local, xmoe, project, pdl):
    s = _Twin(tp, tokens, hid, nb, d_local, xmoe, seed=tp * 10 + tokens + nb)
    a = random_inputs(tp, tokens, hid, nb, seed=tp + tokens + d_local)
    s.reset(a["prefix"])
    guard = {m: (s.prefixes[m][tp].clone(), s.outputs[m][tp].clone(), s.xmoes[m][tp].clone())
             for m in "po"}  # fmt: skip
    one = s.comms["o"]
    prefix, worst = a["prefix"], 0.0
    for step in range(3):  # both parities, the prefix chained
        for m in "po":
            poison(s.outputs[m][:tp])
            s.step(m, a, step, project, pdl)
        torch.cuda.synchronize()
        for m, c in s.comms.items():
            assert int(c.errors.abs().sum()) == 0, f"{m}: error words {c.errors[:, 0].tolist()}"
            assert c.armed(), f"{m} step {step}: mailbox not re-armed"
        for name, d in (("prefix", s.prefixes), ("output", s.outputs), ("xmoe", s.xmoes)):
            assert torch.equal(_bits(d["o"]), _bits(d["p"])), f"step {step}: {name} differs"
        # a rank's hints landing in another rank's row would differ here
        assert torch.equal(one.hint_words, s.comms["p"].hint_words), "hint counters differ"
        for r in range(tp):
            assert torch.equal(_bits(s.outputs["o"][r]), _bits(s.outputs["o"][0])), f"rank {r}"
        if not project:  # ready partials: the reference's prefix bitwise, output <= 1 ulp
            want_out, prefix = reference_step(a, prefix, True, one.groups)
            for r in range(tp):
                assert torch.equal(_bits(s.prefixes["o"][r]), _bits(prefix)), f"rank {r}"
            worst = max(worst, ulp_check(s.outputs["o"][0], want_out)[1])
        else:  # the producer's partials are checked against R.project elsewhere
            assert not torch.equal(_bits(s.prefixes["o"][0]), _bits(a["prefix"]))
    for m in "po":
        rows = (s.prefixes[m][tp], s.outputs[m][tp], s.xmoes[m][tp])
        for t, g in zip(rows, guard[m], strict=True):
            assert torch.equal(_bits(t), _bits(g)), f"{m}: the guard rank's row was written"
    print(f"\none launch TP{tp} T{tokens} HID{hid} nb{nb} project={project} "
          f"pdl={pdl}: bitwise per-rank launches; worst {worst:.2f} ulp")  # fmt: skip
    s.close()


@pytest.mark.parametrize("project", [False, True])
def test_one_launch_graph_replay(project):
    tp, tokens, hid, nb, d_local = 16, 1, 7168, 8, 768
    s = _Twin(tp, tokens, hid, nb, d_local, 0, seed=77)
    a = random_inputs(tp, tokens, hid, nb, seed=78)
    s.reset(a["prefix"])

    def steps(mode):
        for step in range(2):
            s.step(mode, a, step, project, pdl=True)

    for m in "po":
        steps(m)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps("o")
    replays = 20
    for _ in range(replays):
        graph.replay()
    for _ in range(replays):
        steps("p")
    torch.cuda.synchronize()
    for m, c in s.comms.items():
        assert int(c.errors.abs().sum()) == 0 and c.armed(), m
    assert torch.equal(_bits(s.prefixes["o"]), _bits(s.prefixes["p"]))
    assert torch.equal(_bits(s.outputs["o"]), _bits(s.outputs["p"]))
    s.close()


@pytest.mark.parametrize("project", [True, False], ids=["producer", "publisher"])
@pytest.mark.parametrize("tp", [1, 3, 8])
def test_pdl_waits_for_an_early_releasing_predecessor(tp, project):
    """One-launch with PDL right after a predecessor that releases its dependents first,
    spins, then writes the producer's ``attn_out`` (or the publisher's partials), poisoned
    before: the step must equal the per-rank launches on the clean inputs, bit for bit."""
    from test_kda_kernels_gpu import replay_after_predecessor

    tokens, hid, nb, d_local = 3, 2048, 2, 256
    s = _Twin(tp, tokens, hid, nb, d_local, 1, seed=90 + tp)
    a = random_inputs(tp, tokens, hid, nb, seed=91 + tp)
    inputs = s.attn if project else a["partials"]
    clean = inputs.clone()
    s.reset(a["prefix"])
    for m in "po":  # compile and load, step 0
        s.step(m, a, 0, project, pdl=True)
    torch.cuda.synchronize()
    s.reset(a["prefix"])
    s.step("p", a, 1, project)  # the expected step, parity 1
    torch.cuda.synchronize()
    replay_after_predecessor(lambda: s.step("o", a, 1, project, pdl=True), [clean], [inputs])
    for m, c in s.comms.items():
        assert int(c.errors.abs().sum()) == 0, f"{m}: error words {c.errors[:, 0].tolist()}"
        assert c.armed(), m
    for name, d in (("prefix", s.prefixes), ("output", s.outputs), ("xmoe", s.xmoes)):
        assert torch.equal(_bits(d["o"][:tp]), _bits(d["p"][:tp])), f"{name} differs"
    assert not torch.isnan(s.outputs["o"][:tp].float()).any()
    s.close()
