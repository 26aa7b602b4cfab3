"""A continuous-batching decode loop over a stack of KDA layers, checked token by token.

Requests arrive and finish at random; each holds a group of state pages from admission
(``admit``) to its end. Every step verifies ``TOKENS`` draft tokens per request and the
sampler accepts a random 1..TOKENS of them (the emitted tokens), which the next step reads
(``accepted``). The stack alternates the two KDA state modes: per-step pages and replay
rings. A shared prompt prefix is decoded once and kept as a snapshot (``copy_state`` into
a cache group); requests that share it start from a copy of the snapshot. One request is
preempted to host memory (``export_state``), its pages given to others, and resumed later
in other pages (``import_state``). At the end every emitted token's output of every layer
is checked against its request run alone through the unsharded layers (the references;
the request decodes the prefix itself there): bit for bit on the CPU, within the kernels'
rounding on a GPU.

    python examples/serving_loop.py                          # CPU, host backend, TP 1
    torchrun --nproc-per-node 2 examples/serving_loop.py     # CPU, host backend, TP 2
    python examples/serving_loop.py --device cuda            # one GPU (loopback)
"""

import argparse
import os
from dataclasses import dataclass, field

import torch

from engine import DecodeLayer, all_reduces, step_inputs
from kda import layer as kl
from kda import reference as kref
from kda import synthetic as kt
from kda.operands import make_ring
from tpcomm.backends import make_backend
from tpcomm.oproj import reference as oref

MODES = ("per-step", "replay", "per-step")  # the stack: one KDA state mode per layer
HEADS, HIDDEN, TOKENS, RING = 2, 1024, 3, 4  # 2 heads of 128, 3 draft tokens, ring of 4
BATCH, GROUPS = 4, 6  # requests per step (the rows bucket: BATCH x TOKENS); page groups
PAGES = 1 + GROUPS * TOKENS  # group g: pages 1 + g*TOKENS ..; page 0 pads
CACHE = GROUPS - 1  # the prefix snapshot's group
REQUESTS, PREFIX_STEPS, PREEMPT_AT = 8, 2, 4  # requests served; prefix steps; preemption step
EPS = 1e-6


@dataclass
class Request:
    id: int
    steps: int  # verify steps it runs (a shared prefix's not counted)
    shared: bool  # starts from the cached prefix
    group: int | None = None  # its page group while it runs
    accepted: int = 1  # what its next step reads
    done: int = 0  # own steps run
    history: list = field(default_factory=list)  # per step: (embeddings, accepted read)
    emitted: list = field(default_factory=list)  # per step: [layer][accepted rows, HID]
    blobs: list | None = None  # its state in host memory while preempted


def pages(group) -> torch.Tensor:
    return torch.arange(1 + group * TOKENS, 1 + (group + 1) * TOKENS, dtype=torch.int32)


def weights(seed):
    """A layer's KDA weights (fresh pools), its ``w_o`` and the engine's GEMM weights for
    its inputs (q, k, v, f_a, beta, gate side by side, float64: exact products)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * shape[0] ** -0.5).bfloat16()
    widths = [HEADS * 128] * 3 + [128, HEADS, HEADS * 128]  # q, k, v, f_a, beta, gate
    gemms = dict(inputs=rnd(HIDDEN, sum(widths)).double(), widths=widths)
    gemms.update(w_o=rnd(HEADS * 128, HIDDEN).T.contiguous())
    return kt.make_layer(HEADS, PAGES, window=TOKENS + 2, seed=seed), gemms


def project(h, gemms):
    """The engine's GEMMs on the layer input ``h`` [rows, HID] bf16 (in float64, so a row's
    result does not depend on the batch): q, k, v, f_a, beta, gate as ``step_inputs``
    takes them."""
    out = (h.double() @ gemms["inputs"]).float().bfloat16()
    return [t.contiguous() for t in out.split(gemms["widths"], dim=1)]


def embeddings(request, step):
    """The tokens' input rows of a request's step (the draft tokens' embeddings)."""
    g = torch.Generator().manual_seed(1000 * request + step)
    return torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()


def main(device: str) -> None:
    if device == "cpu":
        backend = make_backend("host")  # a rank per process (one without torchrun)
    else:
        backend = (
            make_backend("nvshmem") if "RANK" in os.environ else make_backend("loopback", world=1)
        )
    dev = getattr(backend, "device", torch.device("cpu"))
    rank, tp = backend.ranks[0], backend.world
    heads, first = HEADS // tp, rank * (HEADS // tp)
    cols = slice(first * 128, (first + heads) * 128)
    ones = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)  # AttnRes and norm weights
    comms = all_reduces(backend, rows=(BATCH * TOKENS,), hidden=HIDDEN, blocks=0)
    stack = []  # (DecodeLayer, the whole layer, its GEMM weights) per layer
    for i, mode in enumerate(MODES):
        whole, gemms = weights(seed=i)
        shard = kl.shard_layer(whole, first, heads).to(dev)
        w_o = gemms["w_o"][:, cols].contiguous().to(dev)  # [HID, D_local]: the rank's columns
        weights_ = dict(norm=ones, query=ones, out_norm=ones)
        layer = DecodeLayer(
            shard, w_o, comms, rank=rank, kda_state=mode, ring_size=RING, **weights_
        )
        stack.append((layer, whole, gemms))

    def step_stack(h, slots, accepted, parity):
        """One verify step of every layer: inputs from the layer input ``h``, its output
        the next layer's input; returns every layer's output rows."""
        residual, outputs = h.to(dev, copy=True), []  # the residual stream, in place
        for layer, _, gemms in stack:
            x, f_a, beta, gate = step_inputs(*project(h, gemms), rank=rank, tp=tp)
            args = [t.to(dev) for t in (x, f_a, beta, gate, slots)]
            out = layer.step(*args, residual, None, parity, accepted=accepted.to(dev))
            h = out.cpu()
            outputs.append(h)
        return outputs

    g = torch.Generator().manual_seed(7)  # the traffic: the same draws on every rank
    draw = lambda n: int(torch.randint(n, (1,), generator=g))
    waiting = [Request(0, steps=PREFIX_STEPS + 3, shared=False)]  # it decodes the prefix
    running, finished, free = [], [], list(range(CACHE))
    snapshot, preempted, swapped, n, arrived = None, None, False, 0, 1
    while arrived < REQUESTS or waiting or running or preempted:
        if arrived < REQUESTS and draw(2):  # an arrival, sharing the prefix once it is cached
            waiting.append(Request(arrived, steps=1 + draw(4), shared=snapshot is not None))
            arrived += 1
        if preempted is not None and free and n >= PREEMPT_AT + 2:  # resumed, in other pages
            req, preempted = preempted, None
            req.group = free.pop()
            for (layer, *_), blob in zip(stack, req.blobs, strict=True):
                done = layer.import_state(pages(req.group).to(dev), blob)
                if done is not None:  # the copy's event: the next step waits on it
                    torch.cuda.current_stream().wait_event(done)
            running.append(req)
        while waiting and free and len(running) < BATCH:  # admission
            req = waiting.pop(0)
            req.group = free.pop()
            mine = pages(req.group).to(dev)
            for layer, *_ in stack:
                if req.shared:  # the prefix from the snapshot, not decoded again
                    layer.copy_state(pages(CACHE).to(dev), mine)
                else:
                    layer.admit(mine)
            if req.shared:
                req.accepted, req.history = snapshot[0], list(snapshot[1])
            running.append(req)
        if not running:
            n += 1
            continue

        # --- one verify step of the batch (padding rows: slots -1) -----------------------
        slots = torch.full((BATCH, TOKENS), -1, dtype=torch.int32)
        accepted = torch.ones(BATCH, dtype=torch.int32)
        h = torch.zeros(BATCH * TOKENS, HIDDEN, dtype=torch.bfloat16)
        for b, req in enumerate(running):
            emb = embeddings(req.id, len(req.history))
            slots[b], accepted[b] = pages(req.group), req.accepted
            h[b * TOKENS : (b + 1) * TOKENS] = emb
            req.history.append((emb, req.accepted))
        outputs = step_stack(h, slots, accepted, n & 1)
        for b, req in enumerate(list(running)):
            req.accepted = 1 + draw(TOKENS)  # the sampler: tokens accepted, then emitted
            rows = slice(b * TOKENS, b * TOKENS + req.accepted)
            req.emitted.append([out[rows] for out in outputs])
            req.done += 1
            if req.id == 0 and req.done == PREFIX_STEPS:  # the prefix: cache a snapshot
                for layer, *_ in stack:
                    layer.copy_state(pages(req.group).to(dev), pages(CACHE).to(dev))
                snapshot = (req.accepted, list(req.history))
            if req.done == req.steps:
                running.remove(req)
                free.append(req.group)
                finished.append(req)
        if n >= PREEMPT_AT and running and not swapped:  # the newest request to host memory
            req = running.pop()
            req.blobs = [layer.export_state(pages(req.group).to(dev)) for layer, *_ in stack]
            for blob in req.blobs:
                if blob.ready is not None:
                    blob.ready.synchronize()  # the pages are copied out: give them away
            free.append(req.group)
            preempted, swapped = req, True
        n += 1

    checked = sum(check_alone(req, stack, tp, exact=device == "cpu") for req in finished)
    backend.teardown()
    shared = sum(req.shared for req in finished)
    resumed = [req.id for req in finished if req.blobs is not None]
    assert shared and resumed, "the traffic must share the prefix and preempt a request"
    if rank == 0:
        print(
            f"{len(finished)} requests ({shared} from the prefix snapshot, request "
            f"{resumed[0]} preempted and resumed), {n} steps, TP {tp}, layers {MODES}: "
            f"{checked} emitted tokens checked"
        )
        print("OK")


def check(got, want, what: str, exact: bool) -> None:
    """``got`` is ``want``: bitwise on the CPU (both are the references); on a GPU the
    kernels round apart from them, within 1 bf16 ulp a step (docs/contract.md), and the
    stack carries that on, so there each row's relative error must stay below 2^-6 (a slot
    or state mix-up moves a row by its own size)."""
    got, want = got.float(), want.float()
    if exact:
        assert torch.equal(got, want), what
    else:
        error = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)
        assert bool((error <= 2**-6).all()), f"{what}: relative error {float(error.max()):.2e}"


def check_alone(req, stack, tp, exact) -> int:
    """Run ``req``'s steps alone (batch of one, fresh pages) through the unsharded layers
    (``kda.reference`` on every head, the o-projection as the TP ranks' partials) and check
    its emitted outputs bitwise; returns the tokens checked."""
    alone = []
    for layer, whole, gemms in stack:
        pools = whole.clone()
        pools.state.zero_()
        pools.conv_state.zero_()
        ring = make_ring(pools.state, RING) if layer.replay else None
        alone.append((pools, ring, gemms))
    table = pages(0)[None]
    skip = len(req.history) - len(req.emitted)  # prefix steps run by another request
    tokens = 0
    for s, (emb, accepted) in enumerate(req.history):
        h, residual = emb, emb.clone()
        for layer_index, (pools, ring, gemms) in enumerate(alone):
            q, k, v, f_a, beta, gate = project(h, gemms)
            read = torch.tensor([accepted], dtype=torch.int32)
            step = kl.Step(torch.cat([q, k, v], 1), f_a, beta, gate, table, read)
            operands = kl.step_operands(pools, step)
            if ring is None:
                attn = kref.decode(**operands)
            else:
                attn = kref.replay_decode(**operands, ring=ring)
            per = attn.shape[1] // tp
            split = [slice(r * per, (r + 1) * per) for r in range(tp)]
            w_o = gemms["w_o"]  # [HID, D]: rank r's columns c
            partials = torch.stack(
                [oref.project(attn[:, c].contiguous(), w_o[:, c].contiguous()) for c in split]
            )
            ones = torch.ones(HIDDEN, dtype=torch.bfloat16)
            groups = stack[0][0].comm(TOKENS * BATCH).groups  # the all-reduce's order
            h, residual = oref.consume(
                partials, residual, None, ones, ones, ones, eps=EPS, out_eps=EPS, groups=groups
            )
            if s >= skip:
                got = req.emitted[s - skip][layer_index]
                check(got, h[: got.shape[0]], f"request {req.id} step {s}", exact)
                tokens += got.shape[0] if layer_index == 0 else 0
    return tokens


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    main(parser.parse_args().device)
