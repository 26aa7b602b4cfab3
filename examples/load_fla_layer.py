"""fla's KimiDeltaAttention prefills a prompt; the runtime decodes on from its state at TP 2.

fla's layer (flash-linear-attention 0.6.0; random weights under its key names, 4 heads of
128, hidden 1024, the lower-bound gate) prefills a 64-token prompt and decodes 16 tokens.
Two TP ranks load their heads of the same layer (``engine.load_rank``), take fla's prefill
state and conv windows (``admit_prefill``) and decode the same 16 tokens from the engine's
projections (``step_inputs``; here fla's own, recorded). Their outputs before and after
``o_proj`` must lie within the bounds derived from both paths' rounding points, and the
greedy argmax of a random 4096-word head must agree with fla's on every token
(``tests/_harness_fla.py``, which the loader's tests use too).

On a CPU fla's layer does not run (its kernels are Triton's): fla's naive functions
(``naive_chunk_kda`` for the prompt, ``naive_recurrent_kda`` per token, no triton needed)
stand for it, and the ranks load from its ``state_dict``.

    python examples/load_fla_layer.py                  # CPU: both ranks in this process
    python examples/load_fla_layer.py --device cuda    # fla's layer and both ranks on one GPU
"""

import argparse
import os
import sys
from pathlib import Path

import torch

from engine import admit_prefill, all_reduces, load_rank, step_inputs
from tpcomm.backends import make_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import _harness_fla as fh  # noqa: E402  fla's side: its layer or naive functions, the bounds

TP, HEADS, HIDDEN = 2, 4, 1024


def main(device: str) -> None:
    sd, hs = fh.state_dict(seed=0, hidden=HIDDEN, heads=HEADS), fh.hidden_states(hidden=HIDDEN)
    if device == "cuda":
        os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's Triton kernels
        source, trace = fh.gpu_fla(sd, hs)  # the module: the ranks load from it
        trace = trace.cpu()
    else:
        trace = fh.cpu_fla(sd, hs)
        source = sd  # a state_dict needs the gate's lower bound and the norm's eps
    scalars = {} if device == "cuda" else dict(lower_bound=fh.LOWER_BOUND, eps=fh.NORM_EPS)

    backend = make_backend("loopback", world=TP, device=device)  # both ranks in this process
    dev = backend.device
    comms = all_reduces(backend, rows=(1,), hidden=HIDDEN, blocks=0)
    ones = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)  # AttnRes / norm: identity
    layers = []
    for r in range(TP):
        w = load_rank(source, rank=r, tp=TP, pages=2, window=4, device=dev, **scalars)
        prefill = (trace.recurrent_state, trace.windows)  # fla's state and conv windows
        admit_prefill(w.shard, 1, *prefill, rank=r, tp=TP, state_v_first=trace.v_first)
        layers.append(w.decode_layer(comms, norm=ones, query=ones, out_norm=ones))

    slots = torch.ones(1, dtype=torch.int32, device=dev)  # the request's page
    ys, zs = [], []
    for t in range(fh.DECODE):
        names = ("q", "k", "v", "f_a", "beta", "gate")  # the engine's GEMMs of token t
        rows = [getattr(trace, n)[t : t + 1].to(dev) for n in names]
        prefixes = [torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=dev) for _ in range(TP)]
        attns = []
        for r, layer in enumerate(layers):  # every rank's KDA and producer, then consumers
            attns.append(layer.attend(*step_inputs(*rows, rank=r, tp=TP), slots))
            layer.produce(attns[-1], t & 1)
        for layer, prefix in zip(layers, prefixes, strict=True):
            layer.consume(prefix, None, torch.empty_like(prefix), t & 1)
        assert torch.equal(prefixes[0], prefixes[1]), f"token {t}: the ranks disagree"
        ys.append(torch.cat(attns, dim=1).cpu())  # the layer output before o_proj
        zs.append(prefixes[0].cpu())  # a zero residual: the prefix is o_proj's output
    backend.teardown()

    weights = source.state_dict() if device == "cuda" else sd
    report = fh.compare(trace, weights, torch.cat(ys), torch.cat(zs), TP)
    assert report["y"] <= 1 and report["z"] <= 1, report  # error / bound, worst element
    assert report["argmax_equal"], report
    worst = f"y {report['y']:.3f}, z {report['z']:.3f}"
    print(f"TP {TP}: {fh.DECODE} tokens after a {fh.PROMPT}-token prefill within the bounds")
    print(f"worst error / bound {worst}; the argmax equal on every token")
    print("OK")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    main(parser.parse_args().device)
