"""CPU tests: mailbox and twoshot layouts, sentinel words, parity, backend interface."""

import pytest
import torch

from tpcomm import mailbox as mb
from tpcomm.backends import make_backend
from tpcomm.backends.loopback import LoopbackBackend, coresident_capacity
from tpcomm.symm import SymmetricTensor


def test_parity_alternates():
    assert [mb.parity(s) for s in range(5)] == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="step"):
        mb.parity(-1)


def test_mailbox_layout_offsets_cover_buffer_once():
    layout = mb.MailboxLayout(tp=4, tokens=3, hid=2048)
    assert layout.shape == (2, 4, 3, 2048)
    assert layout.nbytes == 2 * 2 * 4 * 3 * 2048
    buffer = torch.arange(layout.numel, dtype=torch.int64)
    seen = set()
    for step in (0, 1):
        for rank in range(4):
            for token in range(3):
                for column in (0, 8, 2047):
                    off = layout.offset(step, rank, token, column)
                    assert buffer.view(layout.shape)[step, rank, token, column] == off
                    seen.add(off)
    assert len(seen) == 2 * 4 * 3 * 3
    assert layout.offset(2, 1, 0, 0) == layout.offset(0, 1, 0, 0)  # parity wraps


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(tp=0, tokens=1, hid=1024), "tp"),
        (dict(tp=17, tokens=1, hid=1024), "tp"),
        (dict(tp=2, tokens=0, hid=1024), "tokens"),
        (dict(tp=2, tokens=1025, hid=1024), r"tokens.* 1\.\.1024"),
        (dict(tp=2, tokens=1, hid=1000), "hid"),
        (dict(tp=2, tokens=1, hid=9216), "hid"),
    ],
)
@pytest.mark.parametrize("build", ["layout", "choose"])
def test_layout_and_plan_reject_bad_sizes(kwargs, name, build):
    from tpcomm.oproj.allreduce import choose

    if build == "choose":  # choose counts the step's rows (requests x tokens)
        kwargs = dict(tp=kwargs["tp"], rows=kwargs["tokens"], hid=kwargs["hid"])
        name = name.replace("tokens", "rows")
    with pytest.raises(ValueError, match=name):
        (mb.MailboxLayout if build == "layout" else choose)(**kwargs)


def test_layouts_sized_per_rows_bucket():
    for rows in (1, 8, 9, 64, 1024):
        one = mb.MailboxLayout(16, rows, 7168)
        assert one.nbytes == 2 * 16 * rows * 7168 * 2
        two = mb.TwoshotLayout(16, rows, 7168)
        recv = 2 * 16 * rows * (7168 // 16) * 2
        assert two.nbytes == recv + 2 * rows * 7168 * 2


def test_layout_rejects_bad_coordinates():
    layout = mb.MailboxLayout(2, 1, 1024)
    cases = (((0, 2, 0, 0), "rank"), ((0, 0, 1, 0), "token"), ((0, 0, 0, 1024), "column"))
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            layout.offset(*args)


def test_twoshot_layout():
    layout = mb.TwoshotLayout(tp=8, tokens=2, hid=7168)
    assert layout.shard == 896
    assert layout.receive_shape == (2, 8, 2, 896)
    assert layout.gather_shape == (2, 2, 7168)
    assert layout.owner(0) == 0 and layout.owner(895) == 0 and layout.owner(896) == 1
    assert layout.owner(7167) == 7
    assert layout.columns(3) == slice(2688, 3584)
    assert mb.TwoshotLayout(tp=16, tokens=1, hid=3072).shard == 192


def test_twoshot_rejects_ragged_shards():
    with pytest.raises(ValueError, match="hid"):
        mb.TwoshotLayout(tp=3, tokens=1, hid=1024)


def test_arm_published_and_canonicalize():
    t = torch.randn(4, 16).to(torch.bfloat16)
    assert mb.published(t).all()
    mb.arm(t[1])
    state = mb.published(t)
    assert state.tolist() == [True, True, False, False, True, True, True, True]
    assert (t[1].view(torch.int32) == -1).all()
    # a data word equal to the sentinel is canonicalised; other NaNs are left alone
    data = torch.zeros(8, dtype=torch.bfloat16)
    words = data.view(torch.int32)
    words[0] = -1
    words[1] = 0xFFFF7FC1 - (1 << 32)  # one 0xFFFF NaN half: not the sentinel word
    clean = mb.canonicalize(data)
    assert clean.view(torch.int32)[0].item() == mb.CANONICAL_NAN_WORD
    assert clean.view(torch.int32)[1].item() == words[1].item()
    assert mb.published(clean).all() and not mb.published(data).any()


def test_words_validation():
    with pytest.raises(ValueError, match="bf16"):
        mb.arm(torch.zeros(8))
    with pytest.raises(ValueError, match="multiple of 8"):
        mb.arm(torch.zeros(6, dtype=torch.bfloat16))


def test_rank_order_sum_is_sequential_fp32():
    torch.manual_seed(0)
    partials = (torch.randn(16, 3, 1024) * 100).to(torch.bfloat16)
    got = mb.rank_order_sum(partials)
    acc = partials[0].float()
    for r in range(1, 16):
        acc = acc + partials[r].float()
    assert torch.equal(got.view(torch.int16), acc.to(torch.bfloat16).view(torch.int16))
    # -0.0 survives a single rank (starts from rank 0's value, not from +0.0)
    neg = torch.full((1, 1, 8), -0.0, dtype=torch.bfloat16)
    assert torch.signbit(mb.rank_order_sum(neg).float()).all()
    with pytest.raises(ValueError, match="partials"):
        mb.rank_order_sum(partials.float())


def test_loopback_backend_views_on_cpu():
    backend = LoopbackBackend(4, device="cpu")
    box = mb.Mailbox(backend, tokens=2, hid=1024)
    assert isinstance(box.buffer, SymmetricTensor)
    for r in range(4):
        local = box.local(r)
        assert local.shape == (2, 4, 2, 1024)
        assert (local.view(torch.int32) == -1).all()
        assert box.peer(r, rank=0).data_ptr() == local.data_ptr()
        ptrs = box.peer_pointers(r)
        assert ptrs.tolist() == [box.local(p).data_ptr() for p in range(4)]
    assert box.multicast() is None
    rows = mb.TwoshotRows(backend, tokens=2, hid=1024)
    assert rows.receive_view(1).shape == (2, 4, 2, 256)
    assert rows.gather_row(3).shape == (2, 2, 1024)
    with pytest.raises(ValueError, match="rank"):
        box.local()
    with pytest.raises(ValueError, match="peer"):
        box.peer(4, rank=0)
    backend.teardown()
    backend.teardown()  # idempotent
    with pytest.raises(RuntimeError, match="torn down"):
        backend.allocate((8,))


def test_backend_factory_and_validation():
    with pytest.raises(ValueError, match="kind"):
        make_backend("nccl")
    with pytest.raises(ValueError, match="world"):
        LoopbackBackend(17, device="cpu")
    backend = make_backend("loopback", world=2, device="cpu")
    with pytest.raises(ValueError, match="shape"):
        backend.allocate((0, 4))
    with pytest.raises(ValueError, match="dtype"):
        backend.allocate((8,), dtype="bf16")
    backend.teardown()


def test_coresident_capacity():
    # H200: 132 SMs, 2048 threads per SM, kernel guarantees 8 CTAs of 128 threads
    assert coresident_capacity(132, 128, 8, 2048) == 1056
    assert coresident_capacity(132, 512, 8, 2048) == 528
    with pytest.raises(ValueError, match="positive"):
        coresident_capacity(132, 0, 8, 2048)
