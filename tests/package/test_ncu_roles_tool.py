"""tools/ncu_roles.py on small synthetic ncu source-page CSVs (no GPU): the
regions split at each setmaxnreg, out-of-line code counted for the role whose
branch enters it, each role's instructions, samples and stall reasons as the
rows hold them, and one kernel of several read."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "ncu_roles.py")
_spec = importlib.util.spec_from_file_location("ncu_roles_tool", TOOL)
ncu_roles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_roles)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_selected", "stall_long_sb (Not Issued)"]
BASE = 0x7F0000001000


def addr(i: int) -> int:
    return BASE + 16 * i


# (source, executed, long_sb, wait, selected): samples = long_sb + wait + selected.
# Rows 13.. are out-of-line: 13-14 entered by the selector's branch (row 8),
# 15-16 by both the consumers' (row 4) and the producer's (row 11).
ROWS = [
    ("LDC R1, c[0x0][0x28]", 10, 1, 0, 0),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0", 8, 0, 0, 1),    # the consumers from here
    ("FFMA R2, R3, R4, R2", 1000, 0, 30, 10),
    ("@P0 FMNMX R5, RZ, R6, !PT", 1000, 0, 5, 10),
    (f"@!P1 BRA {addr(15):#x}", 100, 200, 0, 1),
    ("EXIT", 8, 0, 0, 0),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x48", 4, 0, 0, 0),           # the selector
    ("LDS R8, [R9]", 2300, 0, 7, 3),
    (f"@!P0 BRA {addr(13):#x}", 200, 0, 0, 2),
    ("EXIT", 4, 0, 0, 0),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 4, 0, 0, 0),           # the producer
    (f"@!P2 BRA {addr(15):#x}", 50, 40, 0, 1),
    ("EXIT", 4, 0, 0, 0),
    ("@!P0 NANOSLEEP.SYNCS 0x989680", 70, 90, 0, 0),           # the selector's
    (f"BRA {addr(8):#x}", 5, 0, 0, 0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R2+URZ], R3", 6, 11, 0, 0),  # shared
    (f"BRA {addr(4):#x}", 6, 0, 0, 0),
]


def write_csv(path: str, rows=ROWS, extra_kernel: bool = False) -> None:
    def block(w, name, rows):
        w.writerow(["Kernel Name", name])
        w.writerow(HEADER)
        for i, (src, ex, lsb, wait, sel) in enumerate(rows):
            # ncu writes large counts with thousands separators
            w.writerow([hex(addr(i)), "      " + src, f"{lsb + wait + sel:,}", lsb + wait, f"{ex:,}", lsb, wait,
                        sel, lsb])
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        block(w, "void first_kernel(Params)", rows)
        if extra_kernel:
            block(w, "void second_kernel(Params)", [("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", 1, 0, 0, 0),
                                                    ("FFMA R2, R3, R4, R2", 5, 0, 3, 2), ("EXIT", 1, 0, 0, 0)])


def samples(rows) -> int:
    return sum(r[2] + r[3] + r[4] for r in rows)


def test_regions_and_roles(tmp_path):
    path = str(tmp_path / "source.csv")
    write_csv(path)
    ins = ncu_roles.read_source_csv(path)
    assert len(ins) == len(ROWS)
    assert ins[3]["opcode"] == "FMNMX"  # the predicate guard skipped
    assert ins[7]["executed"] == 2300.0  # "2,300"
    assert ncu_roles.split_roles(ins) == [("setup", 0, 1), ("alloc 208", 1, 6), ("dealloc 72", 6, 10),
                                          ("dealloc 24", 10, 13)]
    labels = ncu_roles.role_of_each(ins)
    assert labels[13:] == ["dealloc 72"] * 2 + ["shared"] * 2
    assert ins[4]["stalls"] == {"long_sb": 200.0, "wait": 0.0, "selected": 1.0}


def test_report(tmp_path):
    path = str(tmp_path / "source.csv")
    write_csv(path)
    out = subprocess.run([sys.executable, TOOL, path, "--top", "2"], capture_output=True, text=True, check=True).stdout
    total_ex, total_s = sum(r[1] for r in ROWS), samples(ROWS)
    assert f"{total_s} stall samples" in out
    cons = ROWS[1:6]  # executed 2116 of 4779, samples 257 of 412; of theirs long_sb 78 %, wait 14 %, selected 9 %
    assert (f"== alloc 208 (instructions 1..5): executed 0.0 M ({100 * sum(r[1] for r in cons) / total_ex:.0f} %), "
            f"samples {samples(cons)} ({100 * samples(cons) / total_s:.0f} %)") in out
    assert "stalls: long_sb 78 %, wait 14 %, selected 9 %" in out
    sel = ROWS[6:10] + ROWS[13:15]  # with its out-of-line block
    assert f"== dealloc 72 (instructions 6..9, 2 out-of-line): executed 0.0 M" in out
    assert f"samples {samples(sel)} ({100 * samples(sel) / total_s:.0f} %)" in out
    assert "== shared (2 out-of-line)" in out
    top = out.split("instructions with the most samples\n")[1].splitlines()
    assert "BRA" in top[0] and "alloc 208" in top[0] and "long_sb:200" in top[0] and "48.8 %" in top[0]  # 201 of 412
    assert "NANOSLEEP" in top[1] and "dealloc 72" in top[1]


def test_one_kernel_of_several(tmp_path):
    path = str(tmp_path / "two.csv")
    write_csv(path, extra_kernel=True)
    assert len(ncu_roles.read_source_csv(path)) == len(ROWS)
    second = ncu_roles.read_source_csv(path, "second_kernel")
    assert [x["opcode"] for x in second] == ["USETMAXREG", "FFMA", "EXIT"]
    assert ncu_roles.summarise(second).splitlines()[1].startswith("== alloc 232 (instructions 0..2)")
    with pytest.raises(SystemExit):
        ncu_roles.read_source_csv(path, "no_such_kernel")


def test_no_samples(tmp_path):
    path = str(tmp_path / "quiet.csv")
    write_csv(path, rows=[(src, ex, 0, 0, 0) for src, ex, *_ in ROWS])
    out = ncu_roles.summarise(ncu_roles.read_source_csv(path))
    assert "0 stall samples" in out and "samples 0 (-)" in out
