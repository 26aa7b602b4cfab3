"""CPU test of ``scripts/ncu_phases.py``: SASS rows of ncu's source CSV assigned to the
phase method they follow in address order, samples and instructions summed per phase."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import ncu_phases  # noqa: E402

SOURCE = """class K:
    def read_inputs(self):
        x = 1
        return x

    def fold_page(self):
        y = 2
        return y
"""


def _csv(header_stalls=("stall_long_sb", "stall_barrier")):
    cols = ["Line No", "Source", "Address", "Source", ncu_phases.SAMPLES, ncu_phases.EXECUTED]
    cols += list(header_stalls)
    rows = [
        '"File Path","/repo/kda/kernels/device.py"',
        ",".join(f'"{c}"' for c in cols),
        '"3","h()","-","-","0","0","0","0"',
        '"","","0x30","  FFMA","5","64","5","0"',  # a helper: inherits the phase before it
        '"File Path","/repo/kda/kernels/replay.py"',
        ",".join(f'"{c}"' for c in cols),
        '"3","x = 1","-","-","0","0","0","0"',
        '"","","0x10","  LDG","10","32","8","0"',
        '"","","0x20","  IMAD","2","32","0","1"',
        '"7","y = 2","-","-","0","0","0","0"',
        '"","","0x40","  FMUL","20","96","18","2"',
    ]
    return [r + "\n" for r in rows]


def test_phases_follow_address_order():
    rows = list(ncu_phases.sass_rows(_csv()))
    assert [r[0] for r in rows] == [0x30, 0x10, 0x20, 0x40]
    table = ncu_phases.phases(rows, read=lambda path: SOURCE)
    # 0x10, 0x20 read_inputs; 0x30 (device.py) inherits "inputs"; 0x40 fold_page
    assert table["inputs"][:2] == [17, 128]
    assert table["fold"][:2] == [20, 96]
    result = ncu_phases.summary(table, items=32)
    assert list(result) == ["fold", "inputs"]
    assert result["fold"]["samples_pct"] == round(100 * 20 / 37, 1)
    assert result["inputs"]["warp_instructions_per_item"] == 4
    assert result["fold"]["top_stalls_pct"] == {"long_sb": 90.0, "barrier": 10.0}


def test_function_at_is_the_innermost():
    assert ncu_phases.function_at(SOURCE, 3) == "read_inputs"
    assert ncu_phases.function_at(SOURCE, 1) == "?"


def test_phase_methods_exist():
    """Every phase method named in ``PHASES`` is a method of one of ``PHASE_FILES`` (a
    renamed method would silently fold its phase into the one before it)."""
    import ast

    root = os.path.dirname(os.path.dirname(__file__))
    names = set()
    for path in ncu_phases.PHASE_FILES:
        with open(os.path.join(root, path)) as f:
            tree = ast.parse(f.read())
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not set(ncu_phases.PHASES) - names, set(ncu_phases.PHASES) - names
