"""GPU test: fla's own ``KimiDeltaAttention`` (flash-linear-attention 0.6.0, its Triton
kernels) as the oracle of ``engine.load`` + ``DecodeLayer`` at TP 1, 2 and 4 (loopback:
every rank on this GPU), and of a Kimi-Linear-shaped layer (fla's softplus gate,
``lower_bound=None``; 32 heads, ``fh.KIMI_LINEAR_HIDDEN``; loaded from its state_dict under
Kimi-Linear's names) at TP 1, 2, 4 and 8.

fla's layer (hidden 2048, 16 heads, lower-bound gate -5, conv biases; random weights under
its key names, ``tests/_harness_fla.py``) prefills a 64-token prompt in chunk mode (fla
picks chunk mode for 64 tokens only with autograd on) and decodes 16 tokens on its recurrent
path with its cache; forward hooks record, per decode token, the projections the engine
computes too (q, k, v, f_a, beta, gate), fla's recurrence inputs (its conv outputs and
``f_proj(h)``) and its outputs before and after ``o_proj``. Each TP's ranks load from the
module, take fla's prefill state (fla's layer keeps it V-first, [value row, key], as the
runtime) and conv windows (``admit_prefill``), and decode the same 16 tokens from the
recorded projections. ``_harness_fla.compare``: fla's recurrence inputs one bf16 rounding
apart from ours, the outputs within ``y_bound`` / ``z_bound`` (derived from both paths'
rounding points), the greedy argmax of a random 4096-word head equal on every token
whose margin decides it (``fh.TIE_SIGMAS``: near-ties counted, at most a quarter).

fla's GEMMs run with cuBLAS's reduced-precision (bf16) split-K reduction off, so that its
``f_proj`` and ``o_proj`` round once, as the bounds assume (the runtime's cuBLAS producer
turns it off the same way).
"""

from __future__ import annotations

import functools
import os

import _harness_fla as fh
import pytest
import torch
from shared_gpu import poll_budget_ns

from engine import KIMI_LINEAR_NAMES, admit_prefill, all_reduces, load_rank, step_inputs

pytestmark = pytest.mark.gpu
BUDGET_NS = poll_budget_ns(
    20_000_000
)  # a consumer that never hears from a peer errors instead of hanging


def _fla_layer_class():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for package in ("triton", "einops"):
        pytest.importorskip(package)
    if fh.fla_dir() is None:
        pytest.skip("fla-core / flash-linear-attention 0.6.0 are not installed")
    # fla's Triton kernels, the rounding points the bounds name (no optional backend)
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    try:
        return fh.kda_layer_class()
    except ImportError as e:
        pytest.skip(f"fla's KimiDeltaAttention does not import here: {e}")


@functools.cache
def _fla_run(heads=fh.HEADS, hidden=fh.HIDDEN, lower_bound=fh.LOWER_BOUND):
    """fla's layer on this GPU from the harness's weights (``lower_bound`` None: the
    softplus gate), and its ``Trace``."""
    _fla_layer_class()
    weights = fh.state_dict(heads=heads, hidden=hidden, softplus=lower_bound is None)
    return fh.gpu_fla(weights, fh.hidden_states(hidden=hidden), lower_bound=lower_bound)


def runtime_decode(module, trace: fh.Trace, tp: int, kimi_linear=False):
    """The trace's decode tokens through ``DecodeLayer`` ranks loaded from ``module`` on a
    loopback backend of ``tp`` ranks, one stream (TP 1: ``step``; else every rank's KDA and
    producer, then every consumer; a zero prefix, so the prefix left is the o-projection).
    ``kimi_linear``: loaded from the module's state_dict under Kimi-Linear's names (the
    softplus gate named by ``gate_form``). Outputs poisoned before each step; every rank's
    prefix bitwise equal. Returns (y [N, D], z [N, HID])."""
    from tpcomm.backends import make_backend

    hidden, heads = module.o_proj.weight.shape[0], module.A_log.numel()
    source, kw = module, {}
    if kimi_linear:
        prefix = "model.layers.0.self_attn."
        source = fh.kimi_linear_names(module.state_dict(), prefix)
        kw = dict(names=KIMI_LINEAR_NAMES, prefix=prefix, gate_form="softplus", eps=fh.NORM_EPS)
    backend = make_backend("loopback", world=tp)
    try:
        dev = backend.device
        comms = all_reduces(backend, [1], hidden, 0, eps=1e-6, out_eps=1e-6, budget_ns=BUDGET_NS)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        ones = torch.ones(hidden, dtype=torch.bfloat16, device=dev)
        layers = []
        for r in range(tp):
            rank = load_rank(source, rank=r, tp=tp, pages=2, window=4, device=dev, **kw)
            admit_prefill(rank.shard, 1, trace.recurrent_state, trace.windows, rank=r, tp=tp)
            layers.append(
                rank.decode_layer(
                    comms, norm=ones, query=ones, out_norm=ones, sms=max(1, sms // tp)
                )
            )
        bf = dict(dtype=torch.bfloat16, device=dev)
        per = heads // tp * 128
        attns = [torch.empty(1, per, **bf) for _ in range(tp)]
        prefixes = [torch.empty(1, hidden, **bf) for _ in range(tp)]
        outputs = [torch.empty(1, hidden, **bf) for _ in range(tp)]
        slots = torch.ones(1, dtype=torch.int32, device=dev)
        ys, zs = [], []
        for t in range(trace.q.shape[0]):
            names = ("q", "k", "v", "f_a", "beta", "gate")
            rows = [getattr(trace, n)[t : t + 1].to(dev) for n in names]
            for r in range(tp):
                attns[r].fill_(float("nan"))
                prefixes[r].zero_()
                outputs[r].fill_(float("nan"))
            inputs = [step_inputs(*rows, rank=r, tp=tp) for r in range(tp)]
            if tp == 1:  # the step an engine calls
                layers[0].step(
                    *inputs[0], slots, prefixes[0], None, t & 1, output=outputs[0], attn=attns[0]
                )
            else:  # its parts, every rank's KDA and producer before any consumer
                for r, L in enumerate(layers):
                    L.attend(*inputs[r], slots, out=attns[r])
                    L.produce(attns[r], t & 1)
                for r, L in enumerate(layers):
                    L.consume(prefixes[r], None, outputs[r], t & 1)
            torch.cuda.synchronize()
            assert int(comms[1].errors.abs().sum()) == 0, f"token {t}: a rank went unheard"
            for r in range(1, tp):
                assert torch.equal(prefixes[r].view(torch.int16), prefixes[0].view(torch.int16))
            ys.append(torch.cat(attns, dim=1).cpu())
            zs.append(prefixes[0].cpu())
        return torch.cat(ys), torch.cat(zs)
    finally:
        torch.cuda.synchronize()
        backend.teardown()


@pytest.mark.xdist_group("fla")  # one worker: fla's Triton compiles and autotuning reused
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_decode_matches_fla_layer(tp):
    """fla's layer prefills 64 tokens and decodes 16; ``DecodeLayer`` ranks loaded from it
    at TP ``tp`` decode the same 16 from fla's prefill state and conv windows: fla's
    recurrence inputs one rounding apart from ours, the layer outputs before and after
    ``o_proj`` within the derived bounds, the greedy argmax of a 4096-word head equal."""
    layer, trace = _fla_run()
    y, z = runtime_decode(layer, trace, tp)
    report = fh.compare(trace.cpu(), layer.state_dict(), y, z, tp)
    print(f"TP {tp}: {report}")
    assert not torch.isnan(y).any() and not torch.isnan(z).any()
    assert report["inputs"] <= 1, report
    assert report["y"] <= 1 and report["z"] <= 1, report
    assert report["argmax_equal"] and report["ties"] <= fh.DECODE // 4, report


@pytest.mark.parametrize("hidden", [fh.KIMI_LINEAR_HIDDEN])  # 2304 where the o-proj takes it
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kimi_linear_layer_matches_fla_layer(tp, hidden):
    """A Kimi-Linear-shaped fla layer (softplus gate, 32 heads, random weights, fla's
    initial dt_bias) prefills and decodes; ``DecodeLayer`` ranks loaded from its state_dict
    under Kimi-Linear's names decode the same tokens at TP ``tp``: the checks of
    ``test_decode_matches_fla_layer`` (the bound allows fla's approximate softplus)."""
    layer, trace = _fla_run(fh.KIMI_LINEAR_HEADS, hidden, None)
    y, z = runtime_decode(layer, trace, tp, kimi_linear=True)
    report = fh.compare(trace.cpu(), layer.state_dict(), y, z, tp, lower_bound=None, triton=True)
    print(f"Kimi-Linear TP {tp}, hidden {hidden}: {report}")
    assert report["heads"] == 32 and z.shape[1] == hidden
    assert not torch.isnan(y).any() and not torch.isnan(z).any()
    assert report["inputs"] <= 1, report
    assert report["y"] <= 1 and report["z"] <= 1, report
    assert report["argmax_equal"] and report["ties"] <= fh.DECODE // 4, report
