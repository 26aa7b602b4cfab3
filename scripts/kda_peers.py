"""The peers of our KDA decode, as ``bench_kda.py`` and ``profile_kda.py`` time them.

- fla: its recurrence alone (``fused_recurrent_kda_fwd`` on our step's q, k, v, raw gate
  and beta, the same state pages) and, at T = 1, the composed step (conv update + SiLU, the
  gate matmul, the recurrence, the gated RMSNorm).
- SGLang 0.5.23's fused K3 decode (``sglang/kernels/jit/csrc/attention/kda_fused_decode.cuh``:
  conv update + delta rule + sigmoid-gated RMSNorm in one kernel; H 3 / 6 / 12, T = 1, fp32
  pages, PDL, fast math). Never vendored: ``../shared/device/prepare_peer.sh`` builds
  ``.peer/peer.tar.xz`` (the ``.cuh``, its headers, a trimmed ``apache-tvm-ffi`` and the kernel
  prebuilt for sm_90a with the flags SGLang's JIT uses). On the GPU machine, carry
  ``[".dev", ".peer"]`` and unpack it: ``mkdir -p /tmp/peer && tar -xJf .peer/peer.tar.xz -C
  /tmp/peer``; ``sglang_module("/tmp/peer")`` loads it. It takes the forget gate projected
  to full rank (``a = bf16(f_a @ f_b^T)``, the engine's GEMM output), its conv weights, bias
  and norm weight in fp32 and a window-first bf16 conv pool of exactly 3 taps.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from kda import layer as kl


def fla_recurrence(layer, steps, H, B, T):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from step_peers import fla_options

    prepared = []
    for s in steps:
        qkv = s.x.view(B * T, 3, H, 128)
        q, k, v = (qkv[:, i].contiguous().view(1, B * T, H, 128) for i in range(3))
        g = (s.f_a @ layer.f_b.T).view(1, B * T, H, 128)
        beta = s.beta.view(1, B * T, H).contiguous()
        extra = {}
        if T > 1:
            extra = dict(
                cu_seqlens=torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.long),
                ssm_state_indices=s.slots,
                num_accepted_tokens=s.accepted,
            )
        else:
            extra = dict(ssm_state_indices=s.slots)
            q, k, v = (t.view(B, 1, H, 128) for t in (q, k, v))
            g, beta = g.view(B, 1, H, 128), beta.view(B, 1, H)
        out = torch.empty_like(v)
        prepared.append((q, k, v, g, beta, out, extra))

    def fn():
        for q, k, v, g, beta, out, extra in prepared:
            fused_recurrent_kda_fwd(q, k, v, g, beta, **fla_options(layer, out=out), **extra)

    return fn


def fla_composed(layer, steps, H, B):
    """T = 1: conv update + SiLU, gate matmul, recurrence, gated RMSNorm (sigmoid)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from step_peers import fla_options

    D = H * 128
    weight = layer.conv_weight.permute(0, 2, 1).reshape(3 * D, 4).contiguous()  # [3D, 4]
    caches = [torch.randn(B, 3 * D, 4, device="cuda").to(torch.bfloat16) for _ in steps]
    outs = [torch.empty(B, 1, H, 128, device="cuda", dtype=torch.bfloat16) for _ in steps]
    activation = "sigmoid"

    def fn():
        for s, cache, out in zip(steps, caches, outs, strict=True):
            y, _ = causal_conv1d_update(
                s.x, cache, weight=weight, bias=layer.conv_bias, activation="silu"
            )
            qkv = y.view(B, 1, 3, H, 128)
            g = (s.f_a @ layer.f_b.T).view(B, 1, H, 128)
            q, k, v = qkv.unbind(2)
            options = fla_options(layer, ssm_state_indices=s.slots, out=out)
            fused_recurrent_kda_fwd(q, k, v, g, s.beta.view(B, 1, H), **options)
            o, gate = out.view(B * H, 128), s.gate.view(B * H, 128)
            rms_norm_gated(o, gate, layer.norm_weight, None, activation=activation, eps=kl.EPS)

    return fn


SGLANG_HEADS = (3, 6, 12)


@functools.cache
def sglang_module(peer_dir="/tmp/peer"):
    """SGLang's fused decode as a tvm-ffi module (``prepare_peer.sh``'s ``kda_peer.so``),
    loaded once; ImportError / FileNotFoundError where it is not unpacked."""
    path = os.path.join(peer_dir, "kda_peer.so")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: unpack .peer/peer.tar.xz into {peer_dir} first")
    if peer_dir not in sys.path:
        sys.path.insert(0, peer_dir)
    import tvm_ffi

    return tvm_ffi.load_module(path)


def sglang_operands(layer, step, state, conv):
    """SGLang's ``run`` arguments for ``step`` (T = 1) on ``layer``'s weights, over the pools
    ``state`` [S, H, 128, 128] fp32 and ``conv`` [S, 3, 3D] bf16 (window-first, 3 taps)."""
    B, D = step.gate.shape
    H = D // 128
    if H not in SGLANG_HEADS or step.slots.dim() != 1:
        raise ValueError(f"SGLang's kernel takes H in {SGLANG_HEADS} at T = 1; got H {H}")
    if conv.dim() != 3 or conv.shape[1] != 3 or state.dtype != torch.float32:
        raise ValueError("SGLang's kernel takes a [S, 3, 3D] conv pool and fp32 pages")
    weight = layer.conv_weight.float()
    bias = layer.conv_bias
    bias = torch.zeros(3 * D, device=weight.device) if bias is None else bias.float()
    a = (step.f_a.float() @ layer.f_b.float().T).to(torch.bfloat16)  # bf16(f_a . f_b)
    taps = [weight[p].contiguous() for p in range(3)]  # [4, D] each: 3 cached taps + current
    out = torch.empty(B, D, dtype=torch.bfloat16, device=weight.device)
    norm = layer.norm_weight.float().contiguous()
    a_log, dt_bias = layer.a_log.float().contiguous(), layer.dt_bias.float().contiguous()
    beta = step.beta.to(torch.bfloat16)
    inputs = (step.x, a, beta, conv, *taps, bias.contiguous(), a_log, dt_bias, step.gate)
    return (*inputs, norm, state, step.slots, out)  # run's order; ``out`` last


def sglang_fused(module, layer, steps, state, conv):
    """One SGLang launch per step of ``steps`` on the pools ``state`` / ``conv`` (its own copies
    of ours: same pages, same slot tables), on the current torch stream."""
    import tvm_ffi

    prepared = [sglang_operands(layer, s, state, conv) for s in steps]
    scalars = (kl.SCALE, kl.EPS, kl.LOWER_BOUND, True)

    def fn():
        with tvm_ffi.use_torch_stream():
            for args in prepared:
                module.run(*args, *scalars)

    return fn


def sglang_numerics(module, layer, step):
    """SGLang's one step against ``kda.reference.decode`` on the same inputs (fresh copies
    of the pools): its pages' max |diff| over the page max, and its outputs in bf16 ulps of
    the reference (max, and the share above 1 ulp)."""
    import tvm_ffi

    from kda import synthetic as kt

    ref_layer = layer.clone()
    ref = kt.run_reference(ref_layer, step).float()
    state = layer.state.float().clone()
    conv = window_first(layer.conv_state, layer.conv_dim_first).clone()
    args = sglang_operands(layer, step, state, conv)
    with tvm_ffi.use_torch_stream():
        module.run(*args, kl.SCALE, kl.EPS, kl.LOWER_BOUND, True)
    torch.cuda.synchronize()
    got = args[-1].float()
    live = step.slots[step.slots > 0].long()
    pages = state[live] - ref_layer.state.float()[live]
    scale = ref_layer.state.float()[live].abs().amax(dim=(-1, -2), keepdim=True)
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126))) - 7)
    ulps = (got - ref).abs() / ulp
    return dict(
        page_diff=(pages.abs() / scale).max().item(),
        out_max_ulps=ulps.max().item(),
        out_over_1ulp=(ulps > 1).float().mean().item(),
    )


def window_first(conv_state, dim_first):
    """The conv pool as [S, W, 3D] (a copy when ``dim_first``)."""
    return conv_state.transpose(1, 2).contiguous() if dim_first else conv_state
