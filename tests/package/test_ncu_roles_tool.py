"""tools/ncu_roles.py on a small synthetic ncu source-page CSV (no GPU): the
regions split at each setmaxnreg and after the last EXIT, and each region's
instructions, samples and stall reasons add up to what the rows hold."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "ncu_roles.py")
_spec = importlib.util.spec_from_file_location("ncu_roles_tool", TOOL)
ncu_roles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_roles)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_selected", "stall_long_sb (Not Issued)"]
# (source, executed, long_sb, wait, selected): samples = long_sb + wait + selected
ROWS = [
    ("LDC R1, c[0x0][0x28]", 10, 1, 0, 0),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0", 8, 0, 0, 1),   # consumers from here
    ("FFMA R2, R3, R4, R2", 1000, 0, 30, 10),
    ("@P0 FMNMX R5, RZ, R6, !PT", 1000, 0, 5, 10),
    ("FSETP.GEU.AND P1, PT, R7, RZ, PT", 100, 200, 0, 1),
    ("EXIT", 8, 0, 0, 0),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x48", 4, 0, 0, 0),          # the selector
    ("LDS R8, [R9]", 300, 0, 7, 3),
    ("ATOMS.POPC.INC.32 RZ, [R10+UR4]", 200, 0, 0, 2),
    ("EXIT", 4, 0, 0, 0),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 4, 0, 0, 0),          # the producer
    ("UTMALDG.3D [UR8], [UR6]", 50, 40, 0, 1),
    ("EXIT", 4, 0, 0, 0),
    ("NANOSLEEP.SYNCS 0x989680", 70, 90, 0, 0),               # out-of-line
    ("RET.REL.NODEC R10, 0x0", 5, 0, 0, 0),
]


def write_csv(path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "void k(Params)"])
        w.writerow(HEADER)
        for i, (src, ex, lsb, wait, sel) in enumerate(ROWS):
            w.writerow([hex(0x1000 + 16 * i), "      " + src, lsb + wait + sel, lsb + wait, ex, lsb, wait, sel, lsb])


def test_regions_and_sums(tmp_path):
    path = str(tmp_path / "source.csv")
    write_csv(path)
    ins = ncu_roles.read_source_csv(path)
    assert len(ins) == len(ROWS)
    assert ins[3]["opcode"] == "FMNMX"  # the predicate guard skipped
    regions = ncu_roles.split_roles(ins)
    assert [(n, a, b) for n, a, b in regions] == [
        ("setup", 0, 1), ("alloc 208", 1, 6), ("dealloc 72", 6, 10), ("dealloc 24", 10, 13),
        ("out-of-line", 13, 15)]
    for name, a, b in regions:  # the regions' instructions are the rows'
        assert sum(x["executed"] for x in ins[a:b]) == sum(r[1] for r in ROWS[a:b]), name
        assert sum(x["samples"] for x in ins[a:b]) == sum(r[2] + r[3] + r[4] for r in ROWS[a:b]), name
    assert ins[4]["stalls"] == {"long_sb": 200.0, "wait": 0.0, "selected": 1.0}


def test_report(tmp_path):
    path = str(tmp_path / "source.csv")
    write_csv(path)
    out = subprocess.run([sys.executable, TOOL, path, "--top", "2"], capture_output=True, text=True, check=True).stdout
    samples = sum(r[2] + r[3] + r[4] for r in ROWS)
    assert f"{samples} stall samples" in out
    # the consumers: 2116 of 2767 executed (76 %), 257 of 401 samples (64 %);
    # of theirs, long_sb 200 (78 %), wait 35 (14 %), selected 22 (9 %)
    assert "== alloc 208 (instructions 1..5): executed 0.0 M (76 %), samples 257 (64 %)" in out
    assert "stalls: long_sb 78 %, wait 14 %, selected 9 %" in out
    top = out.split("instructions with the most samples\n")[1].splitlines()
    assert "FSETP.GEU.AND" in top[0] and "alloc 208" in top[0] and "long_sb:200" in top[0]
    assert "NANOSLEEP" in top[1] and "out-of-line" in top[1]
