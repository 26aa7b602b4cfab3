"""OprojFused: the o-projection producer and the all-reduce consumer in one launch.

Contract: each rank's launch does exactly what ``OprojProducer`` followed by
``OprojConsumer`` do (same fp32 fragments, same warp-order and rank-order sums, same bf16
roundings), so ``prefix`` and ``output`` are bitwise those of the unfused pair, and so
within the tolerances of ``tpcomm.oproj.reference`` (prefix bitwise given the published
partials, output within 1 bf16 ulp). The two bodies are shared, not copied:
``OprojProducer.tile`` and ``OprojConsumerKernel.body``.

Grid ``(C, P + tokens)`` of C-CTA clusters (``C = HID / 1024``), ``128 * groups`` threads
(the consumer's groups; the producer uses them all):

- rows ``0 .. P-1``: producer CTAs. CTA ``q = row * C + x`` runs ``groups`` groups of four
  warps; group g computes the 16-feature tiles ``(q * groups + g) * T + t``, ``t < T``
  (``tiles`` = T, compile-time), one after the other, each exactly one ``OprojProducer``
  CTA's work (GEMM, warp-order sum through its own shared fragment area, a 128-thread
  named barrier, publish into slot ``[step & 1, rank]`` of every rank's mailbox or, with
  twoshot, the owners' receive views). ``HID / 16 = 64 C`` tiles, so
  ``P = ceil(64 / (groups * T))``; tiles past the end leave their group idle (groups = 3).
  T = 1 gives the most producer CTAs (weight bandwidth); larger T fewer CTAs (see below).
  Why groups of tiles per CTA rather than one tile per CTA (448 producer CTAs at HID
  7168): a fused CTA has the consumer's ``128 * groups`` threads anyway, and at TP16
  (4 groups, 512 threads, launch bound 2 CTAs per SM) one GPU holds 264 of them: 448 + 7
  x tokens CTAs could never be co-resident, 7 x (16 + tokens) = 119..168 are, with 16
  warps streaming weights in each of the 112 producer CTAs.
- rows ``P .. P + tokens - 1``: consumer clusters, token ``row - P``: ``OprojConsumer``'s
  CTA body unchanged (polls, rank-order sum, residual, AttnRes exchanges, RMSNorm, xmoe,
  hints, twoshot, bounded polls with the error word).

Co-residency: consumer CTAs spin on the mailbox, which the producer CTAs of every rank
fill, so a consumer that occupies the slot a producer needs would wait for ever (until
its poll budget: an error word). Producer rows have the lower block ids, so they are
normally dispatched first, but nothing guarantees it; the launch is therefore refused
unless every CTA of every launch sharing the GPU can be resident at once
(``plan_fused``): CTAs per SM = min(launch bound ``min_blocks_per_sm(groups)``, which
caps the registers a thread may use, threads per SM / threads, shared memory per SM /
(this kernel's shared memory + 1 KiB reserved), 32), times the SMs, less ``C - 1`` slots
per GPC (a cluster never spans GPCs; the GPC count is taken as at most ``ceil(SMs / 16)``,
true of Hopper and Blackwell data-center parts, e.g. 9 >= the H200's 8; ``DeviceLimits``
takes the real count where it is known).
On the loopback backend every TP rank's launch shares the one GPU, so the rule counts
``world`` launches. ``plan_fused`` picks the smallest T that fits (plain Python,
CPU-tested) and raises ``ValueError`` saying which resource ran out when none does.

PDL (``pdl=True``): every CTA triggers its dependents at once (they launch only when all
of this grid's CTAs run, so they cannot take a slot this grid needs). Producer CTAs wait
for the previous kernel (the KDA step writing ``attn_out``) before their first
``attn_out`` load. Consumer CTAs first prefetch ``norm``, ``query``, ``out_norm`` and the
block snapshots and run the AttnRes pre-phase (block dot products, their cluster
exchange, softmax numerators); then they wait, and only then read ``prefix`` and poll the
mailbox: ``blocks``, ``norm``, ``query`` and ``out_norm`` must therefore not be written by
the kernel launched just before this one (the KDA step does not write them). Waiting
before the polls also orders them after the previous step's re-arms of the same parity.

The CuTe DSL is imported lazily: the plain-Python planning part imports on a CPU-only
machine.
"""

import functools
from dataclasses import dataclass

from tpcomm.oproj.consumer import (
    GROUP_THREADS,
    check_config,
    min_blocks_per_sm,
    pack_smem,
    smem_layout,
)
from tpcomm.oproj.producer import FEATURES, TILE_SMEM_BYTES, WARPS
from tpcomm.oproj.reference import SLICE

RESERVED_SMEM = 1024  # bytes the hardware reserves per CTA (sm_80+)
SMS_PER_GPC_AT_LEAST = 16  # assumed: Hopper / Blackwell data-center GPCs hold 16+ SMs
MAX_TOKENS = 8


@dataclass(frozen=True)
class DeviceLimits:
    """What bounds residency on one GPU (defaults: sm_90 / sm_100)."""

    sms: int
    max_threads_per_sm: int = 2048
    smem_per_sm: int = 233472  # 228 KiB
    max_ctas_per_sm: int = 32
    gpcs: int | None = None  # None: at most ceil(sms / SMS_PER_GPC_AT_LEAST)

    @property
    def gpc_bound(self) -> int:
        return self.gpcs if self.gpcs is not None else -(-self.sms // SMS_PER_GPC_AT_LEAST)

    @classmethod
    def of(cls, device) -> "DeviceLimits":
        """The limits of a CUDA device (torch's properties)."""
        import torch

        props = torch.cuda.get_device_properties(device)
        return cls(
            sms=props.multi_processor_count,
            max_threads_per_sm=props.max_threads_per_multi_processor,
            smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 233472),
            max_ctas_per_sm=32 if props.major >= 9 else 16,
        )


def tile_count(hid: int) -> int:
    """16-feature producer tiles: ``HID / 16``."""
    return hid // FEATURES


def producer_rows(hid: int, groups: int, tiles: int) -> int:
    """``P``: cluster rows of producer CTAs (``groups * tiles`` tiles per CTA)."""
    ctas = hid // SLICE
    return -(-tile_count(hid) // (ctas * groups * tiles))


def tile_index(row, cta, group, t, ctas: int, groups: int, tiles: int):
    """Tile of group ``group``'s ``t``-th turn in producer CTA (``row``, ``cta``): plain
    arithmetic, also traced in the kernel. Tiles ``>= HID / 16`` are idle turns."""
    return ((row * ctas + cta) * groups + group) * tiles + t


def fused_smem_bytes(hid: int, nb: int, groups: int) -> int:
    """Dynamic shared memory of one fused CTA: the consumer's, then the producer groups'
    fragment areas (what the DSL passes at launch)."""
    return pack_smem(smem_layout(hid, nb, groups) + [(groups * TILE_SMEM_BYTES, 16)])


def ctas_per_sm(threads: int, smem: int, launch_bound: int, limits: DeviceLimits):
    """(CTAs per SM guaranteed, the resource that limits it)."""
    bounds = {
        "launch bound (registers)": launch_bound,
        "threads": limits.max_threads_per_sm // threads,
        "shared memory": limits.smem_per_sm // (smem + RESERVED_SMEM),
        "CTA slots": limits.max_ctas_per_sm,
    }
    name = min(bounds, key=bounds.get)
    return bounds[name], name


def resident_ctas(per_sm: int, cluster: int, limits: DeviceLimits) -> int:
    """CTAs of ``cluster``-CTA clusters that can all be resident. A cluster never spans
    GPCs, so a GPC of ``s`` SMs holds ``floor(s * per_sm / cluster)`` clusters, at least
    ``(s * per_sm - (cluster - 1)) / cluster``; summed over at most ``gpc_bound`` GPCs."""
    slots = limits.sms * per_sm - limits.gpc_bound * (cluster - 1)
    return max(0, -(-slots // cluster)) * cluster


@dataclass(frozen=True)
class FusedPlan:
    tiles: int  # T: tiles per producer group
    rows: int  # P: producer cluster rows
    grid: tuple[int, int, int]
    ctas: int  # CTAs of one launch
    threads: int
    smem: int  # dynamic shared memory per CTA
    launch_bound: int
    per_sm: int
    limit: str  # the resource that bounds per_sm
    launches: int  # launches sharing the GPU (loopback: every rank)
    capacity: int  # CTAs that can be resident together
    reason: str


def tiles_candidates(groups: int) -> list[int]:
    """T = 1, 2, 4, ... up to one producer row (``HID / 16 = 64 C``)."""
    out, t = [], 1
    while True:
        out.append(t)
        if groups * t >= 64:
            return out
        t *= 2


def plan_fused(tp, tokens, hid, nb, groups, limits: DeviceLimits, *, launches=1, tiles=None,
               xmoe_reps=0):  # fmt: skip
    """The fused launch for this shape on ``limits`` with ``launches`` launches sharing
    the GPU: the smallest T (most producer CTAs) whose CTAs can all be resident; a
    ``ValueError`` saying why when none can."""
    check_config(tp, hid, nb, groups, xmoe_reps)
    if not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be an int in 1..{MAX_TOKENS}; got {tokens!r}")
    if not isinstance(launches, int) or launches < 1:
        raise ValueError(f"launches must be a positive int; got {launches!r}")
    if tiles is not None and (not isinstance(tiles, int) or tiles < 1):
        raise ValueError(f"tiles must be a positive int; got {tiles!r}")
    ctas_x = hid // SLICE
    threads = GROUP_THREADS * groups
    smem = fused_smem_bytes(hid, nb, groups)
    bound = min_blocks_per_sm(groups)
    per_sm, limit = ctas_per_sm(threads, smem, bound, limits)
    capacity = resident_ctas(per_sm, ctas_x, limits)
    need = None
    for t in [tiles] if tiles is not None else tiles_candidates(groups):
        rows = producer_rows(hid, groups, t)
        ctas = ctas_x * (rows + tokens)
        need = ctas * launches
        if need <= capacity:
            reason = (
                f"T={t}: {rows} producer + {tokens} consumer cluster rows of {ctas_x} CTAs; "
                f"{launches} x {ctas} CTAs <= {capacity} resident ({limits.sms} SMs x {per_sm} "
                f"CTAs/SM, limited by {limit})"
            )
            return FusedPlan(t, rows, (ctas_x, rows + tokens, 1), ctas, threads, smem, bound,
                             per_sm, limit, launches, capacity, reason)  # fmt: skip
    fewest = ctas_x * (producer_rows(hid, groups, t) + tokens)
    raise ValueError(
        f"fused o-projection cannot be co-resident: {launches} launch(es) x {fewest} CTAs "
        f"(at least {ctas_x} x ({producer_rows(hid, groups, t)} producer + {tokens} consumer "
        f"rows), {threads} threads, {smem} B shared each) = {need} CTAs > {capacity} that fit "
        f"({limits.sms} SMs x {per_sm} CTAs/SM, limited by {limit}, less cluster packing); "
        "consumer CTAs could starve the producers. Use fewer tokens, ranks or groups, or the "
        "unfused producer + consumer"
    )


@functools.cache
def _fused_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from tpcomm.cuteutil import launch, smem_tensor
    from tpcomm.oproj.consumer import kernel_class
    from tpcomm.oproj.producer import producer_class

    class OprojFused:
        """Compile-time configuration: TP, HID, nb, D (local width), T (``tiles``),
        has_delta, groups, xmoe reps, multicast, fence, PDL, twoshot; tokens dynamic."""

        def __init__(self, tp, hid, nb, d_local, *, tiles=1, has_delta=True, groups=4,
                     xmoe_reps=0, multicast=False, fence=False, pdl=False,
                     twoshot=False):  # fmt: skip
            if not isinstance(tiles, int) or tiles < 1:
                raise ValueError(f"tiles must be a positive int; got {tiles!r}")
            self.producer = producer_class()(tp, hid, d_local, multicast=multicast, fence=fence,
                                             twoshot=twoshot)  # fmt: skip
            self.consumer = kernel_class()(tp, hid, nb, has_delta=has_delta, groups=groups,
                                           xmoe_reps=xmoe_reps, pdl=pdl, twoshot=twoshot,
                                           fence=fence, early_wait=True)  # fmt: skip
            self.tp, self.hid, self.nb, self.d = tp, hid, nb, d_local
            self.groups, self.tiles, self.pdl = groups, tiles, bool(pdl)
            self.ctas = hid // SLICE
            self.rows = producer_rows(hid, groups, tiles)
            self.threads = GROUP_THREADS * groups
            self.launch_bound = min_blocks_per_sm(groups)

        @cute.jit
        def __call__(
            self,
            attn_out: cute.Tensor,
            w_o: cute.Tensor,
            peers: cute.Tensor,
            multicast_base: Int64,
            mailbox: cute.Tensor,
            prefix: cute.Tensor,
            blocks: cute.Tensor,
            norm: cute.Tensor,
            query: cute.Tensor,
            out_norm: cute.Tensor,
            output: cute.Tensor,
            xmoe: cute.Tensor,
            hints: cute.Tensor,
            eps: Float32,
            out_eps: Float32,
            error: cute.Tensor,
            step: Int32,
            budget_ns: Int64,
            recv: cute.Tensor,
            gather_peers: cute.Tensor,
            rank: Int32,
            stream: cuda.CUstream,
        ):
            consumer_args = self.consumer.kernel_args(
                mailbox, prefix, blocks, norm, query, out_norm, output, xmoe, hints, eps,
                out_eps, error, step, budget_ns, recv, gather_peers, rank,
            )  # fmt: skip
            call = self.kernel(
                Int64(attn_out.iterator.toint()),
                Int64(w_o.iterator.toint()),
                peers,
                multicast_base,
                *consumer_args,
            )
            launch(
                call,
                (self.ctas, self.rows + prefix.shape[0], 1),
                (self.threads, 1, 1),
                stream,
                cluster=(self.ctas, 1, 1),
                use_pdl=self.pdl,
                min_blocks_per_mp=self.launch_bound,
                carveout=100,
            )

        @cute.jit
        def produce(self, red, thread, cta, row, a_attn: Int64, a_w: Int64,
                    peers: cute.Tensor, multicast_base: Int64, tokens: Int32, rank: Int32,
                    step: Int32):  # fmt: skip
            """A producer CTA: group g runs its T tiles (``OprojProducer.tile``)."""
            group, tid = thread // GROUP_THREADS, thread % GROUP_THREADS
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
                cute.arch.griddepcontrol_wait()  # attn_out is the previous kernel's
            for g in cutlass.range_constexpr(self.groups):  # static named-barrier ids 1 + g
                if group == g:
                    for t in cutlass.range(self.tiles, unroll=1):
                        index = tile_index(row, cta, g, t, self.ctas, self.groups, self.tiles)
                        if index < tile_count(self.hid):  # uniform in the group: barrier-safe
                            self.producer.tile(
                                a_attn, a_w, peers, multicast_base, tokens, rank, step, index,
                                tid, red, g * WARPS, 1 + g, False,
                            )  # fmt: skip
                            if cutlass.const_expr(self.tiles > 1):  # the next tile reuses red
                                cute.arch.barrier(barrier_id=1 + g,
                                                  number_of_threads=GROUP_THREADS)  # fmt: skip

        @cute.kernel
        def kernel(self, a_attn: Int64, a_w: Int64, peers: cute.Tensor, multicast_base: Int64,
                   a_mailbox: Int64, a_prefix: Int64, a_blocks: Int64, a_norm: Int64,
                   a_query: Int64, a_out_norm: Int64, a_output: Int64, a_xmoe: Int64,
                   a_hints: Int64, a_error: Int64, tokens: Int32, eps: Float32,
                   out_eps: Float32, step: Int32, budget_ns: Int64, a_recv: Int64,
                   gather_peers: cute.Tensor, rank: Int32):  # fmt: skip
            thread, _, _ = cute.arch.thread_idx()
            cta, row, _ = cute.arch.block_idx()
            smem = self.consumer.allocate()
            red = smem_tensor(cutlass.memory.SmemAllocator(), Float32,
                              (self.groups * WARPS, 32, 4))  # fmt: skip
            if row < self.rows:
                self.produce(red, thread, cta, row, a_attn, a_w, peers, multicast_base, tokens,
                             rank, step)  # fmt: skip
            else:
                self.consumer.body(smem, thread, cta, row - self.rows, a_mailbox, a_prefix,
                                   a_blocks, a_norm, a_query, a_out_norm, a_output, a_xmoe,
                                   a_hints, a_error, tokens, eps, out_eps, step, budget_ns,
                                   a_recv, gather_peers, rank)  # fmt: skip

    return OprojFused


def fused_class():
    """The ``OprojFused`` class (imports the CuTe DSL)."""
    return _fused_class()


def fake_fused_arguments(tp, hid, nb, d_local, xmoe_reps=0, twoshot=False):
    """Compile-only arguments of ``OprojFused.__call__`` (tokens dynamic)."""
    from tpcomm.oproj.consumer import fake_arguments
    from tpcomm.oproj.producer import fake_producer_arguments

    return fake_producer_arguments(tp, hid, d_local)[:4] + fake_arguments(
        tp, hid, nb, xmoe_reps, twoshot
    )


@functools.cache
def compiled_fused(tp, hid, nb, d_local, tiles=1, has_delta=True, groups=4, xmoe_reps=0,
                   multicast=False, fence=False, pdl=False, twoshot=False, arch=None):  # fmt: skip
    """One compile per configuration and arch; tokens are dynamic (1..8)."""
    import cutlass.cute as cute

    kernel = fused_class()(tp, hid, nb, d_local, tiles=tiles, has_delta=has_delta,
                           groups=groups, xmoe_reps=xmoe_reps, multicast=multicast,
                           fence=fence, pdl=pdl, twoshot=twoshot)  # fmt: skip
    args = fake_fused_arguments(tp, hid, nb, d_local, xmoe_reps, twoshot)
    options = None if arch is None else f"--gpu-arch {arch}"
    return cute.compile(kernel, *args, options=options)
