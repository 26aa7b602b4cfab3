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

The implementations are ``tpcomm.oproj.launcher``'s (the route goes one way: entry, op,
launcher); the fake ones are ``tpcomm.oproj.checks``' (the entry points' checks:
``ValueError`` naming the argument; under fake tensors every check but alignment) and
launch nothing. ``step`` and ``rank`` are ints, so a compiled caller specialises on the
parity (two graphs). Importing this module needs no CuTe DSL.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from tpcomm.oproj import checks, launcher
from tpcomm.oproj.operands import SCHEMA_TYPES, ConsumeTensors

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
_CONSUME = ", ".join(f"{SCHEMA_TYPES.get(f, 'Tensor')} {f}" for f in ConsumeTensors._fields)
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
_TENSORS = len(ConsumeTensors._fields)


def _grouped(args, first):
    """The schema's arguments after the handle with its consumer tensors (from ``first``)
    as one ``ConsumeTensors``, as ``launcher`` and ``checks`` take them."""
    last = first + _TENSORS
    return (*args[:first], ConsumeTensors(*args[first:last]), *args[last:])


def _op(name, implementation, fake, *, grouped=None):
    """``kimi::oproj_<name>``: ``implementation`` and ``fake`` take the all-reduce behind
    the handle and the schema's other arguments (``grouped``: where its consumer tensors
    start, after rank and step)."""

    def run(handle, *args):
        implementation(lookup(handle), *(args if grouped is None else _grouped(args, grouped)))

    def check(handle, *args):
        fake(lookup(handle), *(args if grouped is None else _grouped(args, grouped)))

    mutates = _MUTATES if grouped is not None else ()
    qualified = f"{NAMESPACE}::oproj_{name}"
    op = torch.library.custom_op(qualified, run, mutates_args=mutates, schema=_SCHEMAS[name])
    op.register_fake(check)
    op.register_effect(_ORDERED)
    return op


# ``OprojAllReduce.publish``: rank ``rank``'s ready partial into every mailbox
oproj_publish = _op("publish", launcher.publish, checks.publish_args)
# ``OprojAllReduce.produce``: ``bf16(attn_out @ w_o^T)`` into every rank's mailbox
oproj_produce = _op("produce", launcher.produce, checks.produce_args)
# ``OprojAllReduce.consume``: ``prefix`` updated in place, ``output`` written
oproj_consume = _op("consume", launcher.consume, checks.consume_args, grouped=2)
# ``OprojAllReduce.produce_consume``: the fused producer + consumer launch
oproj_produce_consume = _op(
    "produce_consume", launcher.produce_consume, checks.produce_consume_args, grouped=4
)

__all__ = [
    "NAMESPACE",
    "register",
    "lookup",
    "oproj_publish",
    "oproj_produce",
    "oproj_consume",
    "oproj_produce_consume",
]
