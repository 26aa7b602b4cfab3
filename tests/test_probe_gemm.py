"""CPU: scripts/probe_gemm.py's tile parsing and the producer's floor (bytes or FLOPs)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import probe_gemm  # noqa: E402


def test_tiles_parse_and_refuse():
    assert probe_gemm.parse_tiles(["64x64", "128x256"]) == [(64, 64), (128, 256)]
    with pytest.raises(ValueError, match="--tiles"):
        probe_gemm.parse_tiles(["64-64"])


def test_floor_is_bytes_or_flops():
    tp, rows, hid, d = 8, 9, 7168, 1536
    w, a = hid * d * 2, rows * d * 2
    one_shot = probe_gemm.floor_us(tp, rows, hid, d, False, 4.0, float("inf"))
    assert one_shot == pytest.approx((w + a + tp * rows * hid * 2) / 4e6)
    two_shot = probe_gemm.floor_us(tp, rows, hid, d, True, 4.0, float("inf"))
    assert two_shot == pytest.approx((w + a + rows * hid * 2) / 4e6)
    flops = 2.0 * 1024 * hid * d / (800 * 1e6)  # 1024 rows at 800 TFLOP/s
    assert probe_gemm.floor_us(tp, 1024, hid, d, True, 1e9, 800.0) == pytest.approx(flops)
