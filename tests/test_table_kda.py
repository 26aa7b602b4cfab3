"""CPU test of ``scripts/table_kda.py``: the tables carry the measured figures, one line per
row, and the dtype table pairs fp32 with bf16 per shape (a shape with one dtype left out)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import table_kda  # noqa: E402


def _row(H, B, T, dtype, us, pct, fla):
    return dict(H=H, B=B, T=T, state_dtype=dtype, kernel="pipe", auto_us=us, state_tbs=2.5,
                pct_copy=pct, fla_us=fla, speedup_fla=fla / us)  # fmt: skip


DATA = dict(
    copy_tbs=4.2,
    rows=[
        _row(12, 128, 1, "fp32", 69.1, 69.4, 68.4),
        _row(12, 128, 1, "bf16", 50.8, 47.1, 46.2),
        _row(96, 128, 1, "fp32", 460.0, 83.0, 560.0),  # no bf16 twin
    ],
)


def test_rows_table_lines():
    lines = table_kda.rows_table(DATA).splitlines()
    assert len(lines) == 2 + 3
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| 12 | 128 | 1 | bf16 | pipe | 50.8 | 2.50 | 47.1 | 46.2 | 0.91 | - |" in lines


def test_dtypes_table_pairs():
    lines = table_kda.dtypes_table(DATA).splitlines()
    assert len(lines) == 3  # header, rule, the one shape with both dtypes
    assert lines[2] == "| 12 | 128 | 1 | 69.1 | 50.8 | 1.36 | 69.4 | 47.1 | 0.91 |"
