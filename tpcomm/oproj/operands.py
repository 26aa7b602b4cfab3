"""The o-projection kernels' operands, defined once.

``ConsumeTensors``: a consumer step's torch tensors, as the ``kimi::oproj_consume`` and
``kimi::oproj_produce_consume`` schemas and ``tpcomm.oproj.launcher`` take them.
``ConsumerOperands``: ``OprojConsumerKernel.__call__``'s (CuTe values, built by
``tpcomm.oproj.launcher``; the fused kernel's consumer part). ``PublishOperands``: the
publisher's; ``ProducerOperands``: the producer's (and the fused kernel's producer part);
``ProjectionAddresses``: the producer kernel's one argument. ``ConsumerAddresses``: the
consumer kernel's one argument (tensors as ``Int64`` addresses, ``tokens`` from ``prefix``;
the DSL passes a NamedTuple's fields as the kernel's parameters, in this order). Importing
this module needs no CuTe DSL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import cutlass.cute as cute
    import torch
    from cutlass import Float32, Int32, Int64


class ConsumeTensors(NamedTuple):
    """A rank's consumer tensors: ``prefix`` [tokens, HID] (updated in place), ``blocks``
    [tokens, nb, HID] or None, ``norm``, ``query``, ``out_norm`` [HID], ``output``
    [tokens, HID] (written), ``xmoe`` [reps, tokens, HID] or None."""

    prefix: torch.Tensor
    blocks: torch.Tensor | None
    norm: torch.Tensor
    query: torch.Tensor
    out_norm: torch.Tensor
    output: torch.Tensor
    xmoe: torch.Tensor | None = None


# how the op schemas spell a ``ConsumeTensors`` field (the rest: ``Tensor``)
SCHEMA_TYPES = {
    "prefix": "Tensor(a!)",
    "blocks": "Tensor?",
    "output": "Tensor(b!)",
    "xmoe": "Tensor?",
}


class PublishOperands(NamedTuple):
    """A rank's ready partial [tokens, HID], the peer table and the multicast address it
    publishes through (the publisher's operands)."""

    partial: cute.Tensor
    peers: cute.Tensor
    multicast_base: Int64


class ProducerOperands(NamedTuple):
    """A rank's projection: ``attn_out`` [tokens, D_local], ``w_o`` [HID, D_local], the
    peer table and the multicast address it publishes through."""

    attn_out: cute.Tensor
    w_o: cute.Tensor
    peers: cute.Tensor
    multicast_base: Int64


class ProjectionAddresses(NamedTuple):
    """The producer kernel's parameters (the fused kernel's producer CTAs take the same):
    ``attn_out`` and ``w_o`` as addresses, the peer table, the multicast address, tokens,
    rank and step."""

    a_attn: Int64
    a_w: Int64
    peers: cute.Tensor
    multicast_base: Int64
    tokens: Int32
    rank: Int32
    step: Int32


class ConsumerOperands(NamedTuple):
    """A rank's consumer step: mailbox (twoshot: the gather row), the AttnRes and norm
    tensors, ``xmoe`` copies, hint and error words, scalars, the receive view (or signal
    words) and the twoshot gather peers."""

    mailbox: cute.Tensor
    prefix: cute.Tensor
    blocks: cute.Tensor
    norm: cute.Tensor
    query: cute.Tensor
    out_norm: cute.Tensor
    output: cute.Tensor
    xmoe: cute.Tensor
    hints: cute.Tensor
    eps: Float32
    out_eps: Float32
    error: cute.Tensor
    step: Int32
    budget_ns: Int64
    recv: cute.Tensor
    gather_peers: cute.Tensor
    rank: Int32


class ConsumerAddresses(NamedTuple):
    """``ConsumerOperands`` as the consumer kernel's parameters (``a_``: an address)."""

    a_mailbox: Int64
    a_prefix: Int64
    a_blocks: Int64
    a_norm: Int64
    a_query: Int64
    a_out_norm: Int64
    a_output: Int64
    a_xmoe: Int64
    a_hints: Int64
    a_error: Int64
    tokens: Int32
    eps: Float32
    out_eps: Float32
    step: Int32
    budget_ns: Int64
    a_recv: Int64
    gather_peers: cute.Tensor
    rank: Int32
