"""O-projection producer side: publishing a rank's partial into every rank's mailbox.

``PartialPublisher``: rank r's partial ``[tokens, HID]`` bf16 (already computed) goes
into slot ``[step & 1, r]`` of every rank's mailbox ``[2, TP, tokens, HID]``: each thread
loads one 16-byte group, canonicalises sentinel words (``tpcomm.ptx.publish``) and stores
it with one relaxed sys-scope store per peer through the peer pointer table (the NVLink
path; multicast, when the platform has it, is one store). Grid ``(HID / 1024, tokens)``,
128 threads. With ``fence`` a sys-scope fence first orders this step's publish after the
previous step's re-arms of the same parity on other GPUs (one GPU: the kernel boundary
does it).

The GEMM producer (``attn_out @ w_o^T`` straight into the mailboxes) is not written yet;
``tpcomm.oproj.reference.project`` is its reference.

The CuTe DSL is imported lazily: this module imports on a CPU-only machine.
"""

import functools

from tpcomm.oproj.reference import MAX_TP, SLICE

THREADS = 128


@functools.cache
def _publisher_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from tpcomm import ptx
    from tpcomm.cuteutil import launch

    class PartialPublisher:
        """Compile-time configuration: TP, HID, multicast, sys fence, PDL."""

        def __init__(self, tp, hid, *, multicast=False, fence=False, pdl=False):
            if not isinstance(tp, int) or not 1 <= tp <= MAX_TP:
                raise ValueError(f"tp must be an int in 1..{MAX_TP}; got {tp!r}")
            if not isinstance(hid, int) or hid % SLICE or not SLICE <= hid <= 8 * SLICE:
                raise ValueError(f"hid must be a multiple of 1024 in 1024..8192; got {hid!r}")
            self.tp, self.hid = tp, hid
            self.multicast, self.fence, self.pdl = bool(multicast), bool(fence), bool(pdl)

        @cute.jit
        def __call__(
            self,
            partial: cute.Tensor,
            peers: cute.Tensor,
            multicast_base: Int64,
            rank: Int32,
            step: Int32,
            stream: cuda.CUstream,
        ):
            call = self.kernel(
                Int64(partial.iterator.toint()),
                peers,
                multicast_base,
                partial.shape[0],
                rank,
                step,
            )
            grid = (self.hid // SLICE, partial.shape[0], 1)
            launch(call, grid, (THREADS, 1, 1), stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, a_partial: Int64, peers: cute.Tensor, multicast_base: Int64,
                   tokens: Int32, rank: Int32, step: Int32):  # fmt: skip
            tid, _, _ = cute.arch.thread_idx()
            cta, token, _ = cute.arch.block_idx()
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
            row = (Int64(token) * self.hid + cta * SLICE + tid * 8) * 2
            words = ptx.load16(a_partial + row)
            slot_bytes = Int64(tokens) * (self.hid * 2)
            offset = (Int64(step & 1) * self.tp + rank) * slot_bytes + row
            if cutlass.const_expr(self.fence):
                ptx.fence_sys()
            if cutlass.const_expr(self.multicast):
                ptx.publish(multicast_base + offset, words, multicast=True)
            else:
                for p in cutlass.range_constexpr(self.tp):
                    ptx.publish(peers[p] + offset, words)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()

    return PartialPublisher


def publisher_class():
    """The ``PartialPublisher`` class (imports the CuTe DSL)."""
    return _publisher_class()


def fake_publisher_arguments(tp: int, hid: int):
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Int64

    tokens = cute.sym_int()
    return (
        cute.runtime.make_fake_compact_tensor(BFloat16, (tokens, hid), assumed_align=16),
        cute.runtime.make_fake_compact_tensor(Int64, (tp,), assumed_align=8),
        Int64(0),
        Int32(0),
        Int32(0),
        cute.runtime.make_fake_stream(),
    )


@functools.cache
def compiled_publisher(tp, hid, multicast=False, fence=False, pdl=False, arch=None):
    """One compile per configuration and arch; tokens are dynamic."""
    import cutlass.cute as cute

    kernel = publisher_class()(tp, hid, multicast=multicast, fence=fence, pdl=pdl)
    options = None if arch is None else f"--gpu-arch {arch}"
    return cute.compile(kernel, *fake_publisher_arguments(tp, hid), options=options)
