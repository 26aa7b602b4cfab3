"""The parts of the step-latency model (``scripts/model_step.py``): parameters, links,
one rank's step (ours) and the NCCL peer's, priced from one GPU's kernel figures and the
links between GPUs. No file is read here; ``model_step.build`` fills the parameters.

Contract. Every number is a ``Param`` with a unit, a kind and a source: ``measured`` (read
from docs/data/*.json), ``derived`` (from measured figures by the rule its source states),
``stated`` (a published figure, ``STATED``; replaced key by key by docs/data/links.json
once the links are measured on two GPUs) or ``fitted`` (to the two-GPU rows its source
names). Times in us, one rank per GPU, Kimi shapes (``HEADS``, ``HIDDEN``, ``BLOCKS``).
Plain Python: ``tpcomm.oproj.plan`` (the twoshot crossover) is the only project import.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tpcomm.oproj.plan import MAX_TOKENS, choose  # noqa: E402

DATA = ROOT / "docs" / "data"
HEADS, HEAD_DIM, HIDDEN, BLOCKS, BF16 = 96, 128, 7168, 8, 2
GPUS_PER_NODE = 8  # an HGX H200 node: one NVLink domain of 8 GPUs, one 400 Gb/s NIC each
TPS, REQUESTS, TOKENS = (2, 4, 8, 16), (1, 8, 32, 128, 256), (1, 4)
LIMIT = 0.15  # the calibration bound: |predicted / measured - 1|


@dataclass(frozen=True)
class Param:
    value: float
    unit: str
    kind: str  # "measured", "derived", "stated" or "fitted"
    source: str


def stated(value, unit, source) -> Param:
    return Param(float(value), unit, "stated", source)


def measured(value, unit, source) -> Param:
    return Param(float(value), unit, "measured", source)


def derived(value, unit, source) -> Param:
    return Param(float(value), unit, "derived", source)


NCCL_SRC = (
    "NCCL's tuning model, recent releases (src/graph/tuning.cc: baseLat, hwLat; the NET "
    "figure used for ring and tree alike; NVLS off, as in the project's runs)"
)
STATED = {
    "nvlink_gbps": stated(
        450,
        "GB/s",
        "NVLink 4 (H100 / H200 SXM): 18 links, 900 GB/s "
        "bidirectional, 450 GB/s per direction per GPU (NVIDIA H200 datasheet)",
    ),
    "nvlink_efficiency": stated(
        0.83,
        "",
        "unidirectional P2P writes on an HGX H100 measured "
        "371-377 GB/s of 450 (p2pBandwidthLatencyTest in NVIDIA/nccl#1264)",
    ),
    "nvlink_latency_us": stated(
        1.5,
        "us",
        "a store's visibility at the peer plus the flag's "
        "poll, 1-2 us assumed: P2P write latency 1.8-2.3 us in "
        "p2pBandwidthLatencyTest (NVIDIA/cuda-samples#230, a copy "
        "engine op); 0.5-0.7 us per NVLink step in simulators "
        "(astra-sim#59)",
    ),
    "ib_gbps": stated(
        50,
        "GB/s",
        "InfiniBand NDR, 400 Gb/s per GPU (one ConnectX-7 per "
        "GPU in an HGX H200 node; ConnectX-7 user manual)",
    ),
    "ib_efficiency": stated(0.9, "", "assumed: RDMA write payload share of a 400 Gb/s link"),
    "ib_latency_us": stated(
        4.0,
        "us",
        "3-5 us assumed for a put-with-signal across one "
        "switch: NCCL's model counts 2.7-5.0 us per network step "
        "(hwLat NET); a 2-node all_reduce of 8 B took 19-20 us with "
        "one GPU per node (NVIDIA/nccl-tests#150)",
    ),
    "nccl_busbw_gbps": stated(
        360,
        "GB/s",
        "NCCL all_reduce bus bandwidth, Simple protocol, "
        "8 GPUs of one NVLink node (NVLS off) and two nodes of 8 x 400 "
        "Gb/s (0.9 x 8 x 50 GB/s): assumed from the P2P figure above",
    ),
    "nccl_base_ll_us": stated(6.6, "us", NCCL_SRC + ": baseLat ring LL 6.6 (tree 6.8)"),
    "nccl_base_ll128_us": stated(14.0, "us", NCCL_SRC + ": baseLat LL128 14.0"),
    "nccl_base_simple_us": stated(8.4, "us", NCCL_SRC + ": baseLat Simple 8.4"),
    "nccl_hw_nvlink_ll_us": stated(0.6, "us", NCCL_SRC + ": hwLat NVLink LL 0.6 per step"),
    "nccl_hw_nvlink_ll128_us": stated(1.9, "us", NCCL_SRC + ": hwLat NVLink ring LL128 1.9"),
    "nccl_hw_nvlink_simple_us": stated(3.4, "us", NCCL_SRC + ": hwLat NVLink ring Simple 3.4"),
    "nccl_hw_net_ll_us": stated(5.0, "us", NCCL_SRC + ": hwLat NET tree LL 5.0 (ring 2.7)"),
    "nccl_hw_net_ll128_us": stated(8.5, "us", NCCL_SRC + ": hwLat NET tree LL128 8.5"),
    "nccl_hw_net_simple_us": stated(14.0, "us", NCCL_SRC + ": hwLat NET tree Simple 14"),
}

# NCCL's bandwidth shares per protocol (ring, tree), as its tuning model applies them
NCCL_PROTOCOLS = (("ll", 1 / 4, 1 / 3.8), ("ll128", 0.92, 7 / 9), ("simple", 1.0, 1.0))


# What the model takes for granted (docs/tp_model.md, the report JSON)
ASSUMPTIONS = [
    "One rank per GPU. TP <= 8: one HGX H200 node, one NVLink domain; TP 16: two nodes of "
    "8, two domains, ranks of the other node reached by put-with-signal over one 400 Gb/s "
    "NIC per GPU. Kimi shapes (96 heads, HID 7168, nb 8), every request live, the per-step "
    "KDA path (T 4: a verify step, not recorded, no recover).",
    "One GPU's kernel figures hold for a rank on its own GPU: KDA from the kernel table by "
    "items = heads per rank x B (L2 rotated), the mma.sync producer at one rank's measured "
    "rate, cuBLAS and the consumer at the efficiencies fitted to the loopback rows tables.",
    "The chain's fixed part (launch overlap inside the graph, L2 reuse between back-to-back "
    "steps) is the B 8 anchor's at every B, T and head count (TP 2 and 4 take TP 8's).",
    "Exchange: the stores are not overlapped with compute; every GPU sends and receives the "
    "same bytes at once; NVLink at 83% of 450 GB/s per direction, 1.5 us to visibility.",
    "Split domains: one-shot (the code's rule), one put per remote rank issued one after "
    "another on the stream at the two-GPU measured issue cost, its bytes at 90% of 50 GB/s, "
    "the last landing 4 us later; the consumer's signal wait and re-arm cost what they cost "
    "over NVLink on two GPUs. Host-initiated puts over InfiniBand (IBRC proxy) may cost more.",
    "sync (fitted at TP 2) is the same with 7 or 15 peers; more peers can only skew more.",
    "Twoshot where the plan's per-rank crossover says (TP 8 from 8 rows, TP 16 from 4; "
    "measured on loopback, provisional across GPUs); never across domains.",
    "Peer: fla's composed path = its recurrence (kernel table) + the conv / gate / norm "
    "kernels' median at H >= 12 (at H 6 fla's composed path measured about 3x its "
    "recurrence at B >= 32, so the TP 16 peer may be slower than modelled); the torch "
    "epilogue linear in rows, fitted on 1-256 rows and extrapolated to 1024; NCCL all_reduce "
    "by NCCL's tuning model at 360 GB/s bus bandwidth, NVLS off; T 4 prices fla's "
    "recurrence at T 4 (fla's conv update takes one token: no measured counterpart).",
    "Not modelled: other layers between two steps of a layer (w_o and state cold in L2: the "
    "KDA table is cold, the anchor warm), MoE traffic on the same links, host dispatch.",
]


def interp(points, x: float) -> float:
    """Piecewise-linear through ``points`` [(x, y)] (equal x averaged): clamped below the
    first point (a latency floor), the last segment's slope above the last."""
    xs: dict = {}
    for px, py in points:
        xs.setdefault(float(px), []).append(float(py))
    pts = sorted((px, statistics.fmean(ys)) for px, ys in xs.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


@dataclass(frozen=True)
class Topology:
    """``tp`` ranks, one per GPU, in domains of ``domain`` ranks; ranks of other domains are
    reached over ``remote`` ("ib" between nodes; "nvlink" for a domain split declared on one
    node, as the two-GPU ``--domain-size 1`` run)."""

    tp: int
    domain: int
    remote: str = "ib"

    @property
    def nodes(self) -> int:
        return -(-self.tp // GPUS_PER_NODE) if self.remote == "ib" else 1


def deployed(tp: int) -> Topology:
    """TP <= 8: one node, one domain; TP 16: two nodes of 8 (two NVLink domains)."""
    return Topology(tp, min(tp, GPUS_PER_NODE))


class Model:
    """The parts of one rank's step, from the parameters and the one-GPU tables."""

    def __init__(self, params: dict, kda_points: dict, fla_points: dict, anchors: dict):
        """``params`` name -> Param; ``kda_points`` / ``fla_points`` {T: [(items, us)]};
        ``anchors`` {tp: {tp, requests, heads_per_rank, us}} (measured one-rank chains)."""
        self.p = params
        self.kda_points, self.fla_points, self.anchors = kda_points, fla_points, anchors

    def v(self, name: str) -> float:
        return self.p[name].value

    def with_params(self, kind: str = "fitted", **values) -> Model:
        """A copy with ``values`` (name -> (value, source)) of ``kind`` (units kept)."""
        params = dict(self.p)
        for name, (value, source) in values.items():
            unit = params[name].unit if name in params else "us"
            params[name] = Param(float(value), unit, kind, source)
        return Model(params, self.kda_points, self.fla_points, self.anchors)

    # --- one GPU's kernels ---------------------------------------------------------------

    def kda_us(self, items: int, tokens: int) -> float:
        """kda.decode of ``items`` = heads x requests (one GPU, the dispatcher's kernel)."""
        return interp(self.kda_points[tokens], items)

    def fla_us(self, items: int, tokens: int) -> float:
        """fla's composed KDA: its recurrence (by items) plus the conv / gate / norm kernels."""
        return interp(self.fla_points[tokens], items) + self.v("fla_extra_us")

    def gemm_us(self, rows: int, d_local: int) -> float:
        """cuBLAS ``[rows, d_local] @ [d_local, HID]``: bytes of w_o at the copy bandwidth or
        FLOPs at the large-GEMM rate, whichever is longer, over the measured efficiency."""
        w_o = d_local * HIDDEN * BF16
        flops = 2 * rows * d_local * HIDDEN
        t = max(w_o / (self.v("copy_tbps") * 1e6), flops / (self.v("gemm_tflops") * 1e6))
        return t / self.v("gemm_efficiency") + self.v("launch_us")

    def producer_us(self, rows: int, d_local: int) -> float:
        """The rank's producer: mma.sync streaming w_o (rows <= 8) at one rank's measured
        rate, else cuBLAS into the staging partial plus the publisher's pass (read it, write
        the rank's own slot); stores to peers are the exchange's."""
        if rows <= MAX_TOKENS:
            return d_local * HIDDEN * BF16 / (self.v("producer_tbps") * 1e6)
        publish = 2 * rows * HIDDEN * BF16 / (self.v("copy_tbps") * self.v("publish_share") * 1e6)
        return self.gemm_us(rows, d_local) + publish + self.v("launch_us")

    def consumer_us(self, tp: int, slots: int, rows: int) -> float:
        """The rank's consumer at ``tp``: a fixed latency plus (slots read + nb blocks +
        prefix read and write + output) rows of HID bf16 at the consumers' bandwidth measured
        at TP 8 (TP <= 8) or TP 16."""
        nbytes = rows * HIDDEN * BF16 * (slots + BLOCKS + 3)
        tbps = self.v("consumer_tbps_tp16" if tp > GPUS_PER_NODE else "consumer_tbps_tp8")
        return self.v("consumer_fixed_us") + nbytes / (tbps * 1e6)

    # --- between GPUs --------------------------------------------------------------------

    def link(self, kind: str) -> tuple[float, float]:
        """(latency us, bytes per us) of "nvlink" or "ib"."""
        bw = self.v(f"{kind}_gbps") * self.v(f"{kind}_efficiency") * 1e3
        return self.v(f"{kind}_latency_us"), bw

    def exchange(self, topo: Topology, rows: int, twoshot: bool) -> dict:
        """The partial's trip: {"local", "remote", "us"}. Inside a domain the producer's
        stores reach every peer over NVLink (one-shot: (domain - 1) partials out of each GPU;
        twoshot: two hops of (tp - 1) / tp of one); each rank of another domain gets one
        put-with-signal issued on the stream after the producer, one after another (each
        ``put_us`` to issue, then its bytes on the link), the last landing one link latency
        later, and the consumer's signal wait and re-arm cost ``split_us``."""
        part = rows * HIDDEN * BF16
        lat, bw = self.link("nvlink")
        if twoshot:
            hops = 2 * lat + 2 * (topo.tp - 1) / topo.tp * part / bw
            return {"local": hops, "remote": 0.0, "us": hops}
        local = lat + (topo.domain - 1) * part / bw if topo.domain > 1 else 0.0
        if topo.domain == topo.tp:
            return {"local": local, "remote": 0.0, "us": local}
        rlat, rbw = self.link(topo.remote)
        remote = (topo.tp - topo.domain) * (self.v("put_us") + part / rbw) + rlat
        return {"local": local, "remote": remote, "us": max(local, remote) + self.v("split_us")}

    def nccl_us(self, topo: Topology, nbytes: int) -> float:
        """NCCL all_reduce of ``nbytes``: the fastest of LL / LL128 / Simple on a ring or a
        tree as NCCL's tuning model prices them (latency + bytes / algorithm bandwidth)."""
        n, nodes = topo.tp, topo.nodes
        ppn = n // nodes
        bus = self.v("nccl_busbw_gbps") * 1e3
        best = math.inf
        for proto, ring_share, tree_share in NCCL_PROTOCOLS:
            base, intra = self.v(f"nccl_base_{proto}_us"), self.v(f"nccl_hw_nvlink_{proto}_us")
            inter = self.v(f"nccl_hw_net_{proto}_us")
            if nodes > 1 and proto == "ll":
                intra *= 1.8
            steps, inter_steps = 2 * (n - 1), 2 * (nodes - 1)
            ring = base + (steps - inter_steps) * intra + inter_steps * inter
            tree = base + 2 * ((ppn - 1) * intra + math.log2(nodes) * inter)
            ring_bw = bus * ring_share * n / steps
            tree_bw = bus * 0.9 * tree_share * 0.5
            best = min(best, ring + nbytes / ring_bw, tree + nbytes / tree_bw)
        return best

    def epilogue_us(self, rows: int) -> float:
        """The peer's residual + AttnRes + RMSNorm in torch ops (fitted: fixed + per row)."""
        return self.v("epilogue_us") + rows * self.v("epilogue_row_us")

    # --- the steps -----------------------------------------------------------------------

    def anchor(self, heads_per_rank: int) -> dict:
        """The measured one-rank chain whose heads per rank are nearest (in ratio)."""
        return min(
            self.anchors.values(), key=lambda a: abs(math.log(a["heads_per_rank"] / heads_per_rank))
        )

    def plan(self, topo: Topology, rows: int) -> str:
        """The exchange path: "one-shot", "twoshot" (the plan's per-rank crossover, one
        domain only) or "split" (domains: one-shot with puts)."""
        if topo.domain < topo.tp:
            return "split"
        return "twoshot" if choose(topo.tp, rows, HIDDEN).twoshot else "one-shot"

    def ours(
        self,
        topo: Topology,
        requests: int,
        tokens: int,
        heads: int = HEADS,
        path: str | None = None,
    ) -> dict:
        """One rank's step: {"kda", "producer", "consumer", "fixed", "comm", "us", "path"}."""
        h, rows = heads // topo.tp, requests * tokens
        path = path or self.plan(topo, rows)
        a = self.anchor(h)
        parts_at_anchor = (
            self.kda_us(a["heads_per_rank"] * a["requests"], 1)
            + self.producer_us(a["requests"], a["heads_per_rank"] * HEAD_DIM)
            + self.consumer_us(a["tp"], a["tp"], a["requests"])
        )
        slots = 2 if path == "twoshot" else topo.tp
        out = {
            "kda": self.kda_us(h * requests, tokens),
            "producer": self.producer_us(rows, h * HEAD_DIM),
            "consumer": self.consumer_us(topo.tp, slots, rows),
            "fixed": a["us"] - parts_at_anchor,
        }
        x = self.exchange(topo, rows, path == "twoshot")
        out.update(comm=x["us"] + self.v("sync_us"), remote=x["remote"], path=path)
        out["us"] = out["kda"] + out["producer"] + out["consumer"] + out["fixed"] + out["comm"]
        return out

    def hierarchical(self, topo: Topology, requests: int, tokens: int) -> dict:
        """What-if, not built: across domains a reduce-scatter inside each domain, one put of
        the rank's reduced 1 / domain share to its counterpart in every other domain, an
        all-gather inside the domain; the rest of the step as ``ours``. {us, comm, consumer}."""
        step = self.ours(topo, requests, tokens)
        part = requests * tokens * HIDDEN * BF16
        lat, bw = self.link("nvlink")
        rlat, rbw = self.link(topo.remote)
        inside = 2 * (lat + (topo.domain - 1) / topo.domain * part / bw)
        puts = topo.tp // topo.domain - 1
        across = puts * (self.v("put_us") + part / topo.domain / rbw) + rlat
        comm = inside + across + self.v("split_us") + self.v("sync_us")
        consumer = self.consumer_us(topo.tp, 2, requests * tokens)
        us = step["us"] - step["comm"] - step["consumer"] + comm + consumer
        return {"us": us, "comm": comm, "consumer": consumer}

    def oproj(self, topo: Topology, rows: int, d_local: int) -> dict:
        """``bench_allreduce.py``'s ``ours: producer + consumer`` and ``consumer alone`` (per
        iteration, the bench's own offset ``bench_us`` on each)."""
        x = self.exchange(topo, rows, False)["us"] + self.v("sync_us")
        consumer = self.consumer_us(topo.tp, topo.tp, rows)
        both = self.producer_us(rows, d_local) + consumer + x
        return {"ours": both + self.v("bench_us"), "consumer": consumer + self.v("bench_us")}

    def peer(self, topo: Topology, requests: int, tokens: int, heads: int = HEADS) -> dict:
        """The NCCL peer's step per rank: {"kda", "producer" (cuBLAS partial), "comm" (NCCL),
        "consumer" (torch epilogue), "us"}. T > 1 prices fla's recurrence at T tokens (its
        conv update takes one: no measured counterpart)."""
        h, rows = heads // topo.tp, requests * tokens
        out = {
            "kda": self.fla_us(h * requests, tokens),
            "producer": self.gemm_us(rows, h * HEAD_DIM),
            "comm": self.nccl_us(topo, rows * HIDDEN * BF16),
            "consumer": self.epilogue_us(rows),
        }
        out["us"] = sum(out.values())
        return out

    def peer_oproj(self, topo: Topology, rows: int, d_local: int) -> float:
        """``bench_allreduce.py``'s ``nccl: gemm + all_reduce + torch ops``."""
        return (
            self.gemm_us(rows, d_local)
            + self.nccl_us(topo, rows * HIDDEN * BF16)
            + self.epilogue_us(rows)
            + self.v("bench_us")
        )
