"""The decode step's benchmark pieces shared by ``bench_decode.py`` (every rank on one GPU),
``bench_allreduce.py`` and ``bench_step.py`` (one process per GPU): the step's inputs as
the launcher draws them, fla's KDA of a head shard, the residual + AttnRes + RMSNorm
epilogue in plain torch (fp32) and torch symmetric memory for a process group."""

from __future__ import annotations

import torch

from kda import layer as kl
from launch.checks import SEED_GATE_MODES, exact_gate_inputs
from launch.layer import EPS, OUT_EPS, Schedule
from launch.runner import Runner

# The launcher's rule (launch.gpu): gate inputs on the exact grids only for the seed's gate
# orders; the Runner's default gate (mode 3) rounds exactly on any input, and grid inputs
# would skew how often it recomputes.
GRIDS = Runner.__init__.__kwdefaults__["gate_mode"] in SEED_GATE_MODES


def first_step(cfg, model):
    """The first step of ``cfg.tokens``: decode (T = 1), else the first verify step (not
    recorded). Returns (plan, step, prefix, blocks), on the CPU."""
    schedule = Schedule(cfg)
    plan = schedule.next()
    if cfg.tokens > 1:
        plan = schedule.next()
    step, prefix, blocks = model.step_inputs(plan)
    if GRIDS:
        exact_gate_inputs(step)
    return plan, step, prefix, blocks


def fla_options(layer, **kwargs):
    """fla's ``fused_recurrent_kda_fwd`` options for ``layer`` plus ``kwargs``: the gate in
    the kernel with the lower bound, the V-first state pool updated in place, q / k
    L2-normalised and beta's sigmoid in the kernel."""
    flags = ("inplace_final_state", "state_v_first", "use_qk_l2norm_in_kernel")
    flags += ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel")
    return dict(
        A_log=layer.a_log,
        dt_bias=layer.dt_bias,
        initial_state=layer.state,
        scale=kl.SCALE,
        lower_bound=kl.LOWER_BOUND,
        **dict.fromkeys(flags, True),
        **kwargs,
    )


def fla_kda(layer, x, f_a, beta, gate, slots):
    """fla's T = 1 step of ``layer``'s heads (``causal_conv1d_update`` with SiLU, the gate
    projection as a torch matmul, ``fused_recurrent_kda_fwd`` in place on the state pool,
    ``rms_norm_gated`` with a sigmoid gate): a function returning attn [B, H * 128] bf16.
    ``x`` [B, 3 * H * 128] (q | k | v), ``beta`` [B, H], ``gate`` [B, H * 128], all on the
    layer's device. ImportError without fla."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    B, H = beta.shape
    D = H * 128
    weight = layer.conv_weight.permute(0, 2, 1).reshape(3 * D, 4).contiguous()
    cache = torch.randn(B, 3 * D, 4, device=x.device).to(torch.bfloat16)
    o = torch.empty(B, 1, H, 128, device=x.device, dtype=torch.bfloat16)

    def fn():
        y, _ = causal_conv1d_update(
            x, cache, weight=weight, bias=layer.conv_bias, activation="silu"
        )
        qkv = y.view(B, 1, 3, H, 128)
        g = (f_a @ layer.f_b.T).view(B, 1, H, 128)
        q, k, v = qkv.unbind(2)
        fused_recurrent_kda_fwd(
            q, k, v, g, beta.view(B, 1, H), **fla_options(layer, ssm_state_indices=slots, out=o)
        )
        rows = o.view(B * H, 128), gate.view(B * H, 128), layer.norm_weight, None
        attn = rms_norm_gated(*rows, activation="sigmoid", eps=kl.EPS)
        return attn.view(B, D)

    return fn


def attn_res_norm(prefix_new, blocks, w, out_norm, eps=EPS, out_eps=OUT_EPS):
    """AttnRes over ``blocks`` [T, nb, HID] (or None) and ``prefix_new`` [T, HID] with
    ``w = norm * query`` (fp32), then the output RMSNorm: the output, bf16."""
    p = prefix_new.float()
    lp = (p @ w) * torch.rsqrt(p.pow(2).mean(-1) + eps)
    if blocks is None:
        h = p
    else:
        v = blocks.float()
        logits = (v @ w) * torch.rsqrt(v.pow(2).mean(-1) + eps)  # [T, nb]
        prob = torch.softmax(torch.cat([logits, lp[:, None]], dim=-1), dim=-1)
        nb = v.shape[1]
        h = (prob[..., :nb, None] * v).sum(1) + prob[..., nb:] * p
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + out_eps) * out_norm.float()
    return out.to(torch.bfloat16)


def torch_epilogue(attn, prefix, blocks, w, out_norm, eps=EPS, out_eps=OUT_EPS):
    """Residual + AttnRes + RMSNorm in plain torch (fp32): ``attn`` [T, HID] bf16 (the
    reduced sum). Returns (output bf16, prefix_new bf16)."""
    prefix_new = (prefix.float() + attn.float()).to(torch.bfloat16)
    return attn_res_norm(prefix_new, blocks, w, out_norm, eps, out_eps), prefix_new


def symm_mem_for(group, say=lambda text: None):
    """torch symmetric memory for ``group`` (NCCL): ((module, group name), None), or
    (None, why not) where ``one_shot_all_reduce`` is missing."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return None, f"no torch symmetric memory ({e})"
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "one_shot_all_reduce"):
        return None, "torch.ops.symm_mem.one_shot_all_reduce is absent"
    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        try:
            enable(name)
        except Exception as e:  # newer torch: deprecated or not needed
            say(f"note: enable_symm_mem_for_group: {e}")
    return (symm_mem, name), None
