"""tools/timeline.py on saved marks (no GPU): the schedule of a step and, in
a paired backward, each warpgroup's first merge per pair rank, from a small
synthetic npz whose cycles are known."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "timeline.py")
_spec = importlib.util.spec_from_file_location("timeline_tool", TOOL)
timeline_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline_tool)
ROLES, EVENTS, STEPS = 4, 16, 8
META, START, END = 3, 1, 2
# bwd_kernel.cuh's ScoresMark / GradsMark: the top, then each warpgroup's first
# merge's steps (product completed, the partner's landing free, its half received).
TOP, PRODUCT, FREE, RECEIVED = 0, 8, 9, 10


def synthetic_marks(paired: bool) -> np.ndarray:
    """Two clusters of two CTAs; every block 20000 cycles; the clocks start
    just below 2^32 and wrap before the first loop top. Rank 1's marks are 7 cycles later than
    rank 0's at its loop tops. WG0's merge: the landing free 300 cycles after
    the product (rank 1: 500), the partner's half 1000 after that; WG1's: 400
    (rank 1: 450), then 800."""
    marks = np.zeros((4, ROLES, STEPS, EVENTS), np.uint32)
    clock0 = (1 << 32) - 5000
    for cta in range(4):
        rank = cta % 2
        shift = 7 * rank
        marks[cta, META, 0, START] = (clock0 + shift) % (1 << 32)
        marks[cta, META, 0, END] = (clock0 + shift + 30000 * STEPS) % (1 << 32)
        for step in range(STEPS):
            top = clock0 + 10000 + 20000 * step + shift
            for role, (product, to_free, to_half) in enumerate(((9000, (300, 500)[rank], 1000),
                                                                (8000, (400, 450)[rank], 800))):
                at = {TOP: top + 50 * role, PRODUCT: top + product}
                if paired:
                    at[FREE] = top + product + to_free
                    at[RECEIVED] = top + product + to_free + to_half
                for event, clock in at.items():
                    marks[cta, role, step, event] = clock % (1 << 32)
    return marks


def report(tmp_path, marks: np.ndarray, layout: str | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "marks.npz"
    np.savez_compressed(path, marks=marks, which="bwd", shape="mla-v32-h128",
                        layout=timeline_tool.event_layout("bwd") if layout is None else layout)
    return subprocess.run([sys.executable, TOOL, "mla-v32-h128", "bwd", "--load", str(path)], capture_output=True,
                          text=True)


def test_paired_backward_merge_steps(tmp_path):
    out = report(tmp_path, synthetic_marks(paired=True))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "step period (consumer 0's loop top to top), median of steps 2..5: 20000 cycles" in text
    assert "start -> step 0's top 10000; last step's top -> consumer 0's end 90000; start -> end 240000" in text
    assert "rank 1's first loop top minus rank 0's: median 7 cycles" in text
    lines = {m.group(1, 2): m.group(3, 4, 5) for m in re.finditer(
        r"(WG\d) \(\w+\) rank (\d), first merge: product -> landing free (-?\d+), -> partner's half (-?\d+); "
        r"partner's send start minus own (-?\d+)", text)}
    # The partner's send start: its landing-free mark against this CTA's (7 + 500 - 300 for WG0's rank 0).
    assert lines == {
        ("WG0", "0"): ("300", "1000", "207"), ("WG0", "1"): ("500", "1000", "-207"),
        ("WG1", "0"): ("400", "800", "57"), ("WG1", "1"): ("450", "800", "-57"),
    }


def test_unpaired_backward_has_no_pair_lines(tmp_path):
    out = report(tmp_path, synthetic_marks(paired=False))
    assert out.returncode == 0, out.stderr
    assert "step period" in out.stdout
    assert "pairs:" not in out.stdout and "first merge" not in out.stdout


def test_marks_of_other_events_are_refused(tmp_path):
    out = report(tmp_path, synthetic_marks(paired=True), layout="WG0 (scores): 0=kScoresTop")
    assert out.returncode != 0 and "that tree's tools/timeline.py" in out.stderr
    assert "first merge" not in out.stdout


def topk_marks() -> np.ndarray:
    """The resident top-k kernel's marks (indexer_topk/kernel.cuh's
    ResidentConsumerMark and SelectorMark), three CTAs, the third walking one
    step fewer: consumer 0's loop top every 20000 cycles, consumer 1's 50
    later, the logits stored at 15000; the selector takes a step's logits at
    15200 and frees the buffer at 33000 (past the next step's top)."""
    consumer = timeline_tool.enum_names("indexer_topk/kernel.cuh", "ResidentConsumerMark")
    selector = timeline_tool.enum_names("indexer_topk/kernel.cuh", "SelectorMark")
    c = {name: value for value, name in consumer.items()}
    sel = {name: value for value, name in selector.items()}
    marks = np.zeros((3, ROLES, STEPS, EVENTS), np.uint32)
    for cta in range(3):
        marks[cta, META, 0, START] = 1000
        for step in range(STEPS - (cta == 2)):
            top = 10000 + 20000 * step
            for role in (0, 1):
                marks[cta, role, step, c["kConsumerTop"]] = top + 50 * role
                marks[cta, role, step, c["kLogitsStored"]] = top + 15000
            for name, at in (("kSelectorTop", 15100), ("kLogitsFullWaited", 15200), ("kRow0FirstRound", 17000),
                             ("kRow0Rounds", 21000), ("kRow0Emitted", 24000), ("kBufferFreed", 33000)):
                marks[cta, 2, step, sel[name]] = top + at
    return marks


def test_resident_topk_schedule(tmp_path):
    marks = topk_marks()
    assert timeline_tool.topk_steps(marks) == STEPS - 1
    path = tmp_path / "marks.npz"
    steps = timeline_tool.topk_steps(marks)
    np.savez_compressed(path, marks=marks[:, :, :steps], which="topk", shape="topk-v32-fp8",
                        layout=timeline_tool.event_layout("topk"))
    out = subprocess.run([sys.executable, TOOL, "topk-v32-fp8", "topk", "--load", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"3 CTAs, {STEPS - 1} steps each" in text
    assert f"median of steps 2..{STEPS - 4}: 20000 cycles" in text
    this, _, following = text.partition("selector, next step:")
    assert re.search(r"consumer 1, this step:\n  kConsumerTop +50\n  kLogitsStored +15000\n", this)
    assert re.search(r"selector, this step:\n  kSelectorTop +15100\n  kLogitsFullWaited +15200\n"
                     r"  kRow0FirstRound +17000\n  kRow0Rounds +21000\n  kRow0Emitted +24000\n  kBufferFreed +33000\n",
                     this)
    # The same steps one step on, against this step's consumer top.
    assert re.search(r"\n  kLogitsFullWaited +35200\n", following)
    assert "first merge" not in text
