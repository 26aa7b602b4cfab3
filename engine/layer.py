"""``DecodeLayer``: one TP rank's decode step of a KDA layer, as an engine calls it.

Built from the rank's weight shard (``kda.synthetic.Layer``'s fields: conv, gate and norm
weights, the state and conv pools; the rank's ``w_o`` columns), the o-projection
all-reduces of the symmetric backend, one per rows bucket (``all_reduces``: tokens per
step, requests x tokens; an engine pads a batch up to a bucket) and the AttnRes weights.
``step`` runs, on the current stream: ``kda.decode`` (PDL: its page loads overlap the
previous kernel's tail), ``kda.recover`` after a recorded verify step, the producer
(``bf16(attn @ w_o^T)`` into every rank's mailbox) and the consumer (rank-order sum,
residual into ``prefix`` in place, AttnRes, output RMSNorm). Every call goes through the
registered ops, so the step is graph-capturable and a ``torch.compile(fullgraph=True)``
caller traces it in one graph; the layer marks its weights and pools as static addresses,
so ``mode="reduce-overhead"`` neither copies them nor refuses their in-place updates (mark
the engine's persistent ``prefix`` / ``output`` buffers the same way).

The consumer spins until every rank's partial of the step has landed: with one rank per
GPU each process steps its layer; with every rank on one GPU (loopback) either step each
rank on its own stream, or on one stream run every rank's ``attend`` and ``produce`` before
any ``consume``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

import kda
from kda import dispatch
from kda import synthetic as kt
from kda.validate import HEAD_DIM
from tpcomm.oproj.api import OprojAllReduce

_WEIGHTS = ("conv_weight", "conv_bias", "a_log", "dt_bias", "norm_weight", "f_b")


def all_reduces(backend, rows, hidden: int, blocks: int, **kwargs) -> dict[int, OprojAllReduce]:
    """One ``OprojAllReduce`` per rows bucket on ``backend`` (``kwargs``: its options), the
    all-reduces every ``DecodeLayer`` of this process shares. Collective on a backend of
    several processes: each builds the same buckets in the same order."""
    return {n: OprojAllReduce(backend, n, hidden, blocks, **kwargs) for n in sorted(set(rows))}


class DecodeLayer:
    """Rank ``rank``'s KDA layer + o-projection all-reduce (see the module docstring).

    ``comms``: rows -> ``OprojAllReduce`` (shared by the ranks of this process, read at
    each call, so buckets may be added later). ``kernel`` / ``gate_mode`` / ``pdl``:
    ``kda.decode``'s; ``sms``: the SMs the dispatcher may plan with (default the GPU's;
    on loopback a rank's share). ``lower_bound``, ``scale``, ``eps``: the KDA step's.
    """

    def __init__(self, shard, w_o: torch.Tensor, comms: Mapping[int, OprojAllReduce], *,
                 rank: int, norm: torch.Tensor, query: torch.Tensor, out_norm: torch.Tensor,
                 kernel: str = "auto", gate_mode: int = 3, pdl: bool = True,
                 sms: int | None = None, lower_bound: float = kt.LOWER_BOUND,
                 scale: float = kt.SCALE, eps: float = kt.EPS):  # fmt: skip
        if kernel not in dispatch.KERNELS:
            raise ValueError(f"kernel must be one of {dispatch.KERNELS}; got {kernel!r}")
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int; got {rank!r}")
        heads = shard.state.shape[1]
        if not isinstance(w_o, torch.Tensor) or w_o.dim() != 2 or w_o.shape[1] != heads * HEAD_DIM:
            raise ValueError(f"w_o must be [HID, {heads * HEAD_DIM}] (the rank's heads' columns)")
        self.shard, self.w_o, self.comms, self.rank = shard, w_o, comms, rank
        self.norm, self.query, self.out_norm = norm, query, out_norm
        self.kernel, self.gate_mode, self.pdl, self.sms = kernel, gate_mode, bool(pdl), sms
        self.lower_bound, self.scale, self.eps = lower_bound, scale, eps
        self.heads = heads
        self._choices: dict = {}
        held = [getattr(shard, n) for n in _WEIGHTS] + [shard.state, shard.conv_state]
        for t in held + [w_o, norm, query, out_norm]:
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t)

    # --- the parts of a step ---------------------------------------------------------
    def comm(self, rows: int) -> OprojAllReduce:
        """The all-reduce of the ``rows`` bucket; ValueError when there is none."""
        if rows not in self.comms:
            raise ValueError(f"no o-projection all-reduce for {rows} rows; buckets "
                             f"{sorted(self.comms)} (pad the batch to one)")  # fmt: skip
        return self.comms[rows]

    def choice(self, requests: int, tokens: int):
        """The KDA kernel for a step shape (``kda.dispatch.choose``), chosen once."""
        key = (requests, tokens)
        if key not in self._choices:
            sms = self.sms
            if sms is None:
                device = self.shard.state.device
                sms = torch.cuda.get_device_properties(device).multi_processor_count
            self._choices[key] = dispatch.choose(requests, self.heads, tokens, sms=sms,
                                                 kernel=self.kernel)  # fmt: skip
        return self._choices[key]

    def attend(self, x, f_a, beta, gate, slots, *, accepted=None, records=None, out=None,
               choice=None):  # fmt: skip
        """``kda.decode`` on this rank's heads: [B*T, D_local] bf16 (into ``out`` if given).
        ``choice`` overrides ``self.choice`` (a ``kda.dispatch.Choice``)."""
        L = self.shard
        if choice is None:
            requests = slots.shape[0]
            choice = self.choice(requests, x.shape[0] // requests)
        return kda.decode(
            x, L.conv_weight, L.conv_bias, L.conv_state, f_a, beta, L.a_log, L.dt_bias, slots,
            L.state, gate, L.norm_weight, L.f_b, lower_bound=self.lower_bound,
            scale=self.scale, eps=self.eps, accepted=accepted,
            conv_dim_first=L.conv_dim_first, records=records, kernel=choice.kernel,
            cluster=choice.cluster if choice.kernel == "split" else None,
            gate_mode=self.gate_mode, pdl=self.pdl, out=out,
        )  # fmt: skip

    def recover(self, slots, records, committed, accepted) -> None:
        """Commit ``committed`` tokens of the recorded verify step that read ``accepted``."""
        L = self.shard
        kda.recover(L.state, slots, records[0], records[1], L.a_log, L.dt_bias, committed,
                    accepted, lower_bound=self.lower_bound, pdl=self.pdl)  # fmt: skip

    def produce(self, attn, parity: int) -> None:
        """This rank's partial ``bf16(attn @ w_o^T)`` into every rank's mailbox."""
        self.comm(attn.shape[0]).produce(attn, self.w_o, parity, rank=self.rank)

    def consume(self, prefix, blocks, output, parity: int, xmoe=None) -> None:
        """The all-reduce, residual (``prefix`` in place), AttnRes and norm into ``output``
        (and its MoE latent copies into ``xmoe``, with ready hints, when the all-reduce has
        ``xmoe_reps``)."""
        comm = self.comm(prefix.shape[0])
        comm.consume(prefix, blocks, self.norm, self.query, self.out_norm, output, parity,
                     xmoe=xmoe, rank=self.rank)  # fmt: skip

    # --- the step --------------------------------------------------------------------
    def step(self, x, f_a, beta, gate, slots, prefix, blocks, parity: int, *, accepted=None,
             records=None, committed=None, output=None, attn=None):  # fmt: skip
        """One decode (T = 1) or verify step of this rank: KDA -> (recover) -> producer ->
        consumer; returns ``output`` [B*T, HID] bf16 (allocated when None) and updates
        ``prefix`` in place. ``records`` (v_records, kg_records): a recorded verify step;
        with ``committed`` (tokens the sampler accepted) it is committed right away.
        ``parity``: the mailbox parity, alternating 0, 1 from step to step."""
        attn = self.attend(x, f_a, beta, gate, slots, accepted=accepted, records=records,
                           out=attn)  # fmt: skip
        if committed is not None:
            if records is None:
                raise ValueError("committed needs records (a recorded verify step)")
            self.recover(slots, records, committed, accepted)
        self.produce(attn, parity)
        if output is None:
            output = torch.empty_like(prefix)
        self.consume(prefix, blocks, output, parity)
        return output


__all__ = ["DecodeLayer", "all_reduces"]
