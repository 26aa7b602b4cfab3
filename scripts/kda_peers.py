"""fla's KDA decode beside ours, as ``bench_kda.py`` and ``profile_kda.py`` time it: its
recurrence alone (``fused_recurrent_kda_fwd`` on our step's q, k, v, raw gate and beta, the
same state pages) and, at T = 1, the composed step (conv update + SiLU, the gate matmul,
the recurrence, the gated RMSNorm)."""

from __future__ import annotations

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
