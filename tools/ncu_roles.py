"""Where a warp-specialised kernel's instructions and stalls go, role by role,
from ncu's per-instruction (source) page. The kernels here give each role its
register budget with setmaxnreg at the role's entry, so each `USETMAXREG`
instruction in the SASS starts the next role's code: the regions between them
are named by the budget they set (`alloc 208`, `dealloc 72`, ...). The code
before the first one is `setup`. The code after the kernel's last `EXIT` is
what ptxas moved out of the roles' paths (barrier retry loops and the like):
each of its blocks counts for the role whose branch enters it (`shared`
where several roles' branches do, `out-of-line` where none does).

    ncu --kernel-name regex:indexer_topk --launch-skip 2 --launch-count 1 --set full -o rep \\
        python3 tools/profile_kernel.py topk-v32-fp8
    ncu -i rep.ncu-rep --page source --print-source sass --csv > source.csv
    python3 tools/ncu_roles.py source.csv            # per role: instructions, stalls, opcodes
    python3 tools/ncu_roles.py source.csv --top 30   # and the 30 instructions with the most samples

A CSV of several kernels is read one kernel at a time: the first, or the
first whose name holds --kernel's text.

Per region it prints the executed warp instructions and the warp-stall
samples (each as a share of the kernel's), the region's main stall reasons
(as shares of its samples) and its most executed opcodes; with --top, the
instructions with the most samples, each with its region and main reasons.
A sample is a warp's state at a sampling tick: `selected` is a warp issuing,
the rest are the reasons a warp did not (ncu's Profiling Guide, "Warp Stall
Reasons").
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_source_csv(path: str, kernel: str = "") -> list[dict]:
    """The instructions of one kernel in an ncu source-page CSV (the first, or
    the first whose name holds `kernel`), in address order: {'address',
    'source', 'opcode', 'executed', 'samples', 'stalls'}."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # Each kernel's block: a "Kernel Name" row, its header ("Address", ...), its instructions.
    names = [(i, r[1] if len(r) > 1 else "") for i, r in enumerate(rows) if r and r[0] == "Kernel Name"]
    if len(names) > 1 or kernel:
        chosen = next(((i, n) for i, n in names if kernel in n), None)
        if chosen is None:
            raise SystemExit(f"{path}: no kernel whose name holds {kernel!r}")
        print(f"{path}: {len(names)} kernel(s); reading {chosen[1][:100]}", file=sys.stderr)
        first = chosen[0]
    else:
        first = 0
    start = next((i for i, r in enumerate(rows) if i >= first and r and r[0] == "Address"), None)
    if start is None:
        raise SystemExit(f"{path}: no 'Address' header row (is it `--page source --csv` output?)")
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    for name in ("Source", SAMPLES, EXECUTED):
        if name not in col:
            raise SystemExit(f"{path}: no column {name!r}")
    # The per-reason sample columns (all samples, not the not-issued ones).
    stall_cols = [(name[len("stall_"):], i) for name, i in col.items()
                  if name.startswith("stall_") and "Not Issued" not in name]

    def number(row: list[str], i: int) -> float:
        try:
            return float(row[i].replace(",", ""))
        except (IndexError, ValueError):
            return 0.0

    out = []
    for row in rows[start + 1:]:
        if row and row[0] == "Kernel Name":  # the next kernel's block
            break
        if len(row) <= col["Source"] or not row[col["Source"]].strip():
            continue
        source = row[col["Source"]].strip()
        words = source.split()
        if words[0].startswith("@"):  # a predicate guard
            words = words[1:]
        try:
            address = int(row[0], 16)
        except ValueError:
            address = -1
        out.append({
            "address": address,
            "source": source,
            "opcode": words[0].split(".")[0] if words else "",
            "executed": number(row, col[EXECUTED]),
            "samples": number(row, col[SAMPLES]),
            "stalls": {name: number(row, i) for name, i in stall_cols},
        })
    return out


def out_of_line_start(instructions: list[dict]) -> int:
    """The index after the kernel's last EXIT (len if it has none)."""
    exits = [i for i, ins in enumerate(instructions) if ins["opcode"] == "EXIT"]
    return exits[-1] + 1 if exits else len(instructions)


def split_roles(instructions: list[dict]) -> list[tuple[str, int, int]]:
    """(name, first, end) index ranges in the kernel's own paths: `setup`,
    then one region from each USETMAXREG to the next (named `alloc N` /
    `dealloc N`, N its register budget in decimal; a repeated name gets a
    suffix), up to the out-of-line code after the last EXIT."""
    tail = out_of_line_start(instructions)
    cuts = []
    for i, ins in enumerate(instructions[:tail]):
        m = re.search(r"USETMAXREG\.(TRY_ALLOC|DEALLOC)\S*\s+(?:\S+,\s*)?(0x[0-9a-fA-F]+|\d+)", ins["source"])
        if m:
            kind = "alloc" if m.group(1) == "TRY_ALLOC" else "dealloc"
            cuts.append((i, f"{kind} {int(m.group(2), 0)}"))
    regions, seen = [], collections.Counter()
    bounds = [(0, "setup")] + cuts + [(tail, None)]
    for (a, name), (b, _) in zip(bounds, bounds[1:]):
        if b <= a:
            continue
        seen[name] += 1
        regions.append((name if seen[name] == 1 else f"{name} ({seen[name]})", a, b))
    return regions


def role_of_each(instructions: list[dict]) -> list[str]:
    """Each instruction's role: its region's, or for out-of-line code the role
    whose branches enter the block it lies in (an entry is a branch target;
    a block runs from one entry to the next)."""
    labels = [""] * len(instructions)
    for name, a, b in split_roles(instructions):
        labels[a:b] = [name] * (b - a)
    tail = out_of_line_start(instructions)
    index_of = {ins["address"]: i for i, ins in enumerate(instructions) if ins["address"] >= 0}
    entries: dict[int, set[str]] = collections.defaultdict(set)
    for i, ins in enumerate(instructions[:tail]):
        if ins["opcode"] == "BRA":
            m = re.search(r"(0x[0-9a-fA-F]+)\s*$", ins["source"])
            j = index_of.get(int(m.group(1), 16)) if m else None
            if j is not None and j >= tail:
                entries[j].add(labels[i])
    current = "out-of-line"
    for i in range(tail, len(instructions)):
        if i in entries:
            current = next(iter(entries[i])) if len(entries[i]) == 1 else "shared"
        labels[i] = current
    return labels


def summarise(instructions: list[dict], top: int = 0) -> str:
    total_ex = sum(x["executed"] for x in instructions)
    total_s = sum(x["samples"] for x in instructions)

    def share(v: float, total: float, digits: int = 0) -> str:
        return f"{100 * v / total:.{digits}f} %" if total else "-"

    lines = [f"{len(instructions)} instructions, {total_ex / 1e6:.1f} M executed (warp level), "
             f"{int(total_s)} stall samples"]
    labels = role_of_each(instructions)
    tail = out_of_line_start(instructions)
    extent = {name: (a, b) for name, a, b in split_roles(instructions)}
    for name in dict.fromkeys(labels):  # the roles in order of first appearance
        part = [i for i, label in enumerate(labels) if label == name]
        ex = sum(instructions[i]["executed"] for i in part)
        smp = sum(instructions[i]["samples"] for i in part)
        reasons = collections.Counter()
        ops = collections.Counter()
        for i in part:
            reasons.update(instructions[i]["stalls"])
            ops[instructions[i]["opcode"]] += instructions[i]["executed"]
        where = []
        if name in extent:
            where.append(f"instructions {extent[name][0]}..{extent[name][1] - 1}")
        moved = sum(1 for i in part if i >= tail)
        if moved:
            where.append(f"{moved} out-of-line")
        lines.append(f"== {name} ({', '.join(where)}): executed {ex / 1e6:.1f} M ({share(ex, total_ex)}), "
                     f"samples {int(smp)} ({share(smp, total_s)})")
        if smp:
            lines.append("   stalls: " + ", ".join(f"{k} {share(v, smp)}" for k, v in reasons.most_common(8) if v))
        if ex:
            lines.append("   opcodes: " + ", ".join(f"{k} {v / 1e6:.1f} M" for k, v in ops.most_common(12) if v))
    if top:
        lines.append(f"== the {top} instructions with the most samples")
        order = sorted(range(len(instructions)), key=lambda i: -instructions[i]["samples"])[:top]
        for i in order:
            x = instructions[i]
            main = sorted(x["stalls"].items(), key=lambda kv: -kv[1])[:3]
            lines.append(f"{i:6d} {labels[i]:<12} {share(x['samples'], total_s, 1):>6}  "
                         f"{x['source'][:60]:<60} " + " ".join(f"{k}:{int(v)}" for k, v in main if v))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --print-source sass --csv > this file")
    ap.add_argument("--top", type=int, default=0, help="also list the N instructions with the most samples")
    ap.add_argument("--kernel", default="", help="read the first kernel whose name holds this text")
    args = ap.parse_args(argv)
    print(summarise(read_source_csv(args.csv, args.kernel), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
