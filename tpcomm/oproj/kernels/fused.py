"""OprojFused: the o-projection producer and the all-reduce consumer in one launch.

Contract: each rank's launch does exactly what ``OprojProducer`` then ``OprojConsumer`` do
(same fragments, sums and roundings), so ``prefix`` and ``output`` are bitwise those of the
unfused pair; the bodies are shared (``OprojProducer.tile``, ``OprojConsumerKernel.body``).

Grid ``(C, P + tokens)`` of C-CTA clusters (``plan.slicing``: ``C`` CTAs of ``W`` columns),
``W / 8 * groups`` threads, split into ``E`` 128-thread producer teams (``plan.producer_teams``:
the groups themselves at ``W`` = 1024; refused unless whole). Rows ``0 .. P-1`` are producer
CTAs: team e of CTA ``q = row * C + x`` computes tiles ``(q * E + e) * T + t``, ``t < T``
(``tiles``), each one ``OprojProducer`` CTA's work with its own fragment area and a
128-thread named barrier; tiles past ``HID / 16`` idle.
Rows ``P ..`` are consumer clusters, token ``row - P``.

Consumer CTAs spin on what producer CTAs of every rank publish, so a launch is refused
unless every CTA of every launch sharing the GPU can be resident at once
(``tpcomm.oproj.plan.plan_fused``). PDL: producer CTAs wait for the previous kernel before
reading ``attn_out``; consumer CTAs run the AttnRes pre-phase first, then wait, so
``blocks``, ``norm``, ``query``, ``out_norm`` must not be written by the kernel just before.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

from tpcomm.cuteutil import compile_cached, launch, smem_tensor
from tpcomm.oproj.kernels.consumer import OprojConsumerKernel, fake_arguments
from tpcomm.oproj.kernels.producer import OprojProducer, fake_producer_arguments
from tpcomm.oproj.operands import (
    ConsumerOperands,
    ProducerOperands,
    ProjectionAddresses,
)
from tpcomm.oproj.plan import (
    THREADS,
    WARPS,
    min_blocks_per_sm,
    producer_rows,
    producer_teams,
    tile_count,
    tile_index,
)

# the keywords ``OprojFused`` passes on to its ``OprojConsumerKernel`` (defaults: the consumer's)
CONSUMER_KEYWORDS = ("has_delta", "groups", "xmoe_reps", "fence", "pdl", "twoshot")


class OprojFused:
    """Compile-time configuration: TP, HID, nb, D (local width), T (``tiles``), multicast,
    and ``consumer``: the ``CONSUMER_KEYWORDS`` (has_delta, groups, xmoe reps, fence, PDL,
    twoshot; fence and twoshot the producer's too); tokens dynamic."""

    def __init__(self, tp, hid, nb, d_local, *, tiles=1, multicast=False, **consumer):
        if not isinstance(tiles, int) or tiles < 1:
            raise ValueError(f"tiles must be a positive int; got {tiles!r}")
        unknown = sorted(set(consumer) - set(CONSUMER_KEYWORDS))
        if unknown:
            raise TypeError(f"OprojFused got unexpected keywords {unknown}")
        self.consumer = c = OprojConsumerKernel(tp, hid, nb, early_wait=True, **consumer)
        self.producer = OprojProducer(
            tp, hid, d_local, multicast=multicast, fence=c.fence, twoshot=c.twoshot
        )
        self.tp, self.hid, self.nb, self.d = tp, hid, nb, d_local
        self.groups, self.tiles, self.pdl = c.groups, tiles, c.pdl
        self.ctas, self.teams = c.ctas, producer_teams(hid, self.groups)
        self.rows = producer_rows(hid, self.groups, tiles)
        self.threads = c.threads
        self.launch_bound = min_blocks_per_sm(self.groups, c.group_threads)

    @cute.jit
    def __call__(self, producer: ProducerOperands, op: ConsumerOperands, stream: cuda.CUstream):
        attn_out, w_o, peers, multicast_base = producer
        call = self.kernel(
            Int64(attn_out.iterator.toint()),
            Int64(w_o.iterator.toint()),
            peers,
            multicast_base,
            self.consumer.addresses(op),
        )
        launch(
            call,
            (self.ctas, self.rows + op.prefix.shape[0], 1),
            (self.threads, 1, 1),
            stream,
            cluster=(self.ctas, 1, 1),
            use_pdl=self.pdl,
            min_blocks_per_mp=self.launch_bound,
            carveout=100,
        )

    @cute.jit
    def produce(self, red, thread, cta, row, p: ProjectionAddresses):
        """A producer CTA: team e runs its T tiles (``OprojProducer.tile``)."""
        team, tid = thread // THREADS, thread % THREADS
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()  # attn_out is the previous kernel's
        for g in cutlass.range_constexpr(self.teams):  # static named-barrier ids 1 + g
            if team == g:
                for t in cutlass.range(self.tiles, unroll=1):
                    index = tile_index(row, cta, g, t, self.ctas, self.teams, self.tiles)
                    if index < tile_count(self.hid):  # uniform in the team: barrier-safe
                        self.producer.tile(p, index, tid, red, g * WARPS, 1 + g, False)
                        if cutlass.const_expr(self.tiles > 1):  # the next tile reuses red
                            cute.arch.barrier(barrier_id=1 + g, number_of_threads=THREADS)

    @cute.kernel
    def kernel(self, a_attn: Int64, a_w: Int64, peers: cute.Tensor, multicast_base: Int64, op):
        """Producer CTAs (rows ``< P``), then consumer clusters (``op``: the consumer's
        ``ConsumerAddresses``)."""
        thread, _, _ = cute.arch.thread_idx()
        cta, row, _ = cute.arch.block_idx()
        smem = self.consumer.allocate()
        red_shape = (self.teams * WARPS, 32, 4)
        red = smem_tensor(cutlass.memory.SmemAllocator(), Float32, red_shape)
        if row < self.rows:
            fields = (op.tokens, op.rank, op.step)
            p = ProjectionAddresses(a_attn, a_w, peers, multicast_base, *fields)
            self.produce(red, thread, cta, row, p)
        else:
            self.consumer.body(smem, thread, cta, row - self.rows, op)


def fake_fused_arguments(tp, hid, nb, d_local, xmoe_reps=0, twoshot=False):
    """Compile-only arguments of ``OprojFused.__call__`` (tokens dynamic)."""
    producer = fake_producer_arguments(tp, hid, d_local)[0]
    return (producer, *fake_arguments(tp, hid, nb, xmoe_reps, twoshot))


def compiled_fused(tp, hid, nb, d_local, arch=None, **config):
    """One compile per configuration (``config``: ``OprojFused``'s keywords) and arch;
    tokens are dynamic (1..8)."""
    xmoe_reps, twoshot = config.get("xmoe_reps", 0), config.get("twoshot", False)

    def build():
        kernel = OprojFused(tp, hid, nb, d_local, **config)
        return kernel, fake_fused_arguments(tp, hid, nb, d_local, xmoe_reps, twoshot)

    key = ("oproj_fused", tp, hid, nb, d_local, *sorted(config.items()))
    return compile_cached(key, build, arch=arch)
