"""``Bucket``: the buffers of one step shape of the GPU runner (``launch.runner``);
``shard_inputs``, a full-layer step's inputs split by rank; ``oproj_plan``, the
o-projection plan of a rows bucket; ``twoshot_partials``, the partials read back from the
twoshot receive views."""

from __future__ import annotations

import torch

from kda import synthetic as kt
from kda.validate import GATE_RANK, HEAD_DIM
from launch.layer import step_kind
from tpcomm.oproj.allreduce import wgmma_device
from tpcomm.oproj.plan import Plan, choose


def oproj_plan(tp: int, rows: int, hidden: int, oproj_launch: str, split: bool = False) -> Plan:
    """The o-projection plan of a rows bucket for the runner's launches on this process's
    GPU (``OprojAllReduce``'s: the wgmma producer on sm_90): one launch for every rank
    (``both``): one-shot; per-rank launches: the deployment's plan (one rank per GPU:
    ``choose``'s twoshot from the measured crossovers), one-shot with a split domain (puts
    with signal between domains need the one-shot mailbox)."""
    wgmma = wgmma_device()
    if oproj_launch != "per-rank":
        return choose(tp, rows, hidden, one_launch=True, wgmma=wgmma)
    return choose(tp, rows, hidden, twoshot=False if split else None, wgmma=wgmma)


def twoshot_partials(views: torch.Tensor) -> torch.Tensor:
    """Every rank's partial ``[TP, N, HID]`` from the twoshot receive views of one parity
    stacked by owner, ``[TP owner, TP source, N, HID / TP]``: owner o holds columns
    ``o * HID / TP ..`` of every source's partial."""
    owners, sources, n, shard = views.shape
    if owners != sources:
        raise ValueError(f"views must be [TP, TP, N, HID / TP]; got {tuple(views.shape)}")
    return views.permute(1, 2, 0, 3).reshape(sources, n, owners * shard)


def shard_inputs(step: kt.Step, tp: int):
    """A full-layer step's per-head inputs split by rank, each stacked ``[TP, ...]``: ``x``
    [TP, N, 3 D] (rank r's q | k | v columns, as ``kt.shard_step``), ``gate`` [TP, N, D],
    ``beta`` [TP, N, H]."""
    N, heads = step.beta.shape
    per = heads // tp
    D = per * HEAD_DIM
    x = step.x.view(N, 3, tp, D).permute(2, 0, 1, 3).reshape(tp, N, 3 * D)
    return x, step.gate.view(N, tp, D).transpose(0, 1), step.beta.view(N, tp, per).transpose(0, 1)


class Bucket:
    """The captured buffers of one (tokens, record) step shape; graphs per parity. Per-rank
    buffers have one row per rank hosted here (``runner``: the ``launch.runner.Runner``,
    its ``ranks``)."""

    def __init__(self, runner, tokens: int, record: bool):
        cfg, dev = runner.cfg, runner.device
        B, T, n = cfg.requests, tokens, len(runner.ranks)
        H = cfg.heads_per_rank
        D, N = H * HEAD_DIM, B * T
        self.tokens, self.record, self.rows = T, record, N
        self.replay = cfg.replay
        self.comm = runner.comm_for(N)
        bf = dict(dtype=torch.bfloat16, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.x = torch.zeros(n, N, 3 * D, **bf)
        self.f_a = torch.zeros(N, GATE_RANK, **bf)
        self.beta = torch.zeros(n, N, H, **bf)
        self.gate = torch.zeros(n, N, D, **bf)
        self.slots = torch.zeros((B,) if T == 1 else (B, T), **i32)
        self.accepted = torch.ones(B, **i32) if T > 1 else None
        self.committed = torch.ones(B, **i32) if record else None
        self.attn = torch.zeros(n, N, D, **bf)
        self.v_records = self.kg_records = None
        if record:
            self.v_records = torch.zeros(n, B, H, T, HEAD_DIM, dtype=torch.float32, device=dev)
            self.kg_records = torch.zeros(n, B, H, T, 2 * HEAD_DIM, **bf)
        self.prefix = torch.zeros(n, N, cfg.hidden, **bf)
        self.output = torch.zeros(n, N, cfg.hidden, **bf)
        self.blocks = torch.zeros(N, cfg.blocks, cfg.hidden, **bf) if cfg.blocks else None
        self.xmoe, self.moe_in = runner.moe.buffers(n, N, cfg.hidden)  # copies, waiter reads
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stage_us: dict[str, float] | None = None
        self.kda_choice = None

    @property
    def kind(self) -> str:
        return step_kind(self.tokens, self.record, self.replay)
