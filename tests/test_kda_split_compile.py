"""CPU compile checks: KdaSplit compiles for sm_90a and sm_100a (no GPU), clusters 2/4/8."""

from __future__ import annotations

import pytest
from compile_harness import ARCHS, compile_for, ptxas_sm90a, require_dsl
from test_kda_compile import fake_args

pytestmark = pytest.mark.compile


def _cases():
    """Every cluster x T in {1, 4, 8} x record on/off (T > 1); the other knobs rotate."""
    cases = []
    for cluster in (2, 4, 8):
        for tokens, record in ((1, False), (4, False), (4, True), (8, False), (8, True)):
            i = len(cases)
            # gate_mode, has_bias, conv_dim_first, pdl
            gate_mode = (0, 1, 3, 3)[i % 4]
            cases.append((cluster, tokens, record, gate_mode, i % 2 == 0, i % 4 < 2, i % 3 == 1))
    return cases


CASES = _cases()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "C{}T{}r{}g{}b{}d{}p{}".format(*c))
def test_split_compiles(arch, case):
    require_dsl()
    from kda.kernels.split import KdaSplit

    cluster, tokens, record, gate_mode, has_bias, dim_first, pdl = case
    kernel = KdaSplit(3, tokens, record, gate_mode, has_bias, cluster, arch=arch, pdl=pdl)
    args = fake_args(3, tokens, record=record, has_bias=has_bias, conv_dim_first=dim_first)
    assert compile_for(arch, kernel, *args) is not None


def test_split_config_errors():
    require_dsl()
    from kda.kernels.split import KdaSplit

    with pytest.raises(ValueError, match="cluster"):
        KdaSplit(2, 1, cluster=16)
    with pytest.raises(ValueError, match="cluster"):
        KdaSplit(2, 1, cluster=1)
    with pytest.raises(ValueError, match="tokens"):
        KdaSplit(2, 9, cluster=2)
    with pytest.raises(ValueError, match="gate_mode"):  # mode 2 was removed
        KdaSplit(2, 1, gate_mode=2, cluster=2)


@pytest.mark.parametrize(
    "which",
    ["split-C2-T8", "split-C8-T4-record", "split-C2-T8-g3", "split-C8-T4-record-g3", "recover-T8"],
    ids=lambda w: w,
)
def test_static_resources(which, tmp_path):
    """The PTX has the cluster exchange (split) and ptxas reports no spills (sm_90a), with
    the seed's gate (mode 0) and the default bounded one (``-g3``)."""
    import re

    require_dsl()
    import cutlass.cute as cute

    from kda.kernels.recover import KdaRecover
    from kda.kernels.split import KdaSplit

    if which.startswith("recover"):
        from test_kda_recover_compile import recover_args

        kernel, args = KdaRecover(6, 8), recover_args(6, 8)
    else:
        cluster, tokens = (2, 8) if which.startswith("split-C2-T8") else (8, 4)
        record = "record" in which
        kernel = KdaSplit(6, tokens, record, 3 if which.endswith("g3") else 0, True, cluster)
        args = fake_args(6, tokens, record=record)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(kernel, *args, options=options).__ptx__
    if which.startswith("split"):
        for needle in ("st.async", "barrier.cluster.arrive", "barrier.cluster.wait", "mapa"):
            assert needle in text, needle
    report = ptxas_sm90a(text, tmp_path / "kernel.ptx")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report
