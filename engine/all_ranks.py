"""``AllRanksStep``: the decode step of every TP rank of one GPU (loopback) from one process.

Each rank's KDA goes through its ``DecodeLayer`` (``attend``, ``recover``); the
o-projection of all ranks is one producer launch and one consumer launch
(``tpcomm.oproj.all_ranks.AllRanks``: ``produce_all``, ``consume_all``, on the current
stream; with PDL the consumer launches early and waits in-kernel), bitwise what the ranks'
own ``DecodeLayer.step`` give. The all-reduces must be built with ``one_launch=True``
(``engine.all_reduces(..., one_launch=True)``). On the CPU (the layers' all-reduces
``HostAllReduce``, e.g. a loopback backend on the CPU) the same calls run each rank's
references in turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.layer import DecodeLayer, step_options
from tpcomm.oproj.all_ranks import AllRanks


class AllRanksStep:
    """``layers``: rank r's ``DecodeLayer`` at index r, every rank 0..TP-1, sharing their
    all-reduces; ``w_os``: their ``w_o`` stacked ``[TP, HID, D_local]`` (contiguous; the
    layers' ``w_o`` may be its rows), default stacked from the layers'."""

    def __init__(self, layers: Sequence[DecodeLayer], w_os: torch.Tensor | None = None):
        if [layer.rank for layer in layers] != list(range(len(layers))):
            raise ValueError("layers must be ranks 0..TP-1 in order")
        self.layers = list(layers)
        self.w_os = torch.stack([layer.w_o for layer in layers]) if w_os is None else w_os
        lead = self.layers[0]
        self.norm, self.query, self.out_norm, self.pdl = (
            lead.norm,
            lead.query,
            lead.out_norm,
            lead.pdl,
        )
        self.reference = lead.reference  # CPU all-reduces: every rank's reference in turn

    def ranks(self, rows: int) -> AllRanks:
        """The one-launch driver of the ``rows`` bucket's all-reduce."""
        return AllRanks(self.layers[0].comm(rows))

    def produce(self, attn, parity: int) -> None:
        """Every rank's ``bf16(attn[r] @ w_o[r]^T)`` into every mailbox: one launch (on the
        CPU, each rank's reference in rank order)."""
        if self.reference:
            for r, layer in enumerate(self.layers):
                layer.produce(attn[r], parity)
            return
        self.ranks(attn.shape[1]).produce_all(attn, self.w_os, parity, pdl=self.pdl)

    def consume(self, prefix, blocks, output, parity: int, xmoe=None) -> None:
        """Every rank's all-reduce, residual (``prefix`` [TP, rows, HID] in place), AttnRes
        and norm into ``output`` (and ``xmoe`` [TP, reps, rows, HID]): one launch."""
        if self.reference:
            if xmoe is not None:
                raise ValueError("xmoe: the MoE latent copies are GPU-only")
            for r, layer in enumerate(self.layers):
                layer.consume(prefix[r], blocks, output[r], parity)
            return
        shared = (blocks, self.norm, self.query, self.out_norm)
        ranks = self.ranks(prefix.shape[1])
        ranks.consume_all(prefix, *shared, output, parity, xmoes=xmoe, pdl=self.pdl)

    def step(self, x, f_a, beta, gate, slots, prefix, blocks, parity: int, **options):
        """``DecodeLayer.step`` of every rank (the same ``options``): per-rank inputs and
        buffers stacked ``[TP, ...]`` (``x``, ``beta``, ``gate``, ``prefix``, ``output``,
        ``attn``; ``records`` a pair of such), shared ones as one rank takes them; KDA rank
        by rank, then ``produce`` and ``consume``. Returns ``output`` [TP, rows, HID]."""
        output, kda_options = step_options(options)
        attn, records = kda_options.pop("out"), kda_options.pop("records")
        if attn is None:
            attn = x.new_empty((len(self.layers), x.shape[1], self.w_os.shape[-1]))
        for r, layer in enumerate(self.layers):
            mine = None if records is None else (records[0][r], records[1][r])
            layer.kda_stage(
                x[r], f_a, beta[r], gate[r], slots, records=mine, out=attn[r], **kda_options
            )
        self.produce(attn, parity)
        if output is None:
            output = torch.empty_like(prefix)
        self.consume(prefix, blocks, output, parity)
        return output


__all__ = ["AllRanksStep"]
