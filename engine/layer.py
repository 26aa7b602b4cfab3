"""``DecodeLayer``: one TP rank's decode step of a KDA layer, as an engine calls it.

Built from the rank's weight shard (``kda.layer.Layer``'s fields: conv, gate and norm
weights, the state and conv pools; the rank's ``w_o`` columns), the o-projection
all-reduces of the symmetric backend, one per rows bucket (``all_reduces``: tokens per
step, requests x tokens; an engine pads a batch up to a bucket) and the AttnRes weights.
``step`` runs, on the current stream: ``kda.decode`` (PDL: its page loads overlap the
previous kernel's tail), ``kda.recover`` after a recorded verify step, the producer
(``bf16(attn @ w_o^T)`` into every rank's mailbox) and the consumer (rank-order sum,
residual into ``prefix`` in place, AttnRes, output RMSNorm). Every call goes through the
registered ops, so the step is graph-capturable and a ``torch.compile(fullgraph=True)``
caller traces it in one graph; the layer marks its weights and pools (on a GPU) as static addresses,
so ``mode="reduce-overhead"`` neither copies them nor refuses their in-place updates (mark
the engine's persistent ``prefix`` / ``output`` buffers the same way).

KDA state, ``kda_state``: ``"per-step"`` (each step reads and writes the requests' state
pages; a verify step writes one page per token, or records that ``recover`` commits) or
``"replay"`` (the layer owns a ``kda.operands.Ring`` of ``ring_size`` entries per page of
the state pool: ``attend`` runs ``kda.replay_decode``, which reads a request's checkpoint
page ``slots[b, 0]`` and its ring, appends the step's entries and writes the page only when
the ring is full; a verify step's entries stay pending until the next step's ``accepted``
commits that many, so there are no records and no ``recover``). In replay mode the pool
holds the plain per-step state only after ``materialize``; a slot given to a new request
must start with an empty ring (``ring.length[slot] = 0``) as well as its initial page.
Replay pays at R 4 or 8 with about 400 (request, head) items per step or more; with fewer,
or at R 16, per-step is faster (docs/replay.md: the H200 table).

On the CPU (``all_reduces`` on the host backend or a CPU loopback gives
``tpcomm.oproj.host_allreduce.HostAllReduce``) the same calls run the references:
``kda.reference.decode`` / ``replay_decode`` / ``recover`` and the all-reduce's reference
producer and consumer (``self.reference``); no call reaches ``torch.cuda``, and what is
GPU-only (the MoE copies; a kernel choice without ``sms`` on CPU pools) is refused by name.

The consumer spins until every rank's partial of the step has landed: with one rank per
GPU each process steps its layer; with every rank on one GPU (loopback) either step each
rank on its own stream, or on one stream run every rank's ``attend`` and ``produce`` before
any ``consume``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch

import kda
from kda import dispatch
from kda import layer as kl
from kda import reference as kref
from kda.operands import MAX_RING, MIN_RING, make_ring
from kda.validate import HEAD_DIM, STATE_DTYPES, check_gate_form
from tpcomm.checks import is_int
from tpcomm.oproj.allreduce import OprojAllReduce
from tpcomm.oproj.host_allreduce import HostAllReduce, runs_on_host
from tpcomm.oproj.plan import MAX_BLOCKS, check_hidden

_WEIGHTS = ("conv_weight", "conv_bias", "a_log", "dt_bias", "norm_weight", "f_b")
KDA_STATES = ("per-step", "replay")
DEFAULT_RING = 4


def all_reduces(backend, rows, hidden: int, blocks: int, **kwargs) -> dict[int, OprojAllReduce]:
    """One o-projection all-reduce per rows bucket on ``backend`` (``kwargs``: its options),
    the all-reduces every ``DecodeLayer`` of this process shares: ``OprojAllReduce`` (the
    kernels) on a GPU backend, ``HostAllReduce`` (the references; gloo on the host backend)
    on a CPU one. Collective on a backend of several processes: each builds the same
    buckets in the same order."""
    check_buckets(rows, hidden, blocks)
    kind = HostAllReduce if runs_on_host(backend) else OprojAllReduce
    return {n: kind(backend, n, hidden, blocks, **kwargs) for n in sorted(set(rows))}


def check_buckets(rows, hidden, blocks) -> None:
    """``all_reduces``' ``rows`` (positive ints), ``hidden`` and ``blocks`` (0..8); ValueError
    naming the argument."""
    if isinstance(rows, int | str) or not hasattr(rows, "__iter__"):
        raise ValueError(f"rows must be an iterable of ints (the buckets); got {rows!r}")
    rows = list(rows)
    if not rows or any(not is_int(n) or n < 1 for n in rows):
        raise ValueError(f"rows must be positive ints (requests x tokens); got {rows!r}")
    if not is_int(hidden):
        raise ValueError(f"hidden must be an int; got {hidden!r}")
    check_hidden(hidden, "hidden")
    if not is_int(blocks) or not 0 <= blocks <= MAX_BLOCKS:
        raise ValueError(f"blocks must be an int in 0..{MAX_BLOCKS}; got {blocks!r}")


class DecodeLayer:
    """Rank ``rank``'s KDA layer + o-projection all-reduce (see the module docstring).

    ``comms``: rows -> ``OprojAllReduce`` (shared by the ranks of this process, read at
    each call, so buckets may be added later). ``kernel`` / ``gate_mode`` / ``pdl``:
    ``kda.decode``'s; ``sms``: the SMs the dispatcher may plan with (default the GPU's,
    shared by ``sharing`` ranks: loopback's per-step dispatcher plans with a rank's share;
    replay's takes the whole GPU's, as ``kda.replay_decode`` does). ``gate_form``: the
    decay's form, ``"lower-bound"`` (Kimi K3) or ``"softplus"`` (Kimi-Linear, fla's
    ``lower_bound=None``); ``lower_bound``: the lower-bound gate's (None: the Kimi layer's
    -5.0), None with softplus; ``scale``, ``eps``: the KDA step's.
    ``kda_state``: ``"per-step"`` or ``"replay"`` (module docstring); ``ring_size``: the
    replay ring's entries R (2..16, at least the verify steps' tokens), which the layer
    allocates as ``self.ring`` (None in per-step mode). Replay mode takes the replay
    dispatcher's kernel choice, so ``kernel`` must be ``"auto"`` there.
    ``state_dtype``: the state pages' dtype, ``torch.float32`` (the default) or
    ``torch.bfloat16`` (half the bytes; arithmetic in fp32, each stored page rounded once:
    docs/bf16_state.md); ``shard.state`` must be a pool of that dtype.
    """

    def __init__(
        self,
        shard,
        w_o: torch.Tensor,
        comms: Mapping[int, OprojAllReduce],
        *,
        rank: int,
        norm: torch.Tensor,
        query: torch.Tensor,
        out_norm: torch.Tensor,
        kernel: str = "auto",
        gate_mode: int = 3,
        pdl: bool = True,
        sms: int | None = None,
        lower_bound: float | None = None,
        scale: float = kl.SCALE,
        eps: float = kl.EPS,
        kda_state: str = "per-step",
        ring_size: int = DEFAULT_RING,
        sharing: int = 1,
        state_dtype: torch.dtype = torch.float32,
        gate_form: str = "lower-bound",
    ):
        if kernel not in dispatch.KERNELS:
            raise ValueError(f"kernel must be one of {dispatch.KERNELS}; got {kernel!r}")
        check_kda_state(kda_state, ring_size)
        if kda_state == "replay" and kernel != "auto":
            raise ValueError(
                f"kernel must be 'auto' with kda_state='replay' (the replay "
                f"dispatcher chooses); got {kernel!r}"
            )
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int; got {rank!r}")
        if isinstance(sharing, bool) or not isinstance(sharing, int) or sharing < 1:
            raise ValueError(f"sharing must be a positive int; got {sharing!r}")
        check_state_dtype(state_dtype, shard.state)
        gate = kl.gate_scalars(gate_form, lower_bound)
        check_gate_form(**gate)
        lower_bound = gate["lower_bound"]
        heads = shard.state.shape[1]
        if not isinstance(w_o, torch.Tensor) or w_o.dim() != 2 or w_o.shape[1] != heads * HEAD_DIM:
            raise ValueError(f"w_o must be [HID, {heads * HEAD_DIM}] (the rank's heads' columns)")
        check_weights(w_o, norm, query, out_norm, shard.state.device)
        self.reference = takes_references(comms, shard.state)
        self.shard, self.w_o, self.comms, self.rank = shard, w_o, comms, rank
        self.norm, self.query, self.out_norm = norm, query, out_norm
        self.kernel, self.gate_mode, self.pdl, self.sms = kernel, gate_mode, bool(pdl), sms
        self.sharing = sharing
        self.lower_bound, self.scale, self.eps = lower_bound, scale, eps
        self.gate_form = gate_form
        self.heads, self.state_dtype = heads, state_dtype
        self.kda_state = kda_state
        self._choices: dict = {}
        self.ring = make_ring(shard.state, ring_size) if kda_state == "replay" else None
        held = [getattr(shard, n) for n in _WEIGHTS] + [shard.state, shard.conv_state]
        held += list(self.ring) if self.ring is not None else []
        for t in held + [w_o, norm, query, out_norm]:
            if isinstance(t, torch.Tensor) and t.is_cuda:  # for CUDA graphs; not on the CPU
                torch._dynamo.mark_static_address(t)

    # --- the parts of a step ---------------------------------------------------------
    def comm(self, rows: int) -> OprojAllReduce:
        """The all-reduce of the ``rows`` bucket; ValueError when there is none."""
        if rows not in self.comms:
            raise ValueError(
                f"no o-projection all-reduce for {rows} rows; buckets "
                f"{sorted(self.comms)} (pad the batch to one)"
            )
        return self.comms[rows]

    @property
    def replay(self) -> bool:
        return self.kda_state == "replay"

    def choice(self, requests: int, tokens: int, records: bool = False):
        """The KDA kernel for a step shape, chosen once: ``kda.dispatch.choose`` (per-step;
        ``records``: a verify step that writes records) or ``kda.dispatch.choose_replay``
        (replay, what ``kernel="auto"`` launches)."""
        key = (requests, tokens, bool(records))
        if key not in self._choices:
            sms = self.sms
            if sms is None:
                device = self.shard.state.device
                if device.type != "cuda":
                    raise ValueError(
                        f"sms: the kernels' dispatcher plans with a GPU's SMs; the pools are "
                        f"on {device} (pass sms=, or step on a host backend's all-reduces)"
                    )
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                if not self.replay:  # the ranks sharing the GPU split it
                    sms = max(1, sms // self.sharing)
            if self.replay:
                choice = dispatch.choose_replay(
                    requests, self.heads, tokens, self.ring.size, sms=sms
                )
            else:
                where = dict(sms=sms, kernel=self.kernel, records=bool(records))
                choice = dispatch.choose(requests, self.heads, tokens, **where)
            self._choices[key] = choice
        return self._choices[key]

    def attend(
        self, x, f_a, beta, gate, slots, *, accepted=None, records=None, out=None, choice=None
    ):
        """``kda.decode`` on this rank's heads: [B*T, D_local] bf16 (into ``out`` if given).
        ``choice`` overrides ``self.choice`` (a ``kda.dispatch.Choice``). Replay mode:
        ``kda.replay_decode`` with ``self.ring`` (its dispatcher's choice; ``records`` and
        ``choice`` are refused)."""
        if self.replay:
            if records is not None:
                raise ValueError(
                    "records: replay mode keeps a verify step's entries pending "
                    "in the ring (no records, no recover)"
                )
            if choice is not None:
                raise ValueError("choice: replay mode takes the replay dispatcher's kernel")
            args, kw = self._operands(x, f_a, beta, gate, slots, accepted, out)
            if self.reference:
                return _into(out, kref.replay_decode(*args, **_scalars(kw), ring=self.ring))
            return kda.replay_decode(*args, **kw, ring=self.ring, kernel="auto")
        if self.reference:  # the host backend: kda.reference.decode, the kernels' math
            args, kw = self._operands(x, f_a, beta, gate, slots, accepted, out)
            return _into(out, kref.decode(*args, **_scalars(kw), records=records))
        if choice is None:
            requests = slots.shape[0]
            choice = self.choice(requests, x.shape[0] // requests, records is not None)
        cluster = choice.cluster if choice.kernel == "split" else None
        kernel = dict(records=records, kernel=choice.kernel, cluster=cluster)
        args, kw = self._operands(x, f_a, beta, gate, slots, accepted, out)
        return kda.decode(*args, **kw, **kernel)

    def _operands(self, x, f_a, beta, gate, slots, accepted, out):
        """``kda.decode``'s (and ``kda.replay_decode``'s) arguments on this rank's shard
        but the kernel's, as ``(args, kwargs)``."""
        L = self.shard
        head = (x, L.conv_weight, L.conv_bias, L.conv_state, f_a, beta, L.a_log, L.dt_bias)
        tail = (slots, L.state, gate, L.norm_weight, L.f_b)
        scalars = dict(lower_bound=self.lower_bound, scale=self.scale, eps=self.eps)
        scalars["gate_form"] = self.gate_form
        launch = dict(gate_mode=self.gate_mode, pdl=self.pdl, out=out)
        step = dict(accepted=accepted, conv_dim_first=L.conv_dim_first)
        return (*head, *tail), scalars | launch | step

    def recover(self, slots, records, committed, accepted) -> None:
        """Commit ``committed`` tokens of the recorded verify step that read ``accepted``
        (per-step mode; replay mode has no records)."""
        if self.replay:
            raise ValueError(
                "recover: replay mode has no records (the next step's accepted "
                "commits a verify step's pending ring entries)"
            )
        L = self.shard
        gate = dict(lower_bound=self.lower_bound, gate_form=self.gate_form)
        # the host backend runs the reference; the GPU the kernel, after the step (PDL)
        call = kref.recover if self.reference else partial(kda.recover, pdl=self.pdl)
        call(L.state, slots, *records, L.a_log, L.dt_bias, committed, accepted, **gate)

    def materialize(self, slots=None, accepted=None) -> None:
        """Replay mode: fold the rings of ``slots`` ([n] int32 / int64 pages; default every
        page but 0) into their checkpoint pages and empty them; ``accepted`` ([n] int32)
        first commits that many pending entries per slot, the rest are dropped. Afterwards
        those pages hold the plain per-step state (prefix caching, migration, a switch to
        per-step mode, ``recover``). Plain torch (``kda.reference.materialize``) on the
        pool's device, reading the counters on the host: not graph-capturable, on demand."""
        if not self.replay:
            raise ValueError(
                "materialize: the layer keeps per-step state (kda_state="
                "'per-step'); there is no ring to fold"
            )
        L = self.shard
        kref.materialize(
            L.state,
            self.ring,
            L.a_log,
            L.dt_bias,
            lower_bound=self.lower_bound,
            slots=slots,
            accepted=accepted,
            gate_form=self.gate_form,
        )

    def admit(self, slots: torch.Tensor) -> None:
        """Start new requests on the state pages ``slots`` ([n] int32 / int64 on the pool's
        device, each in 1..S-1): their state pages and conv pages zeroed (the initial state
        and window) and, in replay mode, their ring counters emptied (``ring.length[slot] =
        0``; the entries need no clearing). A cached prefix then copies its materialised
        page into ``shard.state[slot]`` (and its window into ``shard.conv_state[slot]``).
        Device-side index fills in the current stream; the slot range is checked on the
        host (a sync) unless the stream is capturing a CUDA graph, so call it between steps,
        not inside a ``torch.compile`` region. A per-step verify request's
        other pages (``slots[b, 1..T-1]``) are written by its steps before they are read."""
        L = self.shard
        if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be an int32 / int64 tensor; got {slots!r}")
        if slots.dim() != 1 or slots.device != L.state.device:
            raise ValueError(
                f"slots must be 1-D on {L.state.device}; got shape "
                f"{tuple(slots.shape)} on {slots.device}"
            )
        capturing = slots.is_cuda and torch.cuda.is_current_stream_capturing()
        pages = L.state.shape[0]
        if not capturing and slots.numel() and (slots.min() < 1 or slots.max() >= pages):
            raise ValueError(
                f"slots must be in 1..{pages - 1} (page 0 is the padding page); "
                f"got {slots.min().item()}..{slots.max().item()}"
            )
        index = slots.long()
        L.state.index_fill_(0, index, 0.0)
        L.conv_state.index_fill_(0, index, 0.0)
        if self.replay:
            self.ring.length.index_fill_(0, index, 0)

    def produce(self, attn, parity: int) -> None:
        """This rank's partial ``bf16(attn @ w_o^T)`` into every rank's mailbox."""
        self.comm(attn.shape[0]).produce(attn, self.w_o, parity, rank=self.rank)

    def consume(self, prefix, blocks, output, parity: int, xmoe=None) -> None:
        """The all-reduce, residual (``prefix`` in place), AttnRes and norm into ``output``
        (and its MoE latent copies into ``xmoe``, with ready hints, when the all-reduce has
        ``xmoe_reps``)."""
        comm = self.comm(prefix.shape[0])
        comm.consume(
            prefix,
            blocks,
            self.norm,
            self.query,
            self.out_norm,
            output,
            parity,
            xmoe=xmoe,
            rank=self.rank,
        )

    # --- the step --------------------------------------------------------------------
    def kda_stage(self, x, f_a, beta, gate, slots, *, accepted, records, committed, out):
        """``attend``, then with ``committed`` the recorded verify step's ``recover``;
        returns attn [B*T, D_local]."""
        attn = self.attend(x, f_a, beta, gate, slots, accepted=accepted, records=records, out=out)
        if committed is not None:
            if records is None:
                raise ValueError("committed needs records (a recorded verify step)")
            self.recover(slots, records, committed, accepted)
        return attn

    def step(self, x, f_a, beta, gate, slots, prefix, blocks, parity: int, **options):
        """One decode (T = 1) or verify step of this rank: KDA -> (recover) -> producer ->
        consumer; returns ``output`` [B*T, HID] bf16 (allocated when None) and updates
        ``prefix`` in place. ``records`` (v_records, kg_records): a recorded verify step;
        with ``committed`` (tokens the sampler accepted) it is committed right away.
        ``parity``: the mailbox parity, alternating 0, 1 from step to step. Replay mode:
        ``records`` and ``committed`` are refused (``attend``). ``options`` (``step_options``):
        ``accepted``, ``records``, ``committed``, ``output``, ``attn`` (KDA's output buffer),
        each None by default."""
        output, kda_options = step_options(options)
        attn = self.kda_stage(x, f_a, beta, gate, slots, **kda_options)
        self.produce(attn, parity)
        if output is None:
            output = torch.empty_like(prefix)
        self.consume(prefix, blocks, output, parity)
        return output

    # --- state management (engine.state) ---------------------------------------------
    def copy_state(self, src, dst, *, live=None) -> None:
        """Copy slot ``src[p]`` into slot ``dst[p]`` ([P] int32 on the pool's device, <= 0
        padding): page, conv page and (replay) ring, bit for bit; one launch, capturable
        (``engine.state.copy_state``)."""
        from .state import copy_state

        copy_state(self, src, dst, live=live)

    def fold(self, slots, accepted=None) -> None:
        """Replay mode: ``materialize`` as one capturable launch (``engine.state.fold``)."""
        from .state import fold

        fold(self, slots, accepted)

    def export_state(self, slots, out=None, *, stream=None):
        """``slots`` into a pinned host ``StateBlob`` on ``stream`` (``engine.state``)."""
        from .state import export_state

        return export_state(self, slots, out, stream=stream)

    def import_state(self, slots, blob, *, stream=None, live=None):
        """A ``StateBlob`` into ``slots``; returns the event to wait on (``engine.state``)."""
        from .state import import_state

        return import_state(self, slots, blob, stream=stream, live=live)


def _scalars(kw: dict) -> dict:
    """``_operands``' keywords as the references take them (no launch options)."""
    return {k: v for k, v in kw.items() if k not in ("gate_mode", "pdl", "out")}


def _into(out, result):
    """``result`` copied into the caller's ``out`` buffer when one was given."""
    if out is None:
        return result
    if not isinstance(out, torch.Tensor) or out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"out must be a {result.dtype} tensor {tuple(result.shape)}")
    return out.copy_(result)


def takes_references(comms, state) -> bool:
    """Whether a layer over ``comms`` and the pool ``state`` runs the references: its
    all-reduces are the host's (``HostAllReduce``), or it has none and its pools are not on
    a GPU. ValueError for a mix, or host all-reduces over GPU pools."""
    if not isinstance(comms, Mapping):
        raise ValueError(f"comms must map rows to all-reduces (all_reduces); got {comms!r}")
    kinds = {bool(getattr(c, "reference", False)) for c in comms.values()}
    if len(kinds) > 1:
        raise ValueError("comms: host and GPU all-reduces mixed")
    reference = kinds.pop() if kinds else state.device.type != "cuda"
    if reference and state.device.type != "cpu":
        raise ValueError(
            f"shard: the host backend's all-reduces run on the CPU; the pools are on {state.device}"
        )
    return reference


def check_weights(w_o, norm, query, out_norm, device) -> None:
    """``w_o`` [HID, D_local] bf16 and the AttnRes / output-norm weights ``norm``, ``query``,
    ``out_norm`` [HID] bf16, contiguous, on the pools' ``device``; ValueError naming one."""
    hidden = w_o.shape[0]
    for name, t in (("w_o", w_o), ("norm", norm), ("query", query), ("out_norm", out_norm)):
        shape = tuple(w_o.shape) if name == "w_o" else (hidden,)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != torch.bfloat16:
            raise ValueError(
                f"{name} must be a bf16 tensor {shape} (HID = w_o's rows); got "
                f"{t.dtype} {tuple(t.shape)}"
            )
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {device}; got {t.device}")


def step_options(options):
    """``DecodeLayer.step``'s keywords as (output, ``kda_stage``'s keywords); TypeError on
    others."""
    names = ("accepted", "records", "committed", "output", "attn")
    unknown = set(options) - set(names)
    if unknown:
        raise TypeError(f"step() got unexpected keyword arguments {sorted(unknown)}")
    got = {name: options.get(name) for name in names}
    output, attn = got.pop("output"), got.pop("attn")
    return output, dict(got, out=attn)


def check_kda_state(kda_state, ring_size) -> None:
    """``DecodeLayer``'s ``kda_state`` (one of ``KDA_STATES``) and ``ring_size`` (an int in
    2..16); ValueError naming the argument."""
    if not isinstance(kda_state, str) or kda_state not in KDA_STATES:
        raise ValueError(f"kda_state must be one of {KDA_STATES}; got {kda_state!r}")
    if (
        isinstance(ring_size, bool)
        or not isinstance(ring_size, int)
        or not MIN_RING <= ring_size <= MAX_RING
    ):
        raise ValueError(f"ring_size must be an int in {MIN_RING}..{MAX_RING}; got {ring_size!r}")


def check_state_dtype(state_dtype, state=None) -> None:
    """``DecodeLayer``'s ``state_dtype`` (``torch.float32`` or ``torch.bfloat16``) and, given,
    the pool ``state`` it must match; ValueError naming the argument."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype must be torch.float32 or torch.bfloat16; got {state_dtype!r}"
        )
    dtype = getattr(state, "dtype", state_dtype)
    if dtype != state_dtype:
        raise ValueError(
            f"shard.state: a {dtype} pool, but the layer was asked for state_dtype="
            f"{state_dtype} (allocate the pool in that dtype, e.g. load_rank(state_dtype=))"
        )


__all__ = ["DecodeLayer", "all_reduces", "check_kda_state", "check_state_dtype", "KDA_STATES"]
