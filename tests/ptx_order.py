"""PTX check of a PDL kernel's contract: which operands it may read before
``griddepcontrol.wait``.

``loads_before_wait(ptx)`` follows every kernel parameter through the registers that are
computed from it (a taint over the instructions, to a fixpoint, so loop-carried addresses
count) and, on the control-flow graph of the PTX, decides for every global load (``ld``
outside shared / local / param space, ``cp.async`` sources) whether *every* path from the
kernel entry to it passes an unpredicated ``griddepcontrol.wait``. It returns the
parameters read by at least one load that some path reaches without a wait, and the
parameters read by any load at all (so a test can tell that its check is not vacuous).
"""

from __future__ import annotations

import re

_PARAM_DECL = re.compile(r"\.param\s+[^\n,]*?\s(\S+_param_(\d+))")
_REG = re.compile(r"%[a-z]+\d+")
_LABEL = re.compile(r"^(\$?[\w$]+):")
_NO_DEST = ("st.", "red.", "bra", "bar.", "barrier.", "cp.", "prefetch", "fence", "ret",
            "griddepcontrol", "mbarrier.arrive", "membar", "exit", "trap", "cp.async")  # fmt: skip


def _instructions(ptx: str) -> list[str]:
    """The kernel body's statements, labels kept as ``label:`` entries, one per item. Labels
    of a ``{ }`` block (inline asm reuses names such as ``LAB_WAIT``) get the block's
    number, in their declaration and in the branches of that block."""
    start = ptx.index(")\n{") if ")\n{" in ptx else ptx.index("{")
    lines = []
    stack, blocks = [0], 0
    for raw in ptx[start:].splitlines():
        line = raw.split("//")[0].strip()
        if line == "{":
            blocks += 1
            stack.append(blocks)
            continue
        if line == "}":
            stack.pop()
            continue
        if not line or line == ")" or line.startswith((".reg", ".shared", ".local")):
            continue
        lines.append((stack[-1], line))
    declared: dict[int, set[str]] = {}
    for block, line in lines:
        m = _LABEL.match(line)
        if m:
            declared.setdefault(block, set()).add(m.group(1))

    def scoped(block, name):
        return f"{name}@{block}" if block and name in declared.get(block, ()) else name

    out = []
    for block, line in lines:
        m = _LABEL.match(line)
        if m:
            out.append(scoped(block, m.group(1)) + ":")
            line = line[m.end() :].strip()
            if not line:
                continue
        for stmt in line.split(";"):
            stmt = stmt.strip()
            if not stmt:
                continue
            pred, op, rest = _opcode(stmt)
            if op.startswith("bra"):
                stmt = f"{pred + ' ' if pred else ''}{op} {scoped(block, rest.strip())}"
            out.append(stmt)
    return out


def _opcode(stmt: str) -> tuple[str | None, str, str]:
    """(predicate register or None, opcode, operand text)."""
    pred = None
    if stmt.startswith("@"):
        pred, stmt = stmt.split(None, 1)
    parts = stmt.split(None, 1)
    return pred, parts[0], parts[1] if len(parts) > 1 else ""


def _is_global_load(op: str) -> bool:
    if op.startswith("cp.async") and ".global" in op:
        return True
    if not op.startswith(("ld.", "ldu.")):
        return False
    return not any(f".{s}" in op for s in ("shared", "local", "param", "const"))


def loads_before_wait(ptx: str) -> tuple[set[int], set[int]]:
    """(parameters some load reads on a path without a wait, parameters any load reads)."""
    params = {name: int(i) for name, i in _PARAM_DECL.findall(ptx)}
    stmts = _instructions(ptx)
    # taint: register -> parameter indices its value depends on
    taint: dict[str, set[int]] = {}
    changed = True
    while changed:
        changed = False
        for s in stmts:
            if s.endswith(":"):
                continue
            _, op, rest = _opcode(s)
            if op.startswith(_NO_DEST) or not rest:
                continue
            if rest.startswith("{"):
                dest_text, _, src_text = rest.partition("}")
            else:
                dest_text, _, src_text = rest.partition(",")
            dests = _REG.findall(dest_text)
            src: set[int] = set()
            for name, i in params.items():
                if name in src_text:
                    src.add(i)
            for r in _REG.findall(src_text):
                src |= taint.get(r, set())
            for d in dests:
                have = taint.setdefault(d, set())
                if not src <= have:
                    have |= src
                    changed = True
    # control-flow graph over statement indices: must-have-waited, forward, to a fixpoint
    labels = {s[:-1]: i for i, s in enumerate(stmts) if s.endswith(":")}
    n = len(stmts)
    succ: list[list[int]] = []
    for i, s in enumerate(stmts):
        if s.endswith(":"):
            succ.append([i + 1])
            continue
        pred, op, rest = _opcode(s)
        if op.startswith("bra"):
            target = labels[rest.strip().rstrip(";").strip()]
            succ.append([target] if pred is None else [target, i + 1])
        elif op.startswith(("ret", "exit", "trap")) and pred is None:
            succ.append([])
        else:
            succ.append([i + 1])
    waited = [True] * (n + 1)  # after statement i (optimistic start; the entry is False)
    preds: list[list[int]] = [[] for _ in range(n + 1)]
    for i, ss in enumerate(succ):
        for j in ss:
            preds[j].append(i)
    before = [True] * (n + 1)
    changed = True
    while changed:
        changed = False
        for i in range(n):
            b = i != 0 and all(waited[p] for p in preds[i]) and bool(preds[i])
            pred, op, _ = _opcode(stmts[i]) if not stmts[i].endswith(":") else (None, "", "")
            a = b or (op.startswith("griddepcontrol.wait") and pred is None)
            if b != before[i] or a != waited[i]:
                before[i], waited[i] = b, a
                changed = True
    early: set[int] = set()
    read: set[int] = set()
    for i, s in enumerate(stmts):
        if s.endswith(":"):
            continue
        _, op, rest = _opcode(s)
        if not _is_global_load(op):
            continue
        cp = op.startswith("cp.async")
        address = rest.split(",")[1] if cp else rest[rest.index("[") :]
        deps: set[int] = set()
        for name, j in params.items():
            if name in address:
                deps.add(j)
        for r in _REG.findall(address):
            deps |= taint.get(r, set())
        read |= deps
        if not before[i]:
            early |= deps
    return early, read
