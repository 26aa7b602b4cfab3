"""The engine API whole: one TP rank's KDA layer per process, as a serving engine embeds it.

Each process builds its rank's share of a random layer (``kda.synthetic``: the KDA weights
and pools of its heads, its ``w_o`` columns), the o-projection all-reduces of its backend
and a ``DecodeLayer``; it steps a decode step and verify steps and checks its outputs
against the whole layer run unsharded in one process (the references). The same code on
every backend:

    python examples/embed_layer.py                                # CPU, host backend, TP 1
    torchrun --nproc-per-node 2 examples/embed_layer.py           # CPU, host backend (gloo), TP 2
    python examples/embed_layer.py --device cuda                  # one GPU (loopback), TP 1
    torchrun --nproc-per-node 2 examples/embed_layer.py --device cuda   # a GPU per rank (nvshmem)
"""

import argparse
import os

import torch

from engine import DecodeLayer, all_reduces
from kda import layer as kl
from kda import synthetic as kt
from tpcomm.backends import make_backend
from tpcomm.oproj import reference as oref

HEADS, HIDDEN, BLOCKS = 4, 1024, 2  # the whole layer: 4 KDA heads of 128, 2 AttnRes blocks
REQUESTS, TOKENS, PAGES = 3, 2, 8  # requests per step, verify tokens, state pages
EPS = 1e-6


def check(got, want, what: str, exact: bool) -> None:
    """``got`` is ``want``: bitwise on the CPU (both are the references); on a GPU the
    kernels round apart from them, within 1 bf16 ulp a step (docs/contract.md), so there each
    row's relative error must stay below 2^-6 (a slot or state mix-up moves a row by its own
    size)."""
    got, want = got.cpu().float(), want.float()
    if exact:
        assert torch.equal(got, want), what
    else:
        error = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)
        assert bool((error <= 2**-6).all()), f"{what}: relative error {float(error.max()):.2e}"


def main(device: str) -> None:
    if device == "cpu":
        backend = make_backend("host")  # gloo: a rank per process (one without torchrun)
    elif "RANK" in os.environ:
        backend = make_backend("nvshmem")  # torchrun: a GPU per rank
    else:
        backend = make_backend("loopback", world=1)  # one GPU
    dev = getattr(backend, "device", torch.device("cpu"))
    rank, tp = backend.ranks[0], backend.world
    heads = HEADS // tp  # this rank's heads: rank * heads ..
    first, cols = rank * heads, slice(rank * heads * 128, (rank + 1) * heads * 128)

    # The whole layer from a seed (an engine loads its rank's shard: engine.load_rank).
    whole = kt.make_layer(HEADS, PAGES, window=TOKENS + 2, seed=0)
    g = torch.Generator().manual_seed(1)
    w_o = (torch.randn(HIDDEN, HEADS * 128, generator=g) * 0.05).bfloat16()
    norm, query, out_norm = ((1 + 0.1 * torch.randn(HIDDEN, generator=g)).bfloat16() for _ in "nqo")

    # --- what an engine keeps per rank: the all-reduces (one per rows bucket), the layer ---
    comms = all_reduces(backend, rows=(REQUESTS, REQUESTS * TOKENS), hidden=HIDDEN, blocks=BLOCKS)
    layer = DecodeLayer(
        kl.shard_layer(whole, first, heads).to(dev),  # the rank's KDA weights, state, conv
        w_o[:, cols].contiguous().to(dev),  # [HID, D_local] bf16: its o-projection columns
        comms,
        rank=rank,
        norm=norm.to(dev),  # [HID] bf16 each: AttnRes and the output RMSNorm
        query=query.to(dev),
        out_norm=out_norm.to(dev),
        kda_state="per-step",  # or "replay" (with ring_size=R)
    )
    unsharded = whole.clone()  # the check: the whole layer, stepped by the references

    table = 1 + torch.arange(REQUESTS * TOKENS, dtype=torch.int32).view(REQUESTS, TOKENS)
    layer.admit(table.flatten().to(dev))  # new requests: their pages and windows zeroed
    unsharded.state[table.flatten().long()] = 0
    unsharded.conv_state[table.flatten().long()] = 0
    accepted = None  # what a verify step reads: the tokens the last step accepted
    for i in range(4):  # a decode step, then verify steps of TOKENS draft tokens
        tokens = 1 if i == 0 else TOKENS
        slot_table = table[:, :tokens]  # request b's pages (a verify step writes one a token)
        seed = dict(accepted=accepted, seed=10 + i)
        step = kt.make_step(REQUESTS, tokens, HEADS, pages=PAGES, slot_table=slot_table, **seed)
        rows = REQUESTS * tokens
        prefix = torch.randn(rows, HIDDEN, generator=g).bfloat16()  # the residual stream
        blocks = torch.randn(rows, BLOCKS, HIDDEN, generator=g).bfloat16()  # AttnRes snapshots
        mine = kl.step_to(kl.shard_step(step, HEADS, first, heads), dev)  # the rank's columns

        # --- the step: KDA -> o-projection -> all-reduce, residual, AttnRes, norm ---------
        residual = prefix.to(dev, copy=True)  # updated in place to the new prefix
        inputs = (mine.x, mine.f_a, mine.beta, mine.gate, mine.slots)  # x: [q | k | v] columns
        output = layer.step(*inputs, residual, blocks.to(dev), parity=i & 1, accepted=mine.accepted)

        # the check: the unsharded layer's attention, split into the ranks' partials
        attn = kt.run_reference(unsharded, step)
        per = attn.shape[1] // tp
        split = [slice(r * per, (r + 1) * per) for r in range(tp)]
        partials = torch.stack(
            [oref.project(attn[:, c].contiguous(), w_o[:, c].contiguous()) for c in split]
        )
        weights = (norm, query, out_norm)
        groups = comms[rows].groups  # the all-reduce's summation order (its plan's)
        want, want_prefix = oref.consume(
            partials, prefix, blocks, *weights, eps=EPS, out_eps=EPS, groups=groups
        )
        check(output, want, f"rank {rank} step {i}: output", exact=device == "cpu")
        check(residual, want_prefix, f"rank {rank} step {i}: prefix", exact=device == "cpu")
        drawn = torch.randint(1, TOKENS + 1, (REQUESTS,), generator=g, dtype=torch.int32)
        accepted = torch.ones_like(drawn) if i == 0 else drawn  # the sampler's verdict
    mine = unsharded.state[:, first : first + heads]
    check(layer.shard.state, mine, f"rank {rank}: state pages", exact=device == "cpu")
    backend.teardown()
    if rank == 0:
        print(f"TP {tp}, {HEADS} heads, hidden {HIDDEN}, {backend.name} backend: 4 steps checked")
        print("OK")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    main(parser.parse_args().device)
