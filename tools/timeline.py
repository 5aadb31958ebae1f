"""Where a kernel's steps fall in time: runs one benchmark shape on an
extension built with JAX_ATTN_DIST_TIMELINE (common/timeline.cuh;
``tools/gpu_check.sh timeline`` builds one apart and runs this), reads the
clock marks of the first CTAs and prints the median schedule of a steady-state
step (a key-block pair in the sparse MLA forward, a block in its backward, a
selecting row pair in the resident float8 top-k kernel) in SM cycles,
relative to consumer 0's loop top.

    python3 tools/timeline.py mla-v32-h128            # the forward
    python3 tools/timeline.py mla-v32-h128 bwd        # the backward (float32)
    python3 tools/timeline.py mla-v32-h128 bwd-det    # the backward (deterministic)
    python3 tools/timeline.py topk-v32-fp8 topk       # the resident top-k kernel (float8, N <= 8192)
    python3 tools/timeline.py mla-v32-h128 bwd --load marks.npz   # a saved run again, no GPU

In the top-k kernel the selector (role 2) selects a pair while the
consumers compute the next one: its "next step" lines are the ones that run
beside the consumers' step. Its steps are the CTA's pairs in walk order,
whose key spans shrink along the walk, so the median step is a middle one.

--save keeps the marks with the event names they were read with; --load
reports them again only where this tree's names are the same.

In a paired backward (an even number of 64-head tiles: 2-CTA clusters) it
also prints each warpgroup's first dKV merge per pair rank: how long after
its product the partner's landing was free, how long after its send the
partner's half arrived, and when the partner began its own send (the SM
clocks of a pair's CTAs agree: their first loop tops are printed).

The event names are read from the kernels' enums. The marks cost cycles of
their own (a global store each, and ptxas allocates the timeline build's
registers differently): the schedule's shape holds, its absolute cycles are
the instrumented kernel's. With --save FILE the marks are also kept (npz).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CTAS, ROLES, STEPS, EVENTS = 2048, 4, 32, 16  # common/timeline.cuh
META_ROLE, META_SM, META_START, META_ROLE_END = 3, 0, 1, 2


def enum_names(header: str, enum: str) -> dict[int, str]:
    """{value: name} of `enum Name : int { ... }` in a csrc header."""
    text = open(os.path.join(ROOT, "csrc", header)).read()
    body = re.search(r"enum\s+" + enum + r"\s*:\s*int\s*\{(.*?)\};", text, re.S).group(1)
    names, value = {}, -1
    for item in re.sub(r"//[^\n]*|/\*.*?\*/", "", body, flags=re.S).split(","):
        item = item.strip()
        if not item:
            continue
        name, _, expr = item.partition("=")
        value = int(expr) if expr.strip() else value + 1
        names[value] = name.strip()
    return names


def run(shape: str, which: str, path: str) -> int:
    """Runs the kernel once with the marks on; returns the steps per CTA."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import jax_attn_dist

    if which == "topk":
        from indexer_topk_bench import shape_call

        return run_marked(*shape_call(shape), path, STEPS)  # the steps a CTA walked: topk_steps, from the marks
    from sparse_mla_bench import SPARSE_MLA_SHAPES, sparse_mla_problem

    S, N, H, T, D, d_v = SPARSE_MLA_SHAPES[shape]
    args, kw, _ = sparse_mla_problem(S, N, H, T, D, d_v, 0)
    if which == "fwd":
        f, f_args = jax.jit(lambda *a: jax_attn_dist.sparse_mla(*a, implementation="cuda", **kw)), args
        steps = -(-T // 128)
    else:
        def fwd(q, kv):
            return jax_attn_dist.sparse_mla(q, kv, args[2], implementation="cuda",
                                            deterministic=which == "bwd-det", **kw)
        (out, lse), vjp = jax.vjp(fwd, *args[:2])
        f, f_args = jax.jit(lambda vjp, c: vjp(c)), (vjp, (jnp.ones_like(out), jnp.ones_like(lse)))
        steps = -(-T // 64)
    return run_marked(f, f_args, path, steps)


def run_marked(f, f_args, path: str, steps: int) -> int:
    """f(*f_args) three times, then once with the marks written to path."""
    import jax

    for _ in range(3):
        jax.block_until_ready(f(*f_args))
    os.environ["JAX_ATTN_DIST_TIMELINE_FILE"] = path  # read by the launcher at each launch
    try:
        jax.block_until_ready(f(*f_args))
    finally:
        del os.environ["JAX_ATTN_DIST_TIMELINE_FILE"]
    return min(steps, STEPS)


def topk_steps(marks: np.ndarray) -> int:
    """The selecting pairs every marked CTA of the resident top-k kernel
    walked (consumer 0's loop tops), at most STEPS."""
    live = marks[marks[:, META_ROLE, 0, META_START] != 0]
    return int((live[:, 0, :, 0] != 0).sum(axis=1).min()) if len(live) else 0


def since(t, base):
    """t - base in cycles, for 32-bit clocks (signed, wrapping)."""
    d = (t.astype(np.int64) - base.astype(np.int64)) % (1 << 32)
    return np.where(d >= 1 << 31, d - (1 << 32), d)


def event_label(events: dict[int, str], ev: int) -> str:
    """An enum's name for the event, or the nearest name below it plus the offset (a dKV tile's index)."""
    if ev in events:
        return events[ev]
    below = [k for k in events if k < ev]
    return f"{events[max(below)]}+{ev - max(below)}" if below else str(ev)


def role_events(which: str) -> list[tuple[str, dict[int, str]]]:
    """(role label, {event: name}) per role, from this tree's kernel headers."""
    if which == "topk":
        return [("consumer 0", enum_names("indexer_topk/kernel.cuh", "ResidentConsumerMark")),
                ("consumer 1", enum_names("indexer_topk/kernel.cuh", "ResidentConsumerMark")),
                ("selector", enum_names("indexer_topk/kernel.cuh", "SelectorMark"))]
    if which == "fwd":
        return [("consumer 0", enum_names("sparse_mla/kernel.cuh", "ConsumerMark")),
                ("consumer 1", enum_names("sparse_mla/kernel.cuh", "ConsumerMark")),
                ("producer", enum_names("sparse_mla/kernel.cuh", "ProducerMark"))]
    return [("WG0 (scores)", enum_names("sparse_mla/bwd_kernel.cuh", "ScoresMark")),
            ("WG1 (grads)", enum_names("sparse_mla/bwd_kernel.cuh", "GradsMark")),
            ("producer", enum_names("sparse_mla/bwd_kernel.cuh", "GatherMark"))]


def event_layout(which: str) -> str:
    """The event names the marks are read with, as text (kept with saved marks)."""
    return "\n".join(f"{label}: " + ", ".join(f"{v}={n}" for v, n in sorted(events.items()))
                     for label, events in role_events(which))


def sampled(ctas: np.ndarray) -> np.ndarray:
    """The CTAs past the first two waves, when there are more."""
    return ctas[ctas >= 264] if (ctas >= 264).any() else ctas


def steady_steps(steps: int) -> list[int]:
    """The steps whose medians make the steady-state schedule: 2 .. steps - 3."""
    return list(range(2, max(3, steps - 2)))


def report(marks: np.ndarray, steps: int, which: str) -> None:
    if steps < 5:
        sys.exit(f"{steps} steps: too few for a steady step (steps 2 .. steps - 3)")
    names = role_events(which)
    ctas = sampled(np.flatnonzero(marks[:, META_ROLE, 0, META_START] != 0))
    m = marks[ctas]
    start = m[:, META_ROLE, 0, META_START]
    top = m[:, 0, :steps, 0]
    print(f"{len(ctas)} CTAs, {steps} steps each")
    period = since(top[:, 1:], top[:, :-1])
    print(f"step period (consumer 0's loop top to top), median of steps 2..{steps - 3}: "
          f"{np.median(period[:, steady_steps(steps)]):.0f} cycles")
    print(f"start -> step 0's top {np.median(since(top[:, 0], start)):.0f}; "
          f"last step's top -> consumer 0's end {np.median(since(m[:, META_ROLE, 0, META_ROLE_END], top[:, steps - 1])):.0f}; "
          f"start -> end {np.median(since(m[:, META_ROLE, 0, META_ROLE_END], start)):.0f}")
    steady = steady_steps(steps)
    base = m[:, 0, steady, 0]
    for role, (label, events) in enumerate(names):
        print(f"{label}, this step:")
        for ev in range(EVENTS):
            v = m[:, role, steady, ev]
            if not v.any():
                continue
            print(f"  {event_label(events, ev):<22}{np.median(since(v, base)):9.0f}")
        if role == 2:
            nxt = m[:, role, [s + 1 for s in steady], :]
            print(f"{label}, next step:")
            for ev in range(EVENTS):
                if nxt[..., ev].any():
                    print(f"  {event_label(events, ev):<22}{np.median(since(nxt[..., ev], base)):9.0f}")


def report_pairs(marks: np.ndarray, steps: int) -> None:
    """The paired backward's first merge of each warpgroup, per pair rank (CTA
    2c + r is rank r of cluster c); nothing where no merge marked its steps."""
    live = np.flatnonzero(marks[:, META_ROLE, 0, META_START] != 0)
    rank0 = sampled(live[(live % 2 == 0) & np.isin(live + 1, live)])
    if len(rank0) == 0:
        return
    steady = steady_steps(steps)
    # Each consumer's (label, its first merge's product, landing-free and received events).
    consumers = []
    for role, (label, events) in enumerate(role_events("bwd")[:2]):
        first = [next(v for v, name in events.items() if name.endswith(step))
                 for step in ("FirstProductDone", "FirstLandingFree", "FirstReceived")]
        if not marks[rank0][:, role, steady, first[1]].any():
            return  # unpaired: no merge waited on a partner
        consumers.append((label, *first))
    tops = since(marks[rank0 + 1, 0, 0, 0], marks[rank0, 0, 0, 0])
    print(f"pairs: {len(rank0)}; rank 1's first loop top minus rank 0's: median {np.median(tops):.0f} cycles")
    for role, (label, product, free, received) in enumerate(consumers):
        for rank in (0, 1):
            me = marks[rank0 + rank][:, role, steady]
            other = marks[rank0 + 1 - rank][:, role, steady]
            to_free = np.median(since(me[..., free], me[..., product]))
            to_half = np.median(since(me[..., received], me[..., free]))
            partner = since(other[..., free], me[..., free])
            print(f"{label} rank {rank}, first merge: product -> landing free {to_free:.0f}, "
                  f"-> partner's half {to_half:.0f}; partner's send start minus own {np.median(partner):.0f} "
                  f"(10-90 %: {np.percentile(partner, 10):.0f} .. {np.percentile(partner, 90):.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", help="a sparse_mla benchmark shape (mla-v32-h128, ...), or with topk an "
                                  "indexer_topk one whose kernel is the resident one (topk-v32-fp8)")
    ap.add_argument("which", nargs="?", default="fwd", choices=("fwd", "bwd", "bwd-det", "topk"))
    ap.add_argument("--save", help="also keep the marks here (npz)")
    ap.add_argument("--load", help="report the marks saved here (npz, --save's) instead of running")
    a = ap.parse_args()
    if a.load:
        if a.save:
            sys.exit("--save keeps the marks of a run; --load reports saved ones")
        saved = np.load(a.load)
        marks = saved["marks"]
        steps = marks.shape[2]
        if "layout" not in saved:
            sys.exit(f"{a.load} holds no event layout: report it with the tools/timeline.py of the tree that made it")
        if str(saved["which"]) != a.which or str(saved["layout"]) != event_layout(a.which):
            sys.exit(f"{a.load} holds {saved['which']} marks of a tree whose events differ from this one's "
                     f"({a.which}): report them with that tree's tools/timeline.py")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "marks.bin")
            steps = run(a.shape, a.which, path)
            if not os.path.exists(path):
                sys.exit("no marks were written: is the extension a timeline build (tools/gpu_check.sh timeline)?")
            marks = np.fromfile(path, np.uint32).reshape(CTAS, ROLES, STEPS, EVENTS)
        if a.which == "topk":
            steps = topk_steps(marks)
        if a.save:
            np.savez_compressed(a.save, marks=marks[:, :, :steps], which=a.which, shape=a.shape,
                                layout=event_layout(a.which))
    print(f"== {a.shape} {a.which}")
    report(marks, steps, a.which)
    if a.which in ("bwd", "bwd-det"):
        report_pairs(marks, steps)


if __name__ == "__main__":
    main()
