"""``HostAllReduce``: the o-projection all-reduce on the CPU, ``OprojAllReduce``'s calls run
as the references (``tpcomm.oproj.reference``).

``produce`` is ``reference.project`` then ``publish``; ``publish`` hands the rank's partial
to every rank: on the host backend (one rank per process, gloo) it is the backend's
``exchange`` (a collective: every rank of the group publishes in the same order), on a
backend that hosts every rank in this process (loopback on the CPU) a table of the
partials of the step's parity. ``consume`` is ``reference.consume`` over the gathered
partials, ``prefix`` updated in place, the result into ``output``. So a rank's step gives
bitwise what ``reference.consume`` gives for the stacked partials, on any number of
processes. The MoE latent copies (``xmoe``) and fused launches are GPU-only: refused with a
``ValueError`` naming them. No CUDA call, no CuTe DSL.
"""

from __future__ import annotations

import torch

from tpcomm.checks import check_real, check_tensor, is_int
from tpcomm.oproj import reference as ref
from tpcomm.oproj.checks import check_step
from tpcomm.oproj.plan import DEFAULT_BUDGET_NS, check_config, choose

__all__ = ["HostAllReduce", "runs_on_host"]


def runs_on_host(backend) -> bool:
    """Whether ``backend``'s all-reduces are ``HostAllReduce``: the host backend, or one
    that keeps its symmetric tensors in this process's CPU memory (loopback on the CPU)."""
    if backend.name == "host":
        return True
    device = getattr(backend, "device", None)
    return device is not None and torch.device(device).type == "cpu"


class HostAllReduce:
    """The all-reduce of one (TP, rows, HID, nb) shape on a CPU ``backend``
    (``runs_on_host``); the same constructor and calls as ``OprojAllReduce``. ``groups``
    defaults to the GPU plan's (so both backends sum in the same order); ``twoshot`` runs
    the twoshot reference (the shard-by-shard gather row first). ``fence``, ``one_launch``,
    ``producer`` and ``budget_ns`` are the kernels' and checked only."""

    reference = True  # DecodeLayer: this rank's step runs the references

    def __init__(
        self,
        backend,
        tokens,
        hid,
        nb,
        *,
        has_delta=True,
        groups=None,
        xmoe_reps=0,
        eps=1e-6,
        out_eps=1e-6,
        budget_ns=DEFAULT_BUDGET_NS,
        fence=None,
        twoshot=None,
        one_launch=False,
        producer=None,
    ):
        if not runs_on_host(backend):
            raise ValueError(f"backend: {backend.name} keeps its memory on a GPU (OprojAllReduce)")
        if backend.name != "host" and len(backend.ranks) != backend.world:
            raise ValueError("backend must be the host backend or host every rank in-process")
        twoshot = bool(twoshot) if twoshot is not None else False
        plan = choose(backend.world, tokens, hid, twoshot=twoshot, one_launch=bool(one_launch))
        groups = plan.groups if groups is None else groups
        check_config(backend.world, hid, nb, groups, xmoe_reps, twoshot)
        if xmoe_reps:
            raise ValueError(
                f"xmoe_reps = {xmoe_reps}: the MoE latent copies are GPU-only (OprojAllReduce)"
            )
        if not is_int(budget_ns) or budget_ns <= 0:
            raise ValueError(f"budget_ns must be a positive int; got {budget_ns!r}")
        check_real("eps", eps, low=0.0)
        check_real("out_eps", out_eps, low=0.0)
        if not isinstance(has_delta, bool):
            raise ValueError(f"has_delta must be a bool; got {has_delta!r}")
        self.backend, self.plan = backend, plan
        self.tp, self.tokens, self.hid, self.nb = backend.world, tokens, hid, nb
        self.has_delta, self.groups, self.twoshot = has_delta, groups, twoshot
        self.eps, self.out_eps, self.xmoe_reps = float(eps), float(out_eps), 0
        self.device = torch.device("cpu")
        self._gathered: dict = {}  # parity -> [TP, tokens, HID] (host backend)
        self._table: dict = {}  # parity -> {rank: partial} (every rank in this process)
        self._consumed: dict = {}  # parity -> ranks that consumed it

    def _rank(self, rank):
        rank = self.backend.ranks[0] if rank is None else rank
        if rank not in self.backend.ranks:
            raise ValueError(f"rank {rank!r} is not hosted here (ranks {self.backend.ranks})")
        return rank

    # --- the calls of OprojAllReduce --------------------------------------------------
    def publish(self, partial, step, rank=None, stream=None):
        """Rank ``rank``'s ``partial`` [tokens, HID] bf16 to every rank (host backend: the
        exchange, a collective)."""
        rank, parity = self._rank(rank), check_step(step) & 1
        check_tensor(
            "partial",
            partial,
            torch.bfloat16,
            shape=(self.tokens, self.hid),
            device=torch.device("cpu"),
        )
        if self.backend.name == "host":
            self._gathered[parity] = self.backend.exchange(partial, self._sequence())
        else:
            self._table.setdefault(parity, {})[rank] = partial.clone()

    def produce(self, attn_out, w_o, step, rank=None, stream=None):
        """Rank ``rank``'s ``bf16(attn_out @ w_o^T)`` (``reference.project``), published."""
        self._rank(rank)
        if isinstance(attn_out, torch.Tensor) and attn_out.shape[:1] != (self.tokens,):
            raise ValueError(f"attn_out must have {self.tokens} rows; got {tuple(attn_out.shape)}")
        if isinstance(w_o, torch.Tensor) and w_o.dim() == 2 and w_o.shape[0] != self.hid:
            raise ValueError(f"w_o must be [HID = {self.hid}, D_local]; got {tuple(w_o.shape)}")
        self.publish(ref.project(attn_out, w_o), step, rank)

    def consume(
        self,
        prefix,
        blocks,
        norm,
        query,
        out_norm,
        output,
        step,
        *,
        xmoe=None,
        rank=None,
        stream=None,
        checked=False,
        validate=None,
    ):
        """Rank ``rank``'s consumer (``reference.consume`` over every rank's partial of the
        step's parity): ``prefix`` updated in place, the normed output into ``output``."""
        rank, parity = self._rank(rank), check_step(step) & 1
        if xmoe is not None:
            raise ValueError("xmoe: the MoE latent copies are GPU-only (OprojAllReduce)")
        nb = blocks.shape[1] if isinstance(blocks, torch.Tensor) and blocks.dim() == 3 else 0
        if nb != self.nb:
            raise ValueError(
                f"blocks must hold nb = {self.nb} snapshots (the all-reduce's); got {nb}"
            )
        partials = self._partials(parity, rank)
        out, prefix_new = ref.consume(
            partials,
            prefix,
            blocks,
            norm,
            query,
            out_norm,
            eps=self.eps,
            out_eps=self.out_eps,
            has_delta=self.has_delta,
            groups=self.groups,
            twoshot=self.twoshot,
            validate=validate,
        )
        if not isinstance(output, torch.Tensor) or output.shape != out.shape:
            raise ValueError(f"output must be a tensor {tuple(out.shape)}")
        if output.dtype != torch.bfloat16 or output.device != prefix.device:
            raise ValueError(f"output must be bf16 on {prefix.device}")
        self._release(parity, rank)
        prefix.copy_(prefix_new)
        output.copy_(out)

    def produce_consume(
        self, attn_out, w_o, prefix, blocks, norm, query, out_norm, output, step, **options
    ):
        """``produce`` then ``consume`` (one rank per process: the fused launch's result)."""
        if options.pop("xmoe", None) is not None:
            raise ValueError("xmoe: the MoE latent copies are GPU-only (OprojAllReduce)")
        rank = options.get("rank")
        self.produce(attn_out, w_o, step, rank)
        self.consume(prefix, blocks, norm, query, out_norm, output, step, rank=rank)

    def error(self, rank=None):
        """The missing-rank mask of the host backend's last exchange that ran out (0 else)."""
        return torch.tensor([getattr(self.backend, "error_word", 0)], dtype=torch.int64)

    def reset(self):
        self._gathered.clear()
        self._table.clear()
        self._consumed.clear()

    # --- internals ----------------------------------------------------------------------
    def _sequence(self) -> int:
        """The host backend's exchange number: every rank exchanges in the same order, and
        the all-reduces of one backend share the numbers (keys of a split domain)."""
        n = getattr(self.backend, "exchanges", 0)
        self.backend.exchanges = n + 1
        return n

    def _partials(self, parity, rank):
        if self.backend.name == "host":
            if parity not in self._gathered:
                raise ValueError(f"step: no partials of parity {parity} published (produce first)")
            return self._gathered[parity]
        table = self._table.get(parity, {})
        missing = [r for r in range(self.tp) if r not in table]
        if missing:
            raise ValueError(
                f"step: rank(s) {missing} have not produced parity {parity} (every rank in "
                "one process: each rank's produce comes before any rank's consume)"
            )
        return torch.stack([table[r] for r in range(self.tp)])

    def _release(self, parity, rank):
        """Forget a parity's partials once every hosted rank consumed them."""
        done = self._consumed.setdefault(parity, set())
        done.add(rank)
        if done >= set(self.backend.ranks):
            self._gathered.pop(parity, None)
            self._table.pop(parity, None)
            self._consumed.pop(parity, None)
