"""Every public entry point against a list of bad values: a ``ValueError`` naming the
argument (``ImportError`` naming the extra for a missing package), raised before anything
is written: every input tensor is bitwise what it was. CPU only; ``kda.decode`` and
``kda.recover`` refuse before any CUDA call (CUDA is never initialised here)."""

import pytest
import torch

import kda
from kda import reference as R
from kda import synthetic as kt
from tpcomm import mailbox as mb
from tpcomm.oproj import reference as oref

NAN, INF = float("nan"), float("inf")
B, H, T = 3, 2, 3


def bits(t):
    return t.detach().contiguous().view(torch.uint8).clone()


def refused(call, tensors, name, error=ValueError):
    """``call()`` raises ``error`` naming ``name``; no tensor of ``tensors`` changed."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    before = [bits(t) for t in tensors]
    with pytest.raises(error) as info:
        call()
    assert name in str(info.value), f"{name!r} not in: {info.value}"
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(bits(t), b), "a refused call changed an input"


# --- KDA decode: kda.reference.decode and kda.decode ----------------------------------------
def decode_args():
    layer = kt.make_layer(H, 1 + B * T + 2, window=T + 2, seed=1)
    step = kt.make_step(B, T, H, pages=1 + B * T, padding=(2,), seed=2)
    args = dict(
        x=step.x, conv_weight=layer.conv_weight, conv_bias=layer.conv_bias,
        conv_state=layer.conv_state, f_a=step.f_a, beta=step.beta, a_log=layer.a_log,
        dt_bias=layer.dt_bias, slots=step.slots.clone(), state=layer.state, gate=step.gate,
        norm_weight=layer.norm_weight, f_b=layer.f_b,
    )  # fmt: skip
    kw = dict(lower_bound=-5.0, scale=128**-0.5, eps=1e-6, accepted=step.accepted)
    return args, kw


def poison(name, where=0):
    """Put a NaN into ``name`` (row / page ``where``: a live one)."""

    def edit(a, kw):
        t = a[name].clone()
        t.view(-1)[where * (t.numel() // t.shape[0]) if t.dim() > 1 else where] = NAN
        a[name] = t

    return edit


def setslot(b, t, value):
    def edit(a, kw):
        a["slots"][b, t] = value

    return edit


def kw_set(**values):
    return lambda a, kw: kw.update(values)


DECODE_BAD = [
    ("eps", kw_set(eps=-1.0), {}),
    ("eps", kw_set(eps=NAN), {}),
    ("eps", kw_set(eps=INF), {}),
    ("eps", kw_set(eps="1e-6"), {}),
    ("scale", kw_set(scale=NAN), {}),
    ("scale", kw_set(scale=INF), {}),
    ("scale", kw_set(scale=0.0), {}),
    ("scale", kw_set(scale=-0.1), {}),
    ("scale", kw_set(scale=True), {}),
    ("lower_bound", kw_set(lower_bound=5.0), {}),
    ("lower_bound", kw_set(lower_bound=NAN), {}),
    ("lower_bound", kw_set(lower_bound=-INF), {}),
    ("lower_bound", kw_set(lower_bound="x"), {}),
    ("lower_bound", kw_set(lower_bound=None), {}),
    ("conv_dim_first", kw_set(conv_dim_first="yes"), {}),
    ("validate", lambda a, kw: None, {"validate": "on"}),
    # two live requests on one page: the same write target, a read of another's target
    ("slots", setslot(1, 2, 3), {}),
    ("slots", setslot(1, 0, 1), {}),
    ("slots", lambda a, kw: a["slots"][1].copy_(a["slots"][0]), {}),
    ("slots", lambda a, kw: a["slots"].__setitem__((1, slice(None)), 10_000), {}),
    # the checked mode: non-finite values in what the step reads
    ("x", poison("x"), {"validate": "full"}),
    ("f_a", poison("f_a"), {"validate": "full"}),
    ("beta", poison("beta"), {"validate": "full"}),
    ("gate", poison("gate"), {"validate": "full"}),
    ("a_log", poison("a_log"), {"validate": "full"}),
    ("dt_bias", poison("dt_bias"), {"validate": "full"}),
    ("conv_weight", poison("conv_weight"), {"validate": "full"}),
    ("conv_bias", poison("conv_bias"), {"validate": "full"}),
    ("norm_weight", poison("norm_weight"), {"validate": "full"}),
    ("f_b", poison("f_b"), {"validate": "full"}),
    ("state", poison("state", where=1), {"validate": "full"}),
    ("conv_state", poison("conv_state", where=1), {"validate": "full"}),
]
DECODE_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(DECODE_BAD)]


def run_decode(entry, args, kw, extra):
    names = ("x", "conv_weight", "conv_bias", "conv_state", "f_a", "beta", "a_log", "dt_bias",
             "slots", "state", "gate", "norm_weight", "f_b")  # fmt: skip
    return entry(*(args[n] for n in names), **kw, **extra)


@pytest.mark.parametrize("entry", [R.decode, kda.decode], ids=["reference", "kernels"])
@pytest.mark.parametrize("name,edit,extra", DECODE_BAD, ids=DECODE_IDS)
def test_decode_refuses(entry, name, edit, extra):
    args, kw = decode_args()
    edit(args, kw)
    tensors = [*args.values(), kw["accepted"]]
    refused(lambda: run_decode(entry, args, kw, extra), tensors, name)
    assert not torch.cuda.is_initialized()


def test_checked_mode_from_the_environment(monkeypatch):
    args, kw = decode_args()
    poison("beta")(args, kw)
    monkeypatch.setenv("KDA_VALIDATE", "full")
    refused(lambda: run_decode(R.decode, args, kw, {}), list(args.values()), "beta")
    monkeypatch.setenv("KDA_VALIDATE", "fll")
    refused(lambda: run_decode(R.decode, args, kw, {}), list(args.values()), "KDA_VALIDATE")


def test_checked_mode_passes_good_inputs_and_skips_padding():
    """Full and fast give the same bits; a NaN in a padding row is not the step's input."""
    args, kw = decode_args()
    args["x"] = args["x"].clone()
    args["x"][2 * T] = NAN  # request 2 is padding
    fast_state, full_state = args["state"].clone(), args["state"].clone()
    conv_fast, conv_full = args["conv_state"].clone(), args["conv_state"].clone()
    out_fast = run_decode(R.decode, dict(args, state=fast_state, conv_state=conv_fast), kw, {})
    full = dict(args, state=full_state, conv_state=conv_full)
    out_full = run_decode(R.decode, full, kw, {"validate": "full"})
    assert torch.equal(out_fast, out_full) and torch.equal(fast_state, full_state)


def test_kernels_refuse_cpu_tensors_before_cuda():
    args, kw = decode_args()
    refused(lambda: run_decode(kda.decode, args, kw, {}), list(args.values()), "CUDA")
    for extra in ({"kernel": "fast"}, {"gate_mode": True}, {"gate_mode": 2}, {"pdl": 1},
                  {"cluster": 2}):  # fmt: skip
        refused(lambda e=extra: run_decode(kda.decode, args, kw, e), list(args.values()),
                next(iter(extra)))  # fmt: skip
    assert not torch.cuda.is_initialized()


# --- KDA recover --------------------------------------------------------------------------
def recover_args():
    layer = kt.make_layer(H, 1 + B * T + 2, window=T + 2, seed=3)
    step = kt.make_step(B, T, H, pages=1 + B * T, padding=(1,), seed=4)
    v = torch.randn(B, H, T, 128, generator=torch.Generator().manual_seed(5))
    kg = torch.randn(B, H, T, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    accepted = torch.full((B,), T, dtype=torch.int32)
    args = [layer.state, step.slots.clone(), v, kg, layer.a_log, layer.dt_bias, accepted,
            step.accepted]  # fmt: skip
    return args, {"lower_bound": -5.0}


def rpoison(index):
    def edit(a, kw):
        a[index] = a[index].clone()
        a[index].view(-1)[0] = NAN

    return edit


RECOVER_BAD = [
    ("lower_bound", lambda a, kw: kw.update(lower_bound=1.0), {}),
    ("lower_bound", lambda a, kw: kw.update(lower_bound=NAN), {}),
    ("lower_bound", lambda a, kw: kw.update(lower_bound="x"), {}),
    ("slots", lambda a, kw: a[1][2].copy_(a[1][0]), {}),  # request 2 writes request 0's pages
    ("slots", lambda a, kw: a[1].__setitem__((2, 1), int(a[1][0, 0])), {}),
    ("validate", lambda a, kw: None, {"validate": 1}),
    ("v_records", rpoison(2), {"validate": "full"}),
    ("kg_records", rpoison(3), {"validate": "full"}),
    ("a_log", rpoison(4), {"validate": "full"}),
    ("dt_bias", rpoison(5), {"validate": "full"}),
]


@pytest.mark.parametrize("entry", [R.recover, kda.recover], ids=["reference", "kernel"])
@pytest.mark.parametrize(
    "name,edit,extra", RECOVER_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(RECOVER_BAD)]
)
def test_recover_refuses(entry, name, edit, extra):
    args, kw = recover_args()
    edit(args, kw)
    refused(lambda: entry(*args, **kw, **extra), args, name)
    assert not torch.cuda.is_initialized()


# --- o-projection reference ---------------------------------------------------------------
def consume_args(tp=2, n=2, hid=1024, nb=2):
    g = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    args = dict(partials=r(tp, n, hid), prefix=r(n, hid), blocks=r(n, nb, hid), norm=r(hid),
                query=r(hid), out_norm=r(hid))  # fmt: skip
    return args, dict(eps=1e-6, out_eps=1e-6, groups=2)


def meta(name):
    return lambda a, kw: a.update({name: a[name].to("meta")})


def opoison(name):
    def edit(a, kw):
        a[name] = a[name].clone()
        a[name].view(-1)[0] = NAN

    return edit


CONSUME_BAD = [
    ("groups", kw_set(groups=True), {}),
    ("groups", kw_set(groups=0), {}),
    ("groups", kw_set(groups=5), {}),
    ("groups", kw_set(groups=2.0), {}),
    ("eps", kw_set(eps=-1.0), {}),
    ("eps", kw_set(eps=NAN), {}),
    ("out_eps", kw_set(out_eps=INF), {}),
    ("has_delta", kw_set(has_delta="no"), {}),
    ("twoshot", kw_set(twoshot=1), {}),
    ("prefix", meta("prefix"), {}),
    ("blocks", meta("blocks"), {}),
    ("norm", meta("norm"), {}),
    ("out_norm", meta("out_norm"), {}),
    ("validate", lambda a, kw: None, {"validate": "yes"}),
    ("partials", opoison("partials"), {"validate": "full"}),
    ("prefix", opoison("prefix"), {"validate": "full"}),
    ("blocks", opoison("blocks"), {"validate": "full"}),
    ("query", opoison("query"), {"validate": "full"}),
]


@pytest.mark.parametrize(
    "name,edit,extra", CONSUME_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(CONSUME_BAD)]
)
def test_consume_refuses(name, edit, extra):
    args, kw = consume_args()
    edit(args, kw)
    refused(lambda: oref.consume(*args.values(), **kw, **extra), list(args.values()), name)


@pytest.mark.parametrize(
    "name,edit,extra",
    [
        ("w_o", lambda a: a.update(w_o=a["w_o"].to("meta")), {}),
        ("w_o", lambda a: a.update(w_o=a["w_o"].float()), {}),
        ("attn_out", lambda a: a.update(attn_out=a["attn_out"].float()), {}),
        ("attn_out", lambda a: a.update(attn_out=a["attn_out"][0].contiguous()), {}),
        ("attn_out", lambda a: a["attn_out"].view(-1).__setitem__(0, NAN), {"validate": "full"}),
        ("w_o", lambda a: a["w_o"].view(-1).__setitem__(3, INF), {"validate": "full"}),
        ("validate", lambda a: None, {"validate": True}),
    ],
)
def test_project_refuses(name, edit, extra):
    g = torch.Generator().manual_seed(8)
    a = dict(attn_out=torch.randn(2, 256, generator=g).bfloat16(),
             w_o=torch.randn(1024, 256, generator=g).bfloat16())  # fmt: skip
    edit(a)
    refused(lambda: oref.project(a["attn_out"], a["w_o"], **extra), list(a.values()), name)


# --- mailbox layouts ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,call",
    [
        ("tp", lambda: mb.MailboxLayout(0, 1, 1024)),
        ("tp", lambda: mb.MailboxLayout(True, 1, 1024)),
        ("tp", lambda: mb.MailboxLayout(17, 1, 1024)),
        ("tokens", lambda: mb.MailboxLayout(2, mb.MAX_ROWS + 1, 1024)),
        ("tokens", lambda: mb.MailboxLayout(2, 1.0, 1024)),
        ("hid", lambda: mb.MailboxLayout(2, 1, 1000)),
        ("hid", lambda: mb.MailboxLayout(2, 1, 2**20)),
        ("hid", lambda: mb.TwoshotLayout(16, 1, 1024 + 64)),
        ("rank", lambda: mb.MailboxLayout(2, 1, 1024).offset(0, 2, 0, 0)),
        ("token", lambda: mb.MailboxLayout(2, 1, 1024).offset(0, 0, 1, 0)),
        ("column", lambda: mb.MailboxLayout(2, 1, 1024).offset(0, 0, 0, -1)),
        ("step", lambda: mb.parity(-1)),
        ("step", lambda: mb.parity(1.5)),
        ("column", lambda: mb.TwoshotLayout(2, 1, 1024).owner(1024)),
    ],
)
def test_mailbox_layouts_refuse(name, call):
    refused(call, [], name)


# --- backends and the o-projection all-reduce's host-side validation -----------------------
@pytest.mark.parametrize(
    "name,kind,kw",
    [
        ("kind", "nccl", {}),
        ("kind", 3, {}),
        ("world", "loopback", {}),
        ("world", "loopback", {"world": True}),
        ("world", "loopback", {"world": 0}),
        ("world", "loopback", {"world": 2.0, "device": "cpu"}),
        ("device", "loopback", {"world": 2, "device": "tpu"}),
        ("world", "host", {"world": 2}),
    ],
)
def test_make_backend_refuses(name, kind, kw):
    from tpcomm.backends import make_backend

    refused(lambda: make_backend(kind, **kw), [], name)


def test_make_backend_names_the_extra():
    import importlib.util

    from tpcomm.backends import make_backend

    if importlib.util.find_spec("nvshmem") is not None:
        pytest.skip("nvshmem4py is installed")
    refused(lambda: make_backend("nvshmem"), [], "kimi-decode[cu13]", error=ImportError)


@pytest.fixture(scope="module")
def cpu_backend():
    """Two ranks' mailboxes on the CPU (loopback layout): the all-reduce's host-side
    validation runs; a launch is refused (no CUDA)."""
    from tpcomm.backends import make_backend

    backend = make_backend("loopback", world=2, device="cpu")
    yield backend
    backend.teardown()


@pytest.mark.parametrize(
    "name,kw",
    [
        ("groups", {"groups": True}),
        ("groups", {"groups": 9}),
        ("nb", {"nb": True}),
        ("nb", {"nb": 9}),
        ("budget_ns", {"budget_ns": 0}),
        ("eps", {"eps": NAN}),
        ("out_eps", {"out_eps": -1.0}),
        ("tokens", {"tokens": 0}),
        ("hid", {"hid": 1000}),
        ("groups", {"hid": 2816, "groups": 3}),  # 352-thread groups: at most 2
        ("xmoe_reps", {"xmoe_reps": -1}),
    ],
)
def test_oproj_allreduce_constructor_refuses(cpu_backend, name, kw):
    from tpcomm.oproj.allreduce import OprojAllReduce

    args = dict(tokens=2, hid=1024, nb=2)
    args.update(kw)
    refused(lambda: OprojAllReduce(cpu_backend, args.pop("tokens"), args.pop("hid"),
                                   args.pop("nb"), **args), [], name)  # fmt: skip


@pytest.mark.parametrize("hidden", [-1024, 1000, 8448])
def test_all_reduces_names_hidden(cpu_backend, hidden):
    from engine import all_reduces

    refused(lambda: all_reduces(cpu_backend, [2], hidden, 2), [], "hidden")


def test_oproj_allreduce_methods_refuse(cpu_backend):
    from tpcomm.oproj.allreduce import OprojAllReduce

    comm = OprojAllReduce(cpu_backend, 2, 1024, 2, groups=1)
    a, _ = consume_args(tp=2, n=2, hid=1024, nb=2)
    out = torch.zeros(2, 1024, dtype=torch.bfloat16)
    good = [a["prefix"], a["blocks"], a["norm"], a["query"], a["out_norm"], out]
    tensors = [*good, a["partials"]]
    bad_prefix = a["prefix"][:1].contiguous()
    nan_prefix = a["prefix"].clone()
    nan_prefix[0, 0] = NAN
    cases = [
        ("step", lambda: comm.consume(*good, -1)),
        ("step", lambda: comm.consume(*good, True)),
        ("prefix", lambda: comm.consume(bad_prefix, *good[1:], 0)),
        ("blocks", lambda: comm.consume(good[0], a["blocks"][:, :1].contiguous(), *good[2:], 0)),
        ("output", lambda: comm.consume(*good[:5], out.float(), 0)),
        ("prefix", lambda: comm.check(nan_prefix, *good[1:], validate="full")),
        ("validate", lambda: comm.check(*good, validate="all")),
        ("prefix", lambda: comm.consume(nan_prefix, *good[1:], 0, validate="full")),  # the op
        ("validate", lambda: comm.consume(*good, 0, validate="all")),
        ("CUDA", lambda: comm.consume(nan_prefix, *good[1:], 0)),  # fast: no scan
        ("CUDA", lambda: comm.check(*good)),  # the host mailbox cannot launch
        ("partial", lambda: comm.publish(a["partials"][0, :1].contiguous(), 0)),
        ("rank", lambda: comm.publish(a["partials"][0], 0, rank=3)),
        ("attn_out", lambda: comm.produce(torch.zeros(2, 100, dtype=torch.bfloat16),
                                          torch.zeros(1024, 100, dtype=torch.bfloat16), 0)),
    ]  # fmt: skip
    for name, call in cases:
        refused(call, [*tensors, nan_prefix], name)


# --- the launch CLI ---------------------------------------------------------------------------
CLI_BAD = [
    ("--seed", ["--seed", str(2**70)]),
    ("--seed", ["--seed", "-1"]),
    ("--requests", ["--requests", "1000000000"]),
    ("--requests", ["--requests", "0"]),
    ("--check-every", ["--check-every", "-1"]),
    ("--steps", ["--steps", "0"]),
    ("--tokens", ["--tokens", "9"]),
    ("--blocks", ["--blocks", "-1"]),
    ("--groups", ["--groups", "5"]),
    ("--heads", ["--heads", "x"]),
    ("--hidden", ["--hidden", "100"]),
    ("--hidden", ["--hidden", "1000"]),  # not a multiple of 256
    ("--padding", ["--padding", "nan"]),
    ("--padding", ["--padding", "1.5"]),
    ("--timeout", ["--timeout", "0"]),
    ("--timeout", ["--timeout", "inf"]),
    ("--tp", ["--tp", "0"]),
    ("--json", ["--json", "/nonexistent-dir/report.json"]),
    ("--json", ["--json", "/"]),
]


@pytest.mark.parametrize("name,argv", CLI_BAD, ids=[" ".join(a) for _, a in CLI_BAD])
def test_cli_refuses_in_one_line(name, argv, capsys, monkeypatch):
    from launch.decode import parse_args

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        parse_args(["--backend", "host", *argv])
    assert info.value.code == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("DECODE FAILED") and name in lines[0], lines


@pytest.mark.parametrize(
    "needle,argv,world",
    [
        ("heads (6) must be a positive multiple of TP (4)", ["--heads", "6"], 4),
        ("rows per step", ["--requests", "4096", "--tokens", "8"], 1),
        ("GiB of host memory", ["--heads", "4096", "--requests", "4096", "--tokens", "1"], 1),
        ("--tp 3", ["--tp", "3"], 2),
    ],
)
def test_host_job_refusals(needle, argv, world):
    from launch.decode import parse_args
    from launch.host import refusal

    args = parse_args(["--backend", "host", *argv])
    args.tokens = 3 if args.tokens is None else args.tokens
    args.groups = 4
    why = refusal(args, world)
    assert why is not None and needle in why, why
    assert "\n" not in why


def test_checked_recover_skips_records_past_accepted():
    """Records of tokens a request does not commit are not recover's input."""
    args, kw = recover_args()
    args[6] = args[6].clone()
    args[6][0] = 1
    args[2] = args[2].clone()
    args[2][0, :, 2] = NAN
    fast, full = args[0].clone(), args[0].clone()
    R.recover(fast, *args[1:], **kw)
    R.recover(full, *args[1:], **kw, validate="full")
    assert torch.equal(fast, full)


# --- the checked mode through the torch ops -----------------------------------------------
DECODE_NAMES = ("x", "conv_weight", "conv_bias", "conv_state", "f_a", "beta", "a_log",
                "dt_bias", "slots", "state", "gate", "norm_weight", "f_b")  # fmt: skip


def decode_op(args, kw, validate):
    """``kimi::kda_decode`` called directly (no entry point), ``validate`` last."""
    out = torch.empty(B * T, H * 128, dtype=torch.bfloat16)
    return torch.ops.kimi.kda_decode(
        *(args[n] for n in DECODE_NAMES), out, kw["accepted"], None, None, kw["lower_bound"],
        kw["scale"], kw["eps"], True, "auto", None, 0, False, validate,
    )  # fmt: skip


def test_ops_take_the_checked_mode():
    """The ops' schemas carry ``validate``: their implementations refuse a NaN before the
    device check in the checked mode, and go straight to it in the fast one; the fake
    implementations check the mode's name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kw = decode_args()
    poison("beta")(args, kw)
    tensors = list(args.values())
    refused(lambda: decode_op(args, kw, "full"), tensors, "beta")
    refused(lambda: decode_op(args, kw, None), tensors, "CUDA")
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match="validate"):
        decode_op(args, kw, "on")
    rargs, rkw = recover_args()
    rpoison(2)(rargs, rkw)
    call = lambda v: torch.ops.kimi.kda_recover(*rargs, rkw["lower_bound"], False, v)  # noqa: E731
    refused(lambda: call("full"), rargs, "v_records")
    refused(lambda: call(None), rargs, "CUDA")
    assert not torch.cuda.is_initialized()
