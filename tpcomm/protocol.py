"""Device primitives of the mailbox protocol: 16-byte global accesses by memory order,
the sentinel test, publish, bounded poll, re-arm, error word, hint counter, sys fence.

Each wrapper states its memory order and scope in its first docstring line (``load16`` and
``store16``: per ``order``, in ``ORDERS``). Addresses are ``Int64`` (or CuTe global
pointers), so a peer's mailbox and this rank's own go through the same code. A 16-byte
group is four 32-bit words, each single-copy atomic: a group is *published* when none of
its words is ``SENTINEL``, so a torn store reads "not yet"; producers canonicalise a data
word equal to the sentinel to ``CANONICAL_NAN_WORD``. Needs the CuTe DSL.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from tpcomm.cuteutil import unpack_bf16x2
from tpcomm.mailbox import CANONICAL_NAN_WORD, SENTINEL

SENTINEL_I32 = SENTINEL - (1 << 32)  # -1 as a signed word
CANONICAL_I32 = CANONICAL_NAN_WORD


def _addr(address, *, loc=None, ip=None):
    """An ``i64`` IR value from an Int64, a Python int or a CuTe pointer."""
    if hasattr(address, "toint"):
        return address.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)
    return Int64(address).ir_value(loc=loc, ip=ip)


def _words(values, *, loc=None, ip=None):
    return [Int32(v).ir_value(loc=loc, ip=ip) for v in values]


def _load4(ptx: str, address, *, loc=None, ip=None):
    struct = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(i32,i32,i32,i32)>"),
        [_addr(address, loc=loc, ip=ip)],
        ptx,
        "=r,=r,=r,=r,l,~{memory}",
        has_side_effects=True,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )
    return tuple(Int32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(4))


def _store4(ptx: str, address, words, *, loc=None, ip=None):
    llvm.inline_asm(
        None,
        [_addr(address, loc=loc, ip=ip), *_words(words, loc=loc, ip=ip)],
        ptx,
        "l,r,r,r,r,~{memory}",
        has_side_effects=True,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )


# --- 16-byte global loads and stores -------------------------------------------------
# ``order`` of ``load16`` and ``store16``: the PTX memory order and scope (and what for)
ORDERS = {
    "weak": "",  # plain, no scope: data nobody accesses concurrently
    "relaxed.sys": ".relaxed.sys",  # a local or peer (NVLink) word: polls, publishes, re-arms
    "relaxed.gpu": ".relaxed.gpu",  # a store a later kernel on this GPU reads after a hint
    "acquire.sys": ".acquire.sys",  # a load this thread's later accesses are ordered after
    "release.sys": ".release.sys",  # a store this thread's earlier accesses are ordered before
}


@dsl_user_op
def load16(address, order="weak", *, loc=None, ip=None):
    """``ORDERS[order]``: 16-byte global load of four 32-bit words."""
    ptx = f"ld{ORDERS[order]}.global.v4.b32 {{$0, $1, $2, $3}}, [$4];"
    return _load4(ptx, address, loc=loc, ip=ip)


@dsl_user_op
def store16(address, words, order="weak", *, loc=None, ip=None):
    """``ORDERS[order]``: 16-byte global store of four 32-bit words."""
    ptx = f"st{ORDERS[order]}.global.v4.b32 [$0], {{$1, $2, $3, $4}};"
    _store4(ptx, address, words, loc=loc, ip=ip)


@dsl_user_op
def multimem_store16(address, words, *, loc=None, ip=None):
    """Relaxed, sys scope: 16-byte multicast store (every PE's copy); needs NVLink multicast."""
    # cutlass.utils.distributed.multimem_st exists but is .weak; the protocol wants relaxed.sys
    _store4(
        "multimem.st.relaxed.sys.global.v4.f32 [$0], {$1, $2, $3, $4};",
        address,
        words,
        loc=loc,
        ip=ip,
    )


# --- sentinel protocol ---------------------------------------------------------------


@cute.jit
def canonicalize(word: Int32) -> Int32:
    """No memory access: a data word equal to the sentinel becomes two canonical NaNs."""
    result = word
    if word == Int32(SENTINEL_I32):
        result = Int32(CANONICAL_I32)
    return result


@cute.jit
def published(w0: Int32, w1: Int32, w2: Int32, w3: Int32) -> cutlass.Boolean:
    """No memory access: True when none of the group's four words is the sentinel."""
    s = Int32(SENTINEL_I32)
    return (w0 != s) & (w1 != s) & (w2 != s) & (w3 != s)


@cute.jit
def publish(address: Int64, words, multicast: cutlass.Constexpr[bool] = False):
    """Relaxed, sys scope: canonicalise four words and store them to a peer or multicast address."""
    clean = [canonicalize(w) for w in words]
    if cutlass.const_expr(multicast):
        multimem_store16(address, clean)
    else:
        store16(address, clean, "relaxed.sys")


@cute.jit
def rearm(address: Int64):
    """Relaxed, sys scope: write the sentinel back into a consumed 16-byte group."""
    s = Int32(SENTINEL_I32)
    store16(address, [s, s, s, s], "relaxed.sys")


@cute.jit
def raise_error(error_address: Int64, bits: Int32):
    """Relaxed, sys scope: atomic OR of ``bits`` (missing-rank mask) into the error word."""
    ptr = cute.make_ptr(Int32, error_address, cute.AddressSpace.gmem, assumed_align=4)
    cute.arch.atomic_or(ptr.llvm_ptr, bits, sem="relaxed", scope="sys")


@cute.jit
def poll_groups(
    raw,
    addresses,
    count: cutlass.Constexpr[int],
    budget_ns: Int64,
    error_address: Int64,
    first: cutlass.Constexpr[int] = 0,
) -> Int32:
    """Relaxed, sys scope: bounded spin until ``count`` 16-byte groups are published.

    ``raw`` is a ``[count * 4]`` Int32 register tensor receiving the words; ``addresses``
    a list of ``count`` Int64 addresses of ranks ``first .. first + count - 1``. Returns 0
    when all were published, otherwise the mask of groups (bit g = ``addresses[g]``) still
    empty when the ``globaltimer`` budget ran out; that mask shifted to rank numbering
    (``<< first``) is OR-ed into the error word, so a dead peer gives an error naming it
    instead of a hang.
    """
    pending = Int32(0)
    for g in cutlass.range_constexpr(count):
        w = load16(addresses[g], "relaxed.sys")
        for j in cutlass.range_constexpr(4):
            raw[g * 4 + j] = w[j]
        if not published(w[0], w[1], w[2], w[3]):
            pending = pending | Int32(1 << g)
    failed = Int32(0)
    if pending != 0:
        deadline = cute.arch.globaltimer() + budget_ns
        while pending != 0:
            for g in cutlass.range_constexpr(count):
                if (pending & Int32(1 << g)) != 0:
                    w = load16(addresses[g], "relaxed.sys")
                    for j in cutlass.range_constexpr(4):
                        raw[g * 4 + j] = w[j]
                    if published(w[0], w[1], w[2], w[3]):
                        pending = pending & Int32(~(1 << g))
            if pending != 0:  # noqa: SIM102
                if cute.arch.globaltimer() > deadline:
                    failed = pending
                    pending = Int32(0)
        if failed != 0:
            raise_error(error_address, failed << first)
    return failed


def add_in_rank_order(acc, raw, count: int, start: int):
    """Traced: the rank-order fp32 sum of ``count`` polled groups (``raw``: their bf16x2
    words) into the 8 values ``acc``, each added after the one before; ``start``: the first
    group's place in the sum (0: its values start it, no ``+0.0``)."""
    for i in range(count):
        for j in range(4):
            x, y = unpack_bf16x2(raw[i * 4 + j])
            if start + i == 0:
                acc[2 * j], acc[2 * j + 1] = x, y
            else:
                acc[2 * j] = acc[2 * j] + x
                acc[2 * j + 1] = acc[2 * j + 1] + y


@dsl_user_op
def load_acquire_sys(address, *, loc=None, ip=None):
    """Acquire, sys scope: 4-byte load (a signal word's low half); later accesses after it."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [_addr(address, loc=loc, ip=ip)],
            "ld.acquire.sys.global.b32 $0, [$1];",
            "=r,l,~{memory}",
            has_side_effects=True,
            asm_dialect=0,
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def wait_signals(
    signals: Int64,
    remote: Int32,
    count: cutlass.Constexpr[int],
    budget_ns: Int64,
    error_address: Int64,
    first: cutlass.Constexpr[int] = 0,
) -> Int32:
    """Acquire, sys scope: bounded spin until the signal word (8 bytes, set to 1 by a
    put-with-signal) of every rank ``first + g`` with bit g of ``remote`` is non-zero.

    ``signals`` addresses rank ``first``'s word. Returns 0, or the mask (bit g) of ranks
    still silent when the ``globaltimer`` budget ran out, OR-ed into the error word
    shifted to rank numbering like ``poll_groups``. The slots' data is read after this.
    """
    pending = Int32(0)
    for g in cutlass.range_constexpr(count):
        if (remote & Int32(1 << g)) != 0:  # noqa: SIM102 (dynamic: no short circuit)
            if load_acquire_sys(signals + g * 8) == Int32(0):
                pending = pending | Int32(1 << g)
    failed = Int32(0)
    if pending != 0:
        deadline = cute.arch.globaltimer() + budget_ns
        while pending != 0:
            for g in cutlass.range_constexpr(count):
                if (pending & Int32(1 << g)) != 0:  # noqa: SIM102
                    if load_acquire_sys(signals + g * 8) != Int32(0):
                        pending = pending & Int32(~(1 << g))
            if pending != 0:  # noqa: SIM102
                if cute.arch.globaltimer() > deadline:
                    failed = pending
                    pending = Int32(0)
        if failed != 0:
            raise_error(error_address, failed << first)
    return failed


@cute.jit
def release_increment(address: Int64):
    """Release, gpu scope: add 1 to a hint counter that the next kernel polls."""
    ptr = cute.make_ptr(Int32, address, cute.AddressSpace.gmem, assumed_align=4)
    cute.arch.red(ptr.llvm_ptr, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None):
    """No memory access: suspend the thread for up to about ``ns`` ns (a poll's back-off)."""
    llvm.inline_asm(
        None,
        [Int32(ns).ir_value(loc=loc, ip=ip)],
        "nanosleep.u32 $0;",
        "r",
        has_side_effects=True,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )


@cute.jit
def wait_count(
    address: Int64,
    target: Int32,
    budget_ns: Int64,
    error_address: Int64,
    sleep_ns: cutlass.Constexpr[int] = 0,
) -> Int32:
    """Acquire, gpu scope: bounded spin until the counter at ``address`` is >= ``target``;
    1 when it is (later accesses of this thread ordered after the load that saw it), 0 when
    the ``globaltimer`` budget ran out (then the error word at ``error_address`` |= 1).
    ``sleep_ns`` > 0: a ``nanosleep`` between polls, so a spinner that waits from the step's
    start does not keep the counter's L2 slice busy under the releases it waits for."""
    ptr = cute.make_ptr(Int32, address, cute.AddressSpace.gmem, assumed_align=4)
    reached = Int32(0)
    if cute.arch.load(ptr.llvm_ptr, Int32, sem="acquire", scope="gpu") >= target:
        reached = Int32(1)
    if reached == 0:
        deadline = cute.arch.globaltimer() + budget_ns
        waiting = Int32(1)
        while waiting != 0:
            if cute.arch.load(ptr.llvm_ptr, Int32, sem="acquire", scope="gpu") >= target:
                reached = Int32(1)
                waiting = Int32(0)
            if waiting != 0:  # noqa: SIM102
                if cute.arch.globaltimer() > deadline:
                    waiting = Int32(0)
                if cutlass.const_expr(sleep_ns > 0):
                    nanosleep(sleep_ns)
        if reached == 0:
            raise_error(error_address, Int32(1))
    return reached


@cute.jit
def fence_sys():
    """Acq_rel fence at sys scope: orders re-arms before the next step's peer publishes."""
    cute.arch.fence_acq_rel_sys()
