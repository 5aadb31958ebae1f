"""Where a warp-specialised kernel's instructions and stalls go, role by role,
from ncu's per-instruction (source) page. The kernels here give each role its
register budget with setmaxnreg at the role's entry, so each `USETMAXREG`
instruction in the SASS starts the next role's code: the regions between them
are named by the budget they set (`alloc 208`, `dealloc 72`, ...). The code
before the first one is `setup`; the code after the kernel's last `EXIT` is
`out-of-line`: what ptxas moved out of the roles' paths (barrier retry loops
and the like), which any role may run.

    ncu --kernel-name regex:indexer_topk --launch-skip 2 --launch-count 1 --set full -o rep \\
        python3 tools/profile_kernel.py topk-v32-fp8
    ncu -i rep.ncu-rep --page source --print-source sass --csv > source.csv
    python3 tools/ncu_roles.py source.csv            # per role: instructions, stalls, opcodes
    python3 tools/ncu_roles.py source.csv --top 30   # and the 30 instructions with the most samples

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


def read_source_csv(path: str) -> list[dict]:
    """The instructions of the first kernel in an ncu source-page CSV, in
    address order: {'source', 'opcode', 'executed', 'samples', 'stalls'}."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
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
        if not row or row[0] in ("Kernel Name", "Address"):
            if out:  # the next kernel's block: one kernel at a time
                break
            continue
        source = row[col["Source"]].strip()
        words = source.split()
        if words and words[0].startswith("@"):  # a predicate guard
            words = words[1:]
        out.append({
            "source": source,
            "opcode": words[0].split(".")[0] if words else "",
            "executed": number(row, col[EXECUTED]),
            "samples": number(row, col[SAMPLES]),
            "stalls": {name: number(row, i) for name, i in stall_cols},
        })
    return out


def split_roles(instructions: list[dict]) -> list[tuple[str, int, int]]:
    """(name, first, end) index ranges: `setup`, then one region from each
    USETMAXREG to the next (named `alloc N` / `dealloc N`, N its register
    budget in decimal; a repeated name gets a suffix), then `out-of-line`
    after the last EXIT."""
    exits = [i for i, ins in enumerate(instructions) if ins["opcode"] == "EXIT"]
    tail = exits[-1] + 1 if exits else len(instructions)
    cuts = []
    for i, ins in enumerate(instructions):
        m = re.search(r"USETMAXREG\.(TRY_ALLOC|DEALLOC)\S*\s+(?:\S+,\s*)?(0x[0-9a-fA-F]+|\d+)", ins["source"])
        if m:
            kind = "alloc" if m.group(1) == "TRY_ALLOC" else "dealloc"
            cuts.append((i, f"{kind} {int(m.group(2), 0)}"))
    regions, seen = [], collections.Counter()
    bounds = [(0, "setup")] + [c for c in cuts if c[0] < tail] + [(tail, "out-of-line"), (len(instructions), None)]
    for (a, name), (b, _) in zip(bounds, bounds[1:]):
        if b <= a:
            continue
        seen[name] += 1
        regions.append((name if seen[name] == 1 else f"{name} ({seen[name]})", a, b))
    return regions


def summarise(instructions: list[dict], top: int = 0) -> str:
    total_ex = sum(x["executed"] for x in instructions) or 1.0
    total_s = sum(x["samples"] for x in instructions) or 1.0
    lines = [f"{len(instructions)} instructions, {total_ex / 1e6:.1f} M executed (warp level), "
             f"{int(total_s)} stall samples"]
    region_of = {}
    for name, a, b in split_roles(instructions):
        part = instructions[a:b]
        for i in range(a, b):
            region_of[i] = name
        ex = sum(x["executed"] for x in part)
        smp = sum(x["samples"] for x in part)
        reasons = collections.Counter()
        ops = collections.Counter()
        for x in part:
            reasons.update(x["stalls"])
            ops[x["opcode"]] += x["executed"]
        lines.append(f"== {name} (instructions {a}..{b - 1}): executed {ex / 1e6:.1f} M ({100 * ex / total_ex:.0f} %), "
                     f"samples {int(smp)} ({100 * smp / total_s:.0f} %)")
        if smp:
            shares = (f"{k} {100 * v / smp:.0f} %" for k, v in reasons.most_common(8) if v)
            lines.append("   stalls: " + ", ".join(shares))
        if ex:
            lines.append("   opcodes: " + ", ".join(f"{k} {v / 1e6:.1f} M" for k, v in ops.most_common(12) if v))
    if top:
        lines.append(f"== the {top} instructions with the most samples")
        order = sorted(range(len(instructions)), key=lambda i: -instructions[i]["samples"])[:top]
        for i in order:
            x = instructions[i]
            main = sorted(x["stalls"].items(), key=lambda kv: -kv[1])[:3]
            lines.append(f"{i:6d} {region_of.get(i, ''):<12} {100 * x['samples'] / total_s:5.1f} %  "
                         f"{x['source'][:60]:<60} " + " ".join(f"{k}:{int(v)}" for k, v in main if v))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --print-source sass --csv > this file")
    ap.add_argument("--top", type=int, default=0, help="also list the N instructions with the most samples")
    args = ap.parse_args(argv)
    print(summarise(read_source_csv(args.csv), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
