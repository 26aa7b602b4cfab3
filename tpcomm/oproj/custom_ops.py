"""The o-projection all-reduce as torch ops: ``kimi::oproj_publish``, ``kimi::oproj_produce``,
``kimi::oproj_consume`` and ``kimi::oproj_produce_consume``.

The all-reduce (``OprojAllReduce``: mailboxes in symmetric memory, peer-pointer tables,
multicast address, error and hint words, compiled kernels) reaches an op as a handle: an
int id into this module's registry, which ``OprojAllReduce`` fills on construction. Why a
handle and not its buffers as tensor arguments: the producer writes into peers' mailboxes
through a pointer table, and peers write into ours, so torch cannot see those writes, and a
mailbox named in ``mutates_args`` would be cloned and copied back by functionalization
(``aot_eager``), wiping partials a peer published meanwhile. Instead the ops carry an
ordered effect (``torch.library.EffectType.ORDERED``): ``torch.compile`` keeps them in
program order and never drops one, though a producer returns nothing. ``mutates_args``
names only what the kernels write through their own arguments (``prefix``, ``output``);
the error words are read back on the host (``OprojAllReduce.error``).

The fake implementations run the entry points' checks (``ValueError`` naming the argument;
under fake tensors every check but alignment) and launch nothing. ``step`` and ``rank``
are ints, so a compiled caller specialises on the parity (two graphs). Importing this
module needs no CuTe DSL.
"""

from __future__ import annotations

import itertools
import weakref

import torch

NAMESPACE = "kimi"

_REGISTRY: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register(comm) -> int:
    """A handle for ``comm`` (held weakly: a handle outliving its all-reduce is refused)."""
    handle = next(_IDS)
    _REGISTRY[handle] = comm
    return handle


def lookup(handle: int):
    """The all-reduce behind ``handle``; ValueError when there is none (any more)."""
    comm = _REGISTRY.get(handle)
    if comm is None:
        raise ValueError(f"handle {handle!r} names no live OprojAllReduce")
    return comm


_ORDERED = torch.library.EffectType.ORDERED
_MUTATES = ("prefix", "output")
# Written out so that handle, rank and step are ``int``, not ``SymInt``: a compiled caller
# specialises on them (a parity that alternates would otherwise turn symbolic).
_CONSUME = "Tensor(a!) prefix, Tensor? blocks, Tensor norm, Tensor query, Tensor out_norm, "
_CONSUME += "Tensor(b!) output, Tensor? xmoe"
_SCHEMAS = {
    "publish": "(int handle, int rank, int step, Tensor partial) -> ()",
    "produce": "(int handle, int rank, int step, Tensor attn_out, Tensor w_o) -> ()",
    "consume": (
        f"(int handle, int rank, int step, {_CONSUME}, bool checked, str? validate=None) -> ()"
    ),
    "produce_consume": (
        f"(int handle, int rank, int step, Tensor attn_out, Tensor w_o, {_CONSUME}, "
        "int? tiles, bool pdl, int? launches, bool checked) -> ()"
    ),
}


@torch.library.custom_op(f"{NAMESPACE}::oproj_publish", mutates_args=(), schema=_SCHEMAS["publish"])
def oproj_publish(handle: int, rank: int, step: int, partial: torch.Tensor) -> None:
    """``OprojAllReduce.publish``: rank ``rank``'s ready partial into every mailbox."""
    lookup(handle).launch_publish(partial, step, rank)


@oproj_publish.register_fake
def _publish_fake(handle, rank, step, partial):
    lookup(handle).check_publish_args(partial, step, rank)


@torch.library.custom_op(f"{NAMESPACE}::oproj_produce", mutates_args=(), schema=_SCHEMAS["produce"])
def oproj_produce(
    handle: int, rank: int, step: int, attn_out: torch.Tensor, w_o: torch.Tensor
) -> None:
    """``OprojAllReduce.produce``: ``bf16(attn_out @ w_o^T)`` into every rank's mailbox."""
    lookup(handle).launch_produce(attn_out, w_o, step, rank)


@oproj_produce.register_fake
def _produce_fake(handle, rank, step, attn_out, w_o):
    lookup(handle).check_produce_args(attn_out, w_o, step, rank)


@torch.library.custom_op(
    f"{NAMESPACE}::oproj_consume", mutates_args=_MUTATES, schema=_SCHEMAS["consume"]
)
def oproj_consume(
    handle: int,
    rank: int,
    step: int,
    prefix: torch.Tensor,
    blocks: torch.Tensor | None,
    norm: torch.Tensor,
    query: torch.Tensor,
    out_norm: torch.Tensor,
    output: torch.Tensor,
    xmoe: torch.Tensor | None,
    checked: bool,
    validate: str | None = None,
) -> None:
    """``OprojAllReduce.consume``: ``prefix`` updated in place, ``output`` written."""
    lookup(handle).launch_consume(prefix, blocks, norm, query, out_norm, output, step,
                                  xmoe=xmoe, rank=rank, checked=checked,
                                  validate=validate)  # fmt: skip


@oproj_consume.register_fake
def _consume_fake(handle, rank, step, prefix, blocks, norm, query, out_norm, output, xmoe,
                  checked, validate=None):  # fmt: skip
    lookup(handle).check_consume_args(prefix, blocks, norm, query, out_norm, output, step, xmoe,
                                      rank, validate)  # fmt: skip


@torch.library.custom_op(
    f"{NAMESPACE}::oproj_produce_consume",
    mutates_args=_MUTATES,
    schema=_SCHEMAS["produce_consume"],
)
def oproj_produce_consume(
    handle: int,
    rank: int,
    step: int,
    attn_out: torch.Tensor,
    w_o: torch.Tensor,
    prefix: torch.Tensor,
    blocks: torch.Tensor | None,
    norm: torch.Tensor,
    query: torch.Tensor,
    out_norm: torch.Tensor,
    output: torch.Tensor,
    xmoe: torch.Tensor | None,
    tiles: int | None,
    pdl: bool,
    launches: int | None,
    checked: bool,
) -> None:
    """``OprojAllReduce.produce_consume``: the fused producer + consumer launch."""
    lookup(handle).launch_produce_consume(
        attn_out, w_o, prefix, blocks, norm, query, out_norm, output, step, xmoe=xmoe,
        rank=rank, tiles=tiles, pdl=pdl, launches=launches, checked=checked,
    )  # fmt: skip


@oproj_produce_consume.register_fake
def _produce_consume_fake(handle, rank, step, attn_out, w_o, prefix, blocks, norm, query,
                          out_norm, output, xmoe, tiles, pdl, launches, checked):  # fmt: skip
    comm = lookup(handle)
    comm.check_produce_args(attn_out, w_o, step, rank)
    comm.check_consume_args(prefix, blocks, norm, query, out_norm, output, step, xmoe, rank)


for _op in (oproj_publish, oproj_produce, oproj_consume, oproj_produce_consume):
    _op.register_effect(_ORDERED)

__all__ = [
    "NAMESPACE", "register", "lookup", "oproj_publish", "oproj_produce", "oproj_consume",
    "oproj_produce_consume",
]  # fmt: skip
