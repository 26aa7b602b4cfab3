"""CPU compile tests: the deep o-projection producer (``OprojProducerDeep``) for sm_90a and
sm_100a, tokens dynamic, with ptxas's register / spill report (``-s`` prints it)."""

import functools
import shutil
import subprocess
import tempfile

import pytest
from compile_harness import ARCHS, require_dsl

pytestmark = pytest.mark.compile

CONFIGS = {  # name: tp, hid, d_local, keyword configuration
    "tp16": (16, 7168, 768, dict(pdl=True)),
    "tp16-multicast": (16, 7168, 768, dict(multicast=True, fence=True)),
    "tp8": (8, 7168, 1536, dict(pdl=True)),
    "tp8-twoshot": (8, 7168, 1536, dict(twoshot=True, fence=True)),
    "tp2-ring": (2, 7168, 6144, dict(pdl=True)),
    "tp16-twoshot": (16, 2048, 768, dict(twoshot=True)),
}


@functools.cache
def _compiled(name, arch):
    """(compiled object, PTX text, kernel) of one configuration, compiled once."""
    cute = require_dsl()
    from tpcomm.oproj.producer import fake_producer_arguments, producer_class

    tp, hid, d_local, kw = CONFIGS[name]
    kernel = producer_class("deep")(tp, hid, d_local, **kw)
    options = f"--gpu-arch {arch} --keep-ptx --dump-dir {tempfile.mkdtemp(prefix='deep-ptx-')}"
    f = cute.compile(kernel, *fake_producer_arguments(tp, hid, d_local), options=options)
    return f, f.__ptx__, kernel


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_deep_compiles(arch, name):
    f, _, kernel = _compiled(name, arch)
    # the shared memory the launch asks for is the plan's (its residency figure)
    assert f"llvm.mlir.constant({kernel.plan.smem_bytes} : i64)" in str(f.ir_module)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_deep_fits_its_launch_bound(tmp_path, arch, name):
    """ptxas stays under the launch bound's register cap (4 CTAs of 128 threads per SM)
    without spilling."""
    from tpcomm.oproj.producer import DEEP_CTAS_PER_SM, WARPS

    _, text, kernel = _compiled(name, arch)
    path = tmp_path / "deep.ptx"
    path.write_text(text)
    command = [shutil.which("ptxas"), f"-arch={arch}", "-v", str(path), "-o", "/dev/null"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    registers = int(out.split("Used ")[1].split(" registers")[0])
    spills = out.split("bytes stack frame, ")[1].split(" bytes spill loads")[0]
    print(f"\ndeep {name} {arch} {kernel.plan}: {registers} registers, {spills} bytes spill loads")
    assert registers <= 65536 // (WARPS * 32 * DEEP_CTAS_PER_SM), out
    assert "0 bytes spill stores" in out and "0 bytes spill loads" in out, out


def _lines(text, needle):
    return [i for i, x in enumerate(text.splitlines()) if needle in x]


def test_deep_ptx_order():
    """Weights requested (bulk copies armed on an mbarrier) before the PDL wait; attn_out
    read only after it; the weights read from shared memory only after the mbarrier wait;
    the same mma, rounding and scoped publish as the tiled producer; launch bound 4."""
    _, text, _ = _compiled("tp16", "sm_90a")
    copies = _lines(text, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes")
    (wait,) = _lines(text, "griddepcontrol.wait")
    assert len(copies) == 16 and max(copies) < wait  # one per w_o row of the tile
    assert _lines(text, "mbarrier.arrive.expect_tx")[0] < min(copies)
    assert _lines(text, "griddepcontrol.launch_dependents")[0] < wait
    assert min(_lines(text, "ld.global.v4.b32")) > wait  # attn_out
    first_poll = min(_lines(text, "mbarrier.try_wait.parity"))
    assert min(_lines(text, "ld.shared.v4.b32")) > first_poll
    assert len(_lines(text, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")) == 2 * 6
    for needle in ("cvt.rn.bf16x2.f32", "st.relaxed.sys.global.v4.b32", ".reqntid 128",
                   ".minnctapersm 4"):  # fmt: skip
        assert needle in text, needle
    assert "ld.global.nc" not in text and "fence.proxy.async" not in text


def test_deep_ring_refills_after_a_proxy_fence():
    """D 6144: 8 slabs through 2 stages; each refill after a CTA barrier and an async-proxy
    fence (the generic reads of the stage before the bulk copy overwrites it)."""
    _, text, _ = _compiled("tp2-ring", "sm_90a")
    fences = _lines(text, "fence.proxy.async.shared::cta")
    assert len(fences) == 8 - 2
    assert len(_lines(text, "mbarrier.try_wait.parity")) == 8
    assert len(_lines(text, "cp.async.bulk.shared::cluster")) == 16 * 8
    assert len(_lines(text, "mma.sync.aligned")) == 2 * 6144 // 128
