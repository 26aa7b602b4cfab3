"""GPU tests (one H200, loopback backend): the deep o-projection producer
(``OprojAllReduce(..., producer="deep")``, ``OprojProducerDeep``).

Checks, per step and both mailbox parities: every rank's mailbox slot of the producing
rank holds ``bf16(attn_out @ w_o^T)`` within 1 bf16 ulp of ``reference.project`` and
bitwise what the tiled ``OprojProducer`` publishes (same fragments, same warp-order sum);
a lone producing rank touches only its own slot of the step's parity (everything else
stays sentinel); the consumers then take exactly those partials (``prefix_new`` bitwise
vs the reference, output within 1 ulp, ranks identical, re-armed, no error word); the
``run_ranks(w_os=...)`` path bitwise equal to the tiled producer's; the k-slab ring
(D > 1536); CUDA-graph replay; PDL (``attn_out`` written by the kernel just before);
twoshot (the owners' receive views).

    python -m pytest -q -s tests/test_oproj_producer_gpu.py
"""

import pytest
import torch
from test_oproj_consumer_gpu import EPS, OUT_EPS, _inputs, _poison, _reference, _ulp_check

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import reference as R
from tpcomm.oproj.api import OprojAllReduce, _dl

pytestmark = pytest.mark.gpu
SENTINEL_I32 = -1


class _Pair:
    """One loopback backend, a deep and a tiled all-reduce on it, weights and buffers."""

    def __init__(self, tp, tokens, hid, nb, d_local, seed, **kw):
        self.backend = LoopbackBackend(tp)
        self.comms = {
            v: OprojAllReduce(
                self.backend, tokens, hid, nb, eps=EPS, out_eps=OUT_EPS, producer=v, **kw
            )  # fmt: skip
            for v in ("deep", "tiled")
        }
        self.deep = self.comms["deep"]
        self.tp, self.tokens, self.hid, self.nb, self.d = tp, tokens, hid, nb, d_local
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.attn = torch.randn(tp, tokens, d_local, generator=g, device="cuda").to(torch.bfloat16)
        w = torch.randn(tp, hid, d_local, generator=g, device="cuda") * d_local**-0.5
        self.w_os = w.to(torch.bfloat16)
        bf = dict(dtype=torch.bfloat16, device="cuda")
        self.prefixes = {v: torch.empty(tp, tokens, hid, **bf) for v in self.comms}
        self.outputs = {v: torch.empty(tp, tokens, hid, **bf) for v in self.comms}

    def produce(self, variant, step, ranks=None):
        comm = self.comms[variant]
        for r in range(self.tp) if ranks is None else ranks:
            comm.produce(self.attn[r], self.w_os[r], step, rank=r)
        torch.cuda.synchronize()

    def delivered(self, variant, step):
        """What the consumers read for ``step``: rank 0's mailbox slots [TP, tokens, HID]
        (twoshot: the owners' receive views side by side)."""
        comm = self.comms[variant]
        if comm.twoshot:
            views = [comm.rows.receive_view(o)[step & 1] for o in range(self.tp)]
            return torch.cat(views, dim=2).contiguous()
        return comm.mailbox.local(0)[step & 1].clone()

    def close(self):
        self.backend.teardown()


def _bits(t):
    return t.contiguous().view(torch.int16)


def _check_partials(s, partials):
    worst = 0.0
    for r in range(s.tp):
        worst = max(worst, _ulp_check(partials[r], R.project(s.attn[r], s.w_os[r]))[1])
    return worst


CASES = [  # tp, tokens, hid, d_local, nb
    (2, 1, 1024, 128, 0),
    (4, 5, 2048, 384, 3),
    (16, 4, 2048, 768, 8),
    (16, 1, 7168, 768, 8),  # the TP16 decode shape
    (8, 3, 7168, 1536, 1),  # TP8: the whole 48 KiB tile in one request
    (8, 8, 2048, 1536, 0),
    (4, 8, 1024, 256, 0),
    (4, 3, 2048, 3072, 1),  # ring: 4 slabs through 2 stages
    (2, 2, 7168, 6144, 0),  # ring: 8 slabs through 2 stages
]


@pytest.mark.parametrize("tp, tokens, hid, d_local, nb", CASES)
def test_deep_matches_tiled_and_reference(tp, tokens, hid, d_local, nb):
    s = _Pair(tp, tokens, hid, nb, d_local, seed=tp * 100 + tokens + d_local)
    a = _inputs(tp, tokens, hid, nb, seed=tp + tokens)
    comm, worst = s.deep, 0.0
    for step in range(3):  # both parities, odd count
        p = step & 1
        # a lone producing rank writes its own slot of parity p on every rank, nothing else
        lone = tp - 1
        s.produce("deep", step, ranks=[lone])
        for r in range(tp):
            words = comm.mailbox.local(r).view(torch.int32)
            assert (words[p, lone] != SENTINEL_I32).all(), f"rank {r}: slot not published"
            rest = torch.ones(2, tp, dtype=torch.bool, device=words.device)
            rest[p, lone] = False
            assert (words[rest] == SENTINEL_I32).all(), f"rank {r}: another slot touched"
        s.produce("deep", step, ranks=range(tp - 1))
        s.produce("tiled", step)
        boxes = [comm.mailbox.local(r)[p].clone() for r in range(tp)]
        for r in range(1, tp):
            assert torch.equal(_bits(boxes[r]), _bits(boxes[0])), f"rank {r}: mailbox differs"
        assert torch.equal(_bits(boxes[0]), _bits(s.delivered("tiled", step))), (
            "deep partials are not bitwise the tiled producer's"
        )
        worst = max(worst, _check_partials(s, boxes[0]))
        s.comms["tiled"].mailbox.arm()
        # the consumers take exactly the published partials
        prefixes, outputs = s.prefixes["deep"], s.outputs["deep"]
        prefixes.copy_(a["prefix"][None].expand_as(prefixes))
        _poison(outputs)
        comm.run_ranks(None, prefixes, a["blocks"], a["norm"], a["query"], a["out_norm"],
                       outputs, step, publishers=())  # fmt: skip
        torch.cuda.synchronize()
        assert int(comm.errors.abs().sum()) == 0, f"error words {comm.errors[:, 0].tolist()}"
        want_out, want_prefix = _reference(dict(a, partials=boxes[0]), a["prefix"], True,
                                           comm.groups)  # fmt: skip
        for r in range(tp):
            assert torch.equal(_bits(prefixes[r]), _bits(want_prefix)), f"rank {r}: prefix"
            assert torch.equal(_bits(outputs[r]), _bits(outputs[0])), f"rank {r}: output"
        _ulp_check(outputs[0], want_out)
        assert comm.armed(), f"step {step}: mailbox not re-armed"
    # run_ranks(w_os=...): the deep producer + consumers, bitwise the tiled pair's
    for v, c in s.comms.items():
        s.prefixes[v].copy_(a["prefix"][None].expand_as(s.prefixes[v]))
        _poison(s.outputs[v])
        c.run_ranks(s.attn, s.prefixes[v], a["blocks"], a["norm"], a["query"], a["out_norm"],
                    s.outputs[v], 3, w_os=s.w_os)  # fmt: skip
        torch.cuda.synchronize()
        assert int(c.errors.abs().sum()) == 0 and c.armed(), v
    assert torch.equal(_bits(s.prefixes["deep"]), _bits(s.prefixes["tiled"]))
    assert torch.equal(_bits(s.outputs["deep"]), _bits(s.outputs["tiled"]))
    print(f"\ndeep TP{tp} T{tokens} HID{hid} D{d_local}: bitwise the tiled producer, "
          f"worst {worst:.2f} ulp vs project")  # fmt: skip
    s.close()


def _published_chain(s, a, steps):
    """Reference prefix after ``steps`` steps of the same inputs (the deep partials)."""
    s.produce("deep", 0)
    partials = s.delivered("deep", 0)
    s.deep.mailbox.arm()
    prefix, out = a["prefix"], None
    for _ in range(steps):
        out, prefix = _reference(dict(a, partials=partials), prefix, True, s.deep.groups)
    return out, prefix


@pytest.mark.parametrize("d_local", [256, 3072])
def test_deep_graph_replay(d_local):
    tp, tokens, hid, nb = 4, 2, 1024, 1
    s = _Pair(tp, tokens, hid, nb, d_local, seed=50)
    a = _inputs(tp, tokens, hid, nb, seed=51)
    comm, prefixes, outputs = s.deep, s.prefixes["deep"], s.outputs["deep"]
    prefixes.copy_(a["prefix"][None].expand_as(prefixes))

    def steps():
        for step in range(2):
            comm.run_ranks(s.attn, prefixes, a["blocks"], a["norm"], a["query"],
                           a["out_norm"], outputs, step, w_os=s.w_os)  # fmt: skip

    steps()  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    replays = 25
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    assert int(comm.errors.abs().sum()) == 0 and comm.armed()
    got_prefix, got_out = prefixes.clone(), outputs.clone()
    want_out, want_prefix = _published_chain(s, a, 2 + 2 * replays)
    for r in range(tp):
        assert torch.equal(_bits(got_prefix[r]), _bits(want_prefix)), f"rank {r}: prefix"
        assert torch.equal(_bits(got_out[r]), _bits(got_out[0])), f"rank {r}: output"
    _ulp_check(got_out[0], want_out)
    s.close()


def _launch_pdl(comm, fn, attn, w_o, step, rank, stream):
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64

    fn(_dl(attn), _dl(w_o), _dl(comm.peers[rank], 8), Int64(comm.multicast_base), Int32(rank),
       Int32(step & 1), cuda.CUstream(stream.cuda_stream))  # fmt: skip


@pytest.mark.parametrize("graph", [False, True])
def test_deep_pdl_reads_what_the_previous_kernel_wrote(graph):
    """With PDL the weights stream before the wait; ``attn_out``, written by the kernel
    launched just before on the same stream, is read after it: the mailbox is bitwise
    the non-PDL run's."""
    from tpcomm.oproj.producer import compiled_producer

    tp, tokens, hid, nb, d_local = 8, 4, 7168, 0, 1536
    s = _Pair(tp, tokens, hid, nb, d_local, seed=11)
    comm = s.deep
    s.produce("deep", 0)
    want = s.delivered("deep", 0)
    comm.mailbox.arm()
    fn = compiled_producer(tp, hid, d_local, comm.multicast_base != 0, comm.fence, True,
                           variant="deep")  # fmt: skip
    buffers = torch.empty_like(s.attn)

    def launches():
        stream = torch.cuda.current_stream()  # the capture stream inside the capture
        _poison(buffers)
        for r in range(tp):
            buffers[r].copy_(s.attn[r])  # the previous kernel writes attn_out
            _launch_pdl(comm, fn, buffers[r], s.w_os[r], 0, r, stream)

    if graph:
        launches()  # load outside the capture
        torch.cuda.synchronize()
        comm.mailbox.arm()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launches()
        for _ in range(3):
            comm.mailbox.arm()
            g.replay()
    else:
        launches()
    torch.cuda.synchronize()
    got = s.delivered("deep", 0)
    assert torch.equal(_bits(got), _bits(want)), "PDL run differs from the plain run"
    s.close()


def test_deep_twoshot_matches_tiled():
    tp, tokens, hid, d_local, nb = 8, 4, 2048, 1536, 3
    s = _Pair(tp, tokens, hid, nb, d_local, seed=77, twoshot=True)
    a = _inputs(tp, tokens, hid, nb, seed=78)
    comm = s.deep
    for step in range(2):
        s.produce("deep", step)
        s.produce("tiled", step)
        got = s.delivered("deep", step)
        assert torch.equal(_bits(got), _bits(s.delivered("tiled", step)))
        _check_partials(s, got)
        s.comms["tiled"].rows.arm()
        prefixes, outputs = s.prefixes["deep"], s.outputs["deep"]
        prefixes.copy_(a["prefix"][None].expand_as(prefixes))
        _poison(outputs)
        comm.run_ranks(None, prefixes, a["blocks"], a["norm"], a["query"], a["out_norm"],
                       outputs, step, publishers=())  # fmt: skip
        torch.cuda.synchronize()
        assert int(comm.errors.abs().sum()) == 0
        want_out, want_prefix = R.consume(
            got, a["prefix"], a["blocks"], a["norm"], a["query"], a["out_norm"],
            eps=EPS, out_eps=OUT_EPS, has_delta=True, groups=comm.groups, twoshot=True,
        )  # fmt: skip
        for r in range(tp):
            assert torch.equal(_bits(prefixes[r]), _bits(want_prefix)), f"rank {r}: prefix"
        _ulp_check(outputs[0], want_out)
        assert comm.armed(), "receive views or gather rows not re-armed"
    s.close()
