"""Markdown tables from a ``bench_kda.py --json`` file (for docs/: the numbers as measured,
with the run's copy bandwidth).

- ``rows`` (default): one line per per-step row: H, B, T, pages, the kernel the dispatcher
  took, us, TB/s, % of copy, fla's recurrence and x fla (composed where measured).
- ``--dtypes``: fp32 and bf16 pages side by side per (H, B, T): us of
  each, bf16's speedup over fp32, bf16's % of copy for its bytes, and x fla's recurrence on
  bf16 pages; rows with one dtype only are left out.

    python3 scripts/table_kda.py run.json [--dtypes]
"""

from __future__ import annotations

import argparse
import json


def _us(row):
    return row["auto_us"]


def rows_table(data) -> str:
    head = (
        "| H | B | T | pages | kernel | us | TB/s | % of copy | fla rec. us | x fla rec. | "
        "x fla composed |"
    )
    lines = [head, "|" + "---:|" * 3 + "---|" * 2 + "---:|" * 6]
    for r in data["rows"]:
        composed = r.get("speedup_composed")
        lines.append(
            f"| {r['H']} | {r['B']} | {r['T']} | {r.get('state_dtype', 'fp32')} | {r['kernel']} | "
            f"{_us(r):.1f} | {r['state_tbs']:.2f} | {r['pct_copy']:.1f} | {r['fla_us']:.1f} | "
            f"{r['speedup_fla']:.2f} | {'-' if composed is None else f'{composed:.2f}'} |"
        )
    return "\n".join(lines)


def dtypes_table(data) -> str:
    by = {}
    for r in data["rows"]:
        by.setdefault((r["H"], r["B"], r["T"]), {})[r.get("state_dtype", "fp32")] = r
    head = (
        "| H | B | T | fp32 us | bf16 us | bf16 speedup | fp32 % of copy | bf16 % of copy | "
        "x fla rec. (bf16) |"
    )
    lines = [head, "|" + "---:|" * 9]
    for (H, B, T), pair in sorted(by.items()):
        if set(pair) != {"fp32", "bf16"}:
            continue
        f, b = pair["fp32"], pair["bf16"]
        lines.append(
            f"| {H} | {B} | {T} | {_us(f):.1f} | {_us(b):.1f} | {_us(f) / _us(b):.2f} | "
            f"{f['pct_copy']:.1f} | {b['pct_copy']:.1f} | {b['speedup_fla']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("--dtypes", action="store_true", help="fp32 and bf16 pages side by side")
    a = p.parse_args(argv)
    with open(a.json) as f:
        data = json.load(f)
    print(f"copy bandwidth in the run: {data['copy_tbs']:.2f} TB/s ({data.get('device', '')})")
    print(dtypes_table(data) if a.dtypes else rows_table(data))


if __name__ == "__main__":
    main()
