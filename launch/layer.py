"""The decode job's layer: the model from the seed, the step schedule, a rank's shard and
the unsharded reference (plain torch).

A ``Model`` is the layer from the seed, head by head (each head's weights, pools and
``w_o`` columns from a seed of their own), so a rank builds only its shard and the whole
layer (``Model.kda``, ``Model.w_o``) is built only where it is used (rank 0's check).
A ``Schedule`` draws a single-token decode step, then verify steps with the previous
step's accepted counts, every other one recorded and then recovered, some requests
padding in each step.

``--kda-state replay`` (``Config.kda_state``): each rank keeps its state pool as checkpoint
pages plus a ring of ``Config.ring`` records per page (``kda.operands.Ring``); a request's
page is ``slots[b, 0]``; verify steps are never recorded (their ring entries stay pending
until the next step's accepted counts commit them). ``Unsharded`` then runs the replay
reference on the whole layer and, beside it, ``PerStep``: the per-step reference of the
same steps, which the replay outputs and the materialised state are checked against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.layer import DEFAULT_RING, KDA_STATES, check_kda_state
from kda import layer as kl
from kda import reference as kref
from kda import synthetic as kt
from kda.operands import Ring, make_ring
from kda.validate import GATE_FORMS, HEAD_DIM
from launch.checks import oproj_bound_ratios
from tpcomm.oproj import bound as oproj_bound
from tpcomm.oproj import reference as oref

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --state-dtype
EPS = 1e-6
OUT_EPS = 1e-6
MAX_ROWS = 4096  # requests x tokens of one step
SEED_MOD = 2**63  # derived generator seeds stay below this


def derive(seed: int, *stream: int) -> int:
    """A generator seed for one stream of the job's random numbers (below 2**63)."""
    for part in stream:
        seed = seed * 1_000_003 + part
    return seed % SEED_MOD


@dataclass(frozen=True)
class Config:
    tp: int
    heads: int
    hidden: int
    requests: int
    tokens: int
    blocks: int
    steps: int
    seed: int = 0
    groups: int | None = 4  # None: the GPU runner picks per bucket
    conv_dim_first: bool = True
    padding: float = 0.25
    kda_state: str = "per-step"  # or "replay" (engine.layer.KDA_STATES)
    ring: int = DEFAULT_RING  # replay: ring entries per state page
    state_dtype: str = "fp32"  # or "bf16": the state pages' dtype (STATE_DTYPES)
    gate: str = "lower-bound"  # or "softplus": the KDA decay's form (kda.validate.GATE_FORMS)

    @property
    def torch_state_dtype(self) -> torch.dtype:
        return STATE_DTYPES[self.state_dtype]

    @property
    def cross_path(self) -> bool:
        """Replay checked against the per-step reference too: fp32 pages only (bf16 pages
        are rounded at every per-step store but once per replay fold: a different result,
        docs/bf16_state.md)."""
        return self.replay and self.state_dtype == "fp32"

    @property
    def replay(self) -> bool:
        return self.kda_state == "replay"

    def validate(self) -> None:
        if self.heads < 1 or self.heads % self.tp != 0:
            raise ValueError(f"heads ({self.heads}) must be a positive multiple of TP ({self.tp})")
        oref.check_hidden(self.hidden)
        if not 1 <= self.tokens <= 8:
            raise ValueError(f"tokens must be in 1..8; got {self.tokens}")
        if not 0 <= self.blocks <= 8:
            raise ValueError(f"blocks must be in 0..8; got {self.blocks}")
        if self.requests < 1 or self.steps < 1:
            raise ValueError("requests and steps must be >= 1")
        if self.requests * self.tokens > MAX_ROWS:
            raise ValueError(
                f"requests x tokens = {self.requests * self.tokens} rows per step; at most "
                f"{MAX_ROWS}"
            )
        if not 0 <= self.seed < SEED_MOD:
            raise ValueError(f"seed must be in 0..2**63-1; got {self.seed}")
        if not 0.0 <= self.padding < 1.0:
            raise ValueError(f"padding must be a fraction in [0, 1); got {self.padding}")
        if self.groups is not None and not 1 <= self.groups <= 4:
            raise ValueError(f"groups must be in 1..4; got {self.groups}")
        check_kda_state(self.kda_state, self.ring)
        if self.gate not in GATE_FORMS:
            raise ValueError(f"gate must be one of {GATE_FORMS}; got {self.gate!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"state_dtype must be one of {tuple(STATE_DTYPES)}; got {self.state_dtype!r}"
            )
        if self.replay and self.ring < self.tokens:
            raise ValueError(
                f"--ring {self.ring} must be >= --tokens {self.tokens}: a verify step's "
                "entries stay in the ring until the next step commits them"
            )

    @classmethod
    def from_args(cls, args, tp: int) -> Config:
        """The configuration of ``launch/decode.py``'s options with ``tp`` ranks."""
        return cls(
            tp=tp,
            heads=args.heads,
            hidden=args.hidden,
            requests=args.requests,
            tokens=args.tokens,
            blocks=args.blocks,
            steps=args.steps,
            seed=args.seed,
            groups=args.groups,
            conv_dim_first=args.conv_layout == "dim-first",
            padding=args.padding,
            kda_state=getattr(args, "kda_state", KDA_STATES[0]),
            ring=getattr(args, "ring", DEFAULT_RING),
            state_dtype=getattr(args, "state_dtype", "fp32"),
            gate=getattr(args, "gate", "lower-bound"),
        )

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.tp

    @property
    def pages(self) -> int:
        return 1 + self.requests * self.tokens  # page 0 is never live


PROCESS_BYTES = 400 * 2**20  # a process with torch imported, before any tensor


def host_bytes(cfg: Config) -> int:
    """About the host memory of the host job: every rank's shard, rank 0's whole layer,
    gathered pools and float64 temporaries of a checked step, and the processes."""
    state = cfg.pages * cfg.heads * HEAD_DIM * HEAD_DIM * (2 if cfg.state_dtype == "bf16" else 4)
    conv = cfg.pages * 3 * cfg.heads * HEAD_DIM * max(cfg.tokens + 2, 4) * 2
    w_o = cfg.hidden * cfg.heads * HEAD_DIM * 2
    temporaries = 6 * cfg.requests * cfg.heads * HEAD_DIM * HEAD_DIM * 4
    return 3 * (state + conv) + 2 * w_o + temporaries + cfg.tp * PROCESS_BYTES


@dataclass
class StepPlan:
    index: int
    tokens: int
    padding: tuple
    accepted: torch.Tensor | None  # what the step reads (T > 1)
    record: bool
    committed: torch.Tensor | None  # what the sampler accepts after the step (T > 1)
    replay: bool = False  # --kda-state replay

    @property
    def kind(self) -> str:
        return step_kind(self.tokens, self.record, self.replay)


def step_kind(tokens: int, record: bool, replay: bool = False) -> str:
    """The name of a step shape in the checks and the report."""
    if replay:
        return "replay decode" if tokens == 1 else "replay verify"
    if tokens == 1:
        return "decode"
    return "verify+record+recover" if record else "verify"


class Schedule:
    """Deterministic step plans shared by all ranks. ``accepted``: after each step, the
    accepted counts the next verify step reads (a padding request keeps its own); in replay
    mode also what commits the last verify step's pending ring entries (``materialize``)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed((cfg.seed * 7919 + 1) % SEED_MOD)
        self.accepted = torch.ones(cfg.requests, dtype=torch.int32)
        self.index = 0

    def next(self) -> StepPlan:
        cfg, g = self.cfg, self.gen
        B = cfg.requests
        i = self.index
        self.index += 1
        live = torch.rand(B, generator=g) >= cfg.padding
        if not bool(live.any()):
            live[int(torch.randint(B, (1,), generator=g))] = True
        padding = tuple(int(b) for b in (~live).nonzero()[:, 0])
        tokens = 1 if (i == 0 or cfg.tokens == 1) else cfg.tokens
        if tokens == 1:
            return StepPlan(i, 1, padding, None, False, None, cfg.replay)
        accepted = self.accepted.clone()
        drawn = torch.randint(1, tokens + 1, (B,), generator=g, dtype=torch.int32)
        committed = torch.where(live, drawn, accepted)
        self.accepted = committed.clone()
        record = i % 2 == 0 and not cfg.replay  # replay: pending entries, no records
        return StepPlan(i, tokens, padding, accepted, record, committed, cfg.replay)


class Model:
    """The layer from the seed: KDA weights and pools, ``w_o``, AttnRes gammas. Head h's
    tensors come from seeds of their own, so ``shard`` builds one rank's heads only; the
    whole layer (``kda``, ``w_o``) is built on first use and kept."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._kda: kl.Layer | None = None
        self._w_o: torch.Tensor | None = None
        g = torch.Generator().manual_seed(derive(cfg.seed, 31, 7))
        self.norm = (1 + 0.1 * torch.randn(cfg.hidden, generator=g)).to(torch.bfloat16)
        self.query = (0.2 * torch.randn(cfg.hidden, generator=g)).to(torch.bfloat16)
        self.out_norm = (1 + 0.1 * torch.randn(cfg.hidden, generator=g)).to(torch.bfloat16)
        self.norm_weight = (1 + 0.1 * torch.randn(HEAD_DIM, generator=g)).to(torch.bfloat16)

    @property
    def kda(self) -> kl.Layer:
        """The whole layer's KDA weights and pools (built on first use)."""
        if self._kda is None:
            self._kda = self.layer(0, self.cfg.heads)
        return self._kda

    @property
    def w_o(self) -> torch.Tensor:
        """The whole ``w_o`` [hidden, heads * 128] bf16 (built on first use)."""
        if self._w_o is None:
            self._w_o = self.w_o_columns(0, self.cfg.heads)
        return self._w_o

    def fresh_layer(self) -> kl.Layer:
        """A whole layer of one's own (a copy of ``kda`` if it was built, so edits made to
        it carry over; else built anew and not kept)."""
        return self._kda.clone() if self._kda is not None else self.layer(0, self.cfg.heads)

    def layer(self, first: int, count: int) -> kl.Layer:
        """KDA weights and pools of heads ``first .. first + count - 1``, head by head."""
        cfg = self.cfg
        pages, window, D = cfg.pages, max(cfg.tokens + 2, 4), count * HEAD_DIM
        out = None
        for i in range(count):
            h = kt.make_layer(
                1,
                pages,
                window=window,
                conv_dim_first=cfg.conv_dim_first,
                seed=derive(cfg.seed, 101, first + i),
            )
            if out is None:
                conv = (pages, 3 * D, window) if cfg.conv_dim_first else (pages, window, 3 * D)
                out = kl.Layer(
                    conv_weight=h.conv_weight.new_empty(3, 4, D),
                    conv_bias=h.conv_bias.new_empty(3 * D),
                    a_log=h.a_log.new_empty(count),
                    dt_bias=h.dt_bias.new_empty(D),
                    norm_weight=self.norm_weight,
                    f_b=h.f_b.new_empty(D, h.f_b.shape[1]),
                    state=h.state.new_empty(
                        pages, count, HEAD_DIM, HEAD_DIM, dtype=cfg.torch_state_dtype
                    ),
                    conv_state=h.conv_state.new_empty(conv),
                    conv_dim_first=cfg.conv_dim_first,
                )
            cols = slice(i * HEAD_DIM, (i + 1) * HEAD_DIM)
            out.conv_weight[:, :, cols] = h.conv_weight
            out.conv_bias.view(3, D)[:, cols] = h.conv_bias.view(3, HEAD_DIM)
            out.a_log[i] = h.a_log[0]
            out.dt_bias[cols] = h.dt_bias
            out.f_b[cols] = h.f_b
            out.state[:, i] = h.state[:, 0]
            if cfg.conv_dim_first:
                out.conv_state.view(pages, 3, D, window)[:, :, cols] = h.conv_state.view(
                    pages, 3, HEAD_DIM, window
                )
            else:
                out.conv_state.view(pages, window, 3, D)[..., cols] = h.conv_state.view(
                    pages, window, 3, HEAD_DIM
                )
        return out

    def w_o_columns(self, first: int, count: int) -> torch.Tensor:
        """``w_o``'s columns of heads ``first .. first + count - 1`` [hidden, count * 128]."""
        cfg = self.cfg
        scale = (cfg.heads * HEAD_DIM) ** -0.5
        out = torch.empty(cfg.hidden, count * HEAD_DIM, dtype=torch.bfloat16)
        for i in range(count):
            g = torch.Generator().manual_seed(derive(cfg.seed, 211, first + i))
            cols = slice(i * HEAD_DIM, (i + 1) * HEAD_DIM)
            out[:, cols] = (torch.randn(cfg.hidden, HEAD_DIM, generator=g) * scale).to(
                torch.bfloat16
            )
        return out

    def consume(self, partials, prefix, blocks, groups=None, twoshot=False):
        """The consumer reference with this layer's AttnRes gammas (``twoshot``: the
        partials reduced shard by shard into the gather row first)."""
        return oref.consume(
            partials,
            prefix,
            blocks,
            self.norm,
            self.query,
            self.out_norm,
            eps=EPS,
            out_eps=OUT_EPS,
            groups=self.cfg.groups if groups is None else groups,
            twoshot=twoshot,
        )

    def epilogue(self, prefix_new, blocks):
        """``epilogue_f64`` of ``prefix_new`` with this layer's gammas and eps."""
        return epilogue_f64(prefix_new, blocks, self.norm, self.query, self.out_norm)

    def allowance(self, prefix_new, blocks):
        """``tpcomm.oproj.bound.allowance`` of ``prefix_new`` with this layer's gammas."""
        return oproj_bound.allowance(
            prefix_new, blocks, self.norm, self.query, self.out_norm, eps=EPS, out_eps=OUT_EPS
        )

    def rank_heads(self, rank: int) -> tuple[int, int]:
        per = self.cfg.heads_per_rank
        return rank * per, per

    def shard(self, rank: int) -> Rank:
        """Rank ``rank``'s heads: sliced from the whole layer if it was built, else built
        (no ring: the rank's ``DecodeLayer`` owns one in replay mode)."""
        first, count = self.rank_heads(rank)
        if self._kda is not None:
            layer = kl.shard_layer(self._kda, first, count)
        else:
            layer = self.layer(first, count)
        if self._w_o is not None:
            cols = slice(first * HEAD_DIM, (first + count) * HEAD_DIM)
            w_o = self._w_o[:, cols].contiguous()
        else:
            w_o = self.w_o_columns(first, count)
        return Rank(rank, first, layer, w_o, self)

    def slot_table(self) -> torch.Tensor:
        """Request b's state pages ``[B, tokens]`` (int32): ``1 + b * tokens + t``; replay
        mode keeps a request's state in its first (``slot_table()[:, 0]``)."""
        cfg = self.cfg
        table = 1 + torch.arange(cfg.requests * cfg.tokens, dtype=torch.int32)
        return table.view(cfg.requests, cfg.tokens)

    def step_inputs(self, plan: StepPlan):
        """The full-model activations of a step, the residual prefix and the blocks."""
        cfg = self.cfg
        T = plan.tokens
        table = self.slot_table()[:, :T]
        seed = derive(cfg.seed, plan.index)
        step = kt.make_step(
            cfg.requests,
            T,
            cfg.heads,
            pages=cfg.pages,
            slot_table=table,
            accepted=plan.accepted,
            padding=plan.padding,
            seed=seed,
        )
        g = torch.Generator().manual_seed((seed + 17) % SEED_MOD)
        n = cfg.requests * T
        prefix = torch.randn(n, cfg.hidden, generator=g).to(torch.bfloat16)
        blocks = None
        if cfg.blocks:
            blocks = torch.randn(n, cfg.blocks, cfg.hidden, generator=g).to(torch.bfloat16)
        return step, prefix, blocks


@dataclass
class Rank:
    """A rank's share of the layer (heads ``first ..``, its ``w_o`` columns), which the
    jobs hand to ``engine.DecodeLayer``."""

    rank: int
    first: int
    kda: kl.Layer
    w_o: torch.Tensor
    model: Model


def run_kda(layer: kl.Layer, plan: StepPlan, step: kl.Step, gate_form="lower-bound"):
    """One KDA step on ``layer`` (the Kimi layer's scalars, ``gate_form``'s decay); a
    recorded step is committed by ``recover``. Returns the output [N, D]."""
    gate = kl.gate_scalars(gate_form)
    if not plan.record:
        return kt.run_reference(layer, step, **gate)
    B, H, T = step.slots.shape[0], layer.heads, plan.tokens
    v_rec = torch.zeros(B, H, T, HEAD_DIM)
    kg_rec = torch.zeros(B, H, T, 2 * HEAD_DIM, dtype=torch.bfloat16)
    out = kt.run_reference(layer, step, records=(v_rec, kg_rec), **gate)
    kref.recover(
        layer.state,
        step.slots,
        v_rec,
        kg_rec,
        layer.a_log,
        layer.dt_bias,
        plan.committed,
        plan.accepted,
        **gate,
    )
    return out


def run_replay(layer: kl.Layer, ring: Ring, step: kl.Step, o_out=None, gate_form="lower-bound"):
    """One replay step (``kda.reference.replay_decode``) on ``layer``'s checkpoint pool and
    ``ring``; ``o_out`` ([N, D] fp32, optional) receives the fp32 ``o``."""
    operands = kl.step_operands(layer, step, gate_form=gate_form)
    return kref.replay_decode(**operands, ring=ring, o_out=o_out)


def ring_folds(ring: Ring, step: kl.Step) -> int:
    """Live requests whose ring the replay step ``step`` folds into the checkpoint (held
    entries after its commit, plus its T, past R: ``kda.reference.replay_decode``'s rule)."""
    B, T = step.slots.shape[0], step.tokens
    slots = step.slots.view(B, -1)[:, 0].long()
    live = slots > 0
    committed, pending = ring.length[slots[live], 0].long().unbind(-1)
    commit = pending.clamp(max=1) if step.accepted is None else step.accepted[live].long()
    held = committed + torch.minimum(commit, pending)
    return int((held + T > ring.size).sum())


def materialize(layer: kl.Layer, ring: Ring, model: Model, accepted: torch.Tensor) -> None:
    """Fold every request's ring (pages ``model.slot_table()[:, 0]``) into its checkpoint
    page, committing ``accepted`` (the schedule's, after the last step) pending entries."""
    device = layer.state.device
    slots = model.slot_table()[:, 0].contiguous().to(device)
    kref.materialize(
        layer.state,
        ring,
        layer.a_log,
        layer.dt_bias,
        slots=slots,
        accepted=accepted.to(device),
        **kl.gate_scalars(model.cfg.gate),
    )


class PerStep:
    """Replay mode's second reference: the per-step path (``kda.reference.decode``, no
    records) of the same steps on a whole layer of its own, advanced at every step. After
    a verify step request b's state is in page ``slots[b, accepted[b] - 1]`` here, in page
    ``slots[b, 0]`` (checkpoint + ring) on the replay path."""

    def __init__(self, model: Model):
        self.model = model
        self.kda = model.fresh_layer()

    def step(self, step: kl.Step) -> torch.Tensor:
        return kt.run_reference(self.kda, step, gate_form=self.model.cfg.gate)

    def request_pages(self, accepted: torch.Tensor) -> torch.Tensor:
        """Where each request's state is after the last step: ``[B]`` pages."""
        table = self.model.slot_table().long()
        return table.gather(1, accepted.long()[:, None] - 1)[:, 0]


class Unsharded:
    """Rank 0's check: the same steps on the whole layer in one process (replay mode: the
    replay reference with a whole ring, and ``per_step`` beside it)."""

    def __init__(self, model: Model):
        self.model = model
        self.kda = model.fresh_layer()
        replay = model.cfg.replay
        self.ring = make_ring(self.kda.state, model.cfg.ring) if replay else None
        self.per_step = PerStep(model) if replay else None
        self.folds = 0  # replay: ring folds of the live requests so far

    def attention(self, plan, step, o_out=None):
        """The whole layer's KDA step (replay: also the per-step reference's, which is
        returned second; else None)."""
        gate = self.model.cfg.gate
        if self.ring is None:
            return run_kda(self.kda, plan, step, gate), None
        self.folds += ring_folds(self.ring, step)
        attn = run_replay(self.kda, self.ring, step, o_out=o_out, gate_form=gate)
        return attn, self.per_step.step(step)

    def step(self, plan, step, prefix, blocks, groups=None):
        """The whole layer's step; ``groups``: the consumer's (default: the config's).
        Replay mode adds ``per_step_attn`` (the per-step reference's KDA outputs) and
        ``o32`` (the replay reference's fp32 ``o``)."""
        m, cfg = self.model, self.model.cfg
        o32 = None
        if cfg.replay:
            o32 = torch.full((step.x.shape[0], cfg.heads * HEAD_DIM), float("nan"))
        attn, per_step_attn = self.attention(plan, step, o_out=o32)
        per = cfg.heads_per_rank * HEAD_DIM
        cols = [slice(r * per, (r + 1) * per) for r in range(cfg.tp)]
        partials = torch.stack(
            [oref.project(attn[:, c].contiguous(), m.w_o[:, c].contiguous()) for c in cols]
        )
        tp_out, tp_prefix = m.consume(partials, prefix, blocks, groups=groups)
        # The same layer with one fp32 GEMM over all heads (no per-rank bf16 partials).
        whole = oref.project(attn, m.w_o)[None]
        _, u_prefix = m.consume(whole, prefix, blocks, groups=1)
        epi = functools.partial(m.epilogue, blocks=blocks)
        prefix_ratio, out_ratio = oproj_bound_ratios(partials, tp_prefix, tp_out, u_prefix, epi)
        return dict(
            attn=attn,
            partials=partials,
            tp_out=tp_out,
            tp_prefix=tp_prefix,
            u_prefix=u_prefix,
            prefix_ratio=prefix_ratio,
            out_ratio=out_ratio,
            per_step_attn=per_step_attn,
            o32=o32,
        )


def epilogue_f64(prefix_new, blocks, norm, query, out_norm, *, eps=EPS, out_eps=OUT_EPS):
    """The consumer's AttnRes + RMSNorm in fp64, read as the math: softmax over the block
    snapshots and ``prefix_new`` of ``(v . w) / rms(v)`` with ``w = norm * query``, the
    weighted mix, then RMSNorm with ``out_norm`` (``out_eps``); no blocks: RMSNorm of
    ``prefix_new``. Returns [N, HID] float64."""
    P = prefix_new.double()
    hidden = P.shape[-1]

    def rms_scale(x, e):
        return torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / hidden + e)

    if blocks is None or blocks.shape[1] == 0:
        h = P
    else:
        w = norm.double() * query.double()
        v = torch.cat([blocks.double(), P[:, None]], dim=1)  # [N, nb + 1, HID]
        logits = (v @ w)[..., None] * rms_scale(v, eps)
        h = (torch.softmax(logits, dim=1) * v).sum(1)
    return h * rms_scale(h, out_eps) * out_norm.double()


def conv_cat(conv_all, conv_dim_first: bool) -> torch.Tensor:
    """Reassemble the whole layer's conv pool from the ranks' shards ([q | k | v] parts)."""
    axis = 1 if conv_dim_first else 2
    parts = []
    for p in range(3):
        for shard in conv_all:
            width = shard.shape[axis] // 3
            parts.append(shard.narrow(axis, p * width, width))
    return torch.cat(parts, dim=axis)
