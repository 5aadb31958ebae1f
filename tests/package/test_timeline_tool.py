"""tools/timeline.py on saved marks (no GPU): the schedule of a step and, in
a paired backward, each warpgroup's first merge per pair rank, from a small
synthetic npz whose cycles are known."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "timeline.py")
ROLES, EVENTS, STEPS = 4, 16, 8
META, START, END = 3, 1, 2
# bwd_kernel.cuh's ScoresMark / GradsMark: the top, then each warpgroup's first
# merge's steps (product completed, the partner's landing free, its half received).
TOP, PRODUCT, FREE, RECEIVED = 0, 8, 9, 10


def synthetic_marks(paired: bool, rank1_shift: int = 7) -> np.ndarray:
    """Two clusters of two CTAs; every block 20000 cycles; rank 1's clock
    `rank1_shift` cycles behind rank 0's in everything. WG0's merge: free 300
    after the product, the half 1000 after that; WG1's: 400, then 800."""
    marks = np.zeros((4, ROLES, STEPS, EVENTS), np.uint32)
    for cta in range(4):
        shift = rank1_shift if cta % 2 else 0
        marks[cta, META, 0, START] = 1000 + shift
        marks[cta, META, 0, END] = 1000 + shift + 30000 * STEPS
        for step in range(STEPS):
            top = 10000 + 20000 * step + shift
            for role, (product, to_free, to_half) in enumerate(((9000, 300, 1000), (8000, 400, 800))):
                marks[cta, role, step, TOP] = top + 50 * role
                marks[cta, role, step, PRODUCT] = top + product
                if paired:
                    marks[cta, role, step, FREE] = top + product + to_free
                    marks[cta, role, step, RECEIVED] = top + product + to_free + to_half
    return marks


def report(tmp_path, marks: np.ndarray) -> str:
    path = tmp_path / "marks.npz"
    np.savez_compressed(path, marks=marks)
    out = subprocess.run([sys.executable, TOOL, "mla-v32-h128", "bwd", "--load", str(path)], capture_output=True,
                         text=True, check=True)
    return out.stdout


def test_paired_backward_merge_steps(tmp_path):
    text = report(tmp_path, synthetic_marks(paired=True))
    assert "step period (consumer 0's loop top to top), median of steps 2..5: 20000 cycles" in text
    assert "rank 1's first loop top minus rank 0's: median 7 cycles" in text
    lines = {m.group(1, 2): m.group(3, 4, 5) for m in re.finditer(
        r"(WG\d) \(\w+\) rank (\d), first merge: product -> landing free (-?\d+), -> partner's half (-?\d+); "
        r"partner's send start minus own (-?\d+)", text)}
    assert lines == {
        ("WG0", "0"): ("300", "1000", "7"), ("WG0", "1"): ("300", "1000", "-7"),
        ("WG1", "0"): ("400", "800", "7"), ("WG1", "1"): ("400", "800", "-7"),
    }


def test_unpaired_backward_has_no_pair_lines(tmp_path):
    text = report(tmp_path, synthetic_marks(paired=False))
    assert "step period" in text
    assert "pairs:" not in text and "first merge" not in text
