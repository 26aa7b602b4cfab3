"""The o-projection all-reduce's argument checks, before any launch (``ValueError`` naming
the argument). ``check_consume``: the consumer's tensors and scalars (the reference's
too). The others take an ``OprojAllReduce`` (``comm``) and the torch op's arguments in its
schema's order (``tpcomm.oproj.custom_ops``): the fake implementations run them as they
are, the real ones before they launch. No CuTe DSL.
"""

from __future__ import annotations

import torch

from tpcomm.checks import (
    check_device_tensor,
    check_finite,
    check_real,
    check_stacked,
    check_tensor,
    is_int,
)
from tpcomm.checks import mode as validation_mode
from tpcomm.oproj.plan import MAX_BLOCKS, MAX_TP, check_hidden

BF16 = torch.bfloat16


def check_consume(
    partials, prefix, blocks, norm, query, out_norm, *, groups, eps, out_eps, full, device=None
):
    """Validate consumer arguments; returns (TP, N, HID, nb). ``device``: where every
    tensor but ``partials`` must be (default: ``partials``'s); ``full``: the checked mode's
    non-finite scan."""
    check_tensor("partials", partials, BF16, ndim=3)
    tp, n, hidden = partials.shape
    if not 1 <= tp <= MAX_TP:
        raise ValueError(f"partials must hold 1..16 rank slots (TP); got {tp}")
    if n < 1:
        raise ValueError("partials must hold at least one token")
    check_hidden(hidden, "partials hidden width")
    device = partials.device if device is None else device
    check_tensor("prefix", prefix, BF16, shape=(n, hidden), device=device)
    nb = 0
    if blocks is not None:
        check_tensor("blocks", blocks, BF16, ndim=3, device=device)
        if blocks.shape[0] != n or blocks.shape[2] != hidden:
            raise ValueError(
                f"blocks must be [N = {n}, nb, HID = {hidden}]; got {tuple(blocks.shape)}"
            )
        nb = blocks.shape[1]
        if nb > MAX_BLOCKS:
            raise ValueError(f"blocks holds nb = {nb} snapshots; at most 8 are supported")
    weights = (("norm", norm), ("query", query), ("out_norm", out_norm))
    for name, t in weights:
        check_tensor(name, t, BF16, shape=(hidden,), device=device)
    if not is_int(groups) or not 1 <= groups <= 4:
        raise ValueError(f"groups must be an int in 1..4; got {groups!r}")
    check_real("eps", eps, low=0.0)
    check_real("out_eps", out_eps, low=0.0)
    if full:
        named = (("partials", partials), ("prefix", prefix), ("blocks", blocks), *weights)
        for name, t in named:
            if t is not None and t.device.type != "meta":
                check_finite(name, t)
    return tp, n, hidden, nb


def hosted_rank(comm, rank):
    """``rank`` (None: the backend's first), refused unless this process hosts it."""
    rank = comm.backend.ranks[0] if rank is None else rank
    if rank not in comm.peers:
        raise ValueError(f"rank {rank} is not hosted by this process")
    return rank


def check_step(step):
    if not is_int(step) or step < 0:
        raise ValueError(f"step must be a non-negative int; got {step!r}")
    return step


def require_cuda(comm):
    if comm.device.type != "cuda":
        raise ValueError(f"the mailbox must be on a CUDA device to launch; got {comm.device}")


def consumer_tensors(
    comm, prefix, blocks, norm, query, out_norm, output, xmoe=None, validate=None, *, launch=True
):
    """``OprojAllReduce.check``: unless the consumer can take these tensors (``validate=
    "full"``: also non-finite inputs; ``launch``: and the mailbox is on a GPU)."""
    operands = (comm.probe, prefix, blocks, norm, query, out_norm)
    eps = dict(eps=comm.eps, out_eps=comm.out_eps, full=validation_mode(validate) == "full")
    _, _, _, nb = check_consume(*operands, groups=comm.groups, device=comm.device, **eps)
    if nb != comm.nb:
        raise ValueError(f"blocks holds nb = {nb} snapshots; this all-reduce has nb = {comm.nb}")
    shape = (comm.tokens, comm.hid)
    for name, t in (("prefix", prefix), ("output", output)):
        check_device_tensor(name, t, shape, BF16, comm.device)
    for name, t in (("norm", norm), ("query", query), ("out_norm", out_norm)):
        check_device_tensor(name, t, (comm.hid,), BF16, comm.device)
    if blocks is not None:
        check_device_tensor("blocks", blocks, blocks.shape, BF16, comm.device)
    if comm.xmoe_reps:
        want = (comm.xmoe_reps, comm.tokens, comm.hid)
        check_device_tensor("xmoe", xmoe, want, BF16, comm.device)
    elif xmoe is not None:
        raise ValueError("xmoe given, but this all-reduce was built with xmoe_reps = 0")
    if launch:
        require_cuda(comm)


def projection(comm, attn_out, w_o):
    """Unless ``attn_out`` [tokens, D_local] and ``w_o`` [HID, D_local] fit; returns
    D_local."""
    if not isinstance(attn_out, torch.Tensor) or attn_out.dim() != 2:
        raise ValueError("attn_out must be a 2-D [tokens, D_local] torch.Tensor")
    d_local = attn_out.shape[1]
    if d_local <= 0 or d_local % 128:
        raise ValueError(f"attn_out width D_local must be a multiple of 128; got {d_local}")
    check_device_tensor("attn_out", attn_out, (comm.tokens, d_local), BF16, comm.device)
    check_device_tensor("w_o", w_o, (comm.hid, d_local), BF16, comm.device)
    return d_local


def publish_args(comm, rank, step, partial):
    """``kimi::oproj_publish``'s checks."""
    hosted_rank(comm, rank)
    check_step(step)
    check_device_tensor("partial", partial, (comm.tokens, comm.hid), BF16, comm.device)


def produce_args(comm, rank, step, attn_out, w_o):
    """``kimi::oproj_produce``'s checks; returns D_local."""
    hosted_rank(comm, rank)
    check_step(step)
    return projection(comm, attn_out, w_o)


def consume_args(comm, rank, step, tensors, checked=False, validate=None):
    """``kimi::oproj_consume``'s checks but the device's (``tensors``: ``ConsumeTensors``)."""
    hosted_rank(comm, rank)
    check_step(step)
    consumer_tensors(comm, *tensors, validate, launch=False)


def produce_consume_args(comm, rank, step, attn_out, w_o, tensors, *flags):
    """``kimi::oproj_produce_consume``'s checks but the device's."""
    produce_args(comm, rank, step, attn_out, w_o)
    consume_args(comm, rank, step, tensors)


def one_launch(comm):
    """Unless one launch can serve every rank: a one-GPU backend hosting ranks 0..TP-1
    whose mailboxes are consecutive slices of one allocation (checked once: the layout is
    fixed at construction)."""
    if comm.one_launch_checked:
        return
    if comm.twoshot:
        raise ValueError("one launch for every rank is one-shot only: twoshot=False")
    if not comm.backend.single_device or tuple(comm.backend.ranks) != tuple(range(comm.tp)):
        raise ValueError("one launch for every rank needs one GPU hosting ranks 0..TP-1")
    base = comm.mailbox.local(0)
    for r in range(comm.tp):
        box = comm.mailbox.local(r)
        if box.data_ptr() != base.data_ptr() + r * base.nbytes or not box.is_contiguous():
            raise ValueError(
                "one launch for every rank needs the ranks' mailboxes consecutive in one allocation"
            )
    comm.one_launch_checked = True


def stacked(comm, prefixes, blocks, norm, query, out_norm, outputs, xmoes):
    """Every rank's consumer tensors stacked ``[TP, ...]`` for one launch."""
    one_launch(comm)
    shape = (comm.tokens, comm.hid)
    for name, t in (("prefixes", prefixes), ("outputs", outputs)):
        check_stacked(name, t, (comm.tp, *shape))
    if xmoes is not None:
        check_stacked("xmoes", xmoes, (comm.tp, comm.xmoe_reps, *shape))
    for r in range(comm.tp):
        x = None if xmoes is None else xmoes[r]
        consumer_tensors(comm, prefixes[r], blocks, norm, query, out_norm, outputs[r], x)
