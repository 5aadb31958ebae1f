"""Run a few kernel cases for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    compute-sanitizer --tool racecheck --kernel-name kns=attn_dist_kernel python tests/support/sanitizer_run.py attn_dist
    compute-sanitizer --tool racecheck --kernel-name kns=indexer_fwd_kernel python tests/support/sanitizer_run.py indexer
    compute-sanitizer --tool racecheck --kernel-name kns=indexer_bwd_kernel python tests/support/sanitizer_run.py indexer_bwd
    compute-sanitizer --tool memcheck python tests/support/sanitizer_run.py indexer_bwd_det
    compute-sanitizer --tool memcheck python tests/support/sanitizer_run.py packed
    compute-sanitizer --tool memcheck --padding 1048576 python tests/support/sanitizer_run.py ranges
    compute-sanitizer --tool racecheck --kernel-name kns=sparse_mla_fwd_kernel python tests/support/sanitizer_run.py sparse_mla
    compute-sanitizer --tool synccheck --kernel-name kns=indexer_topk python tests/support/sanitizer_run.py indexer_topk
    compute-sanitizer --tool memcheck python tests/support/sanitizer_run.py sparse_mla_bwd

attn_dist: partial T, partial H, both head tiles, both D, batched, all-invalid.
indexer: every head-tile variant (16, 32, 64, 4 x 64), both DI, partial T,
batched, all-invalid, T = 0. indexer_bwd: the backward kernel on the
indexer cases it serves (HI <= 64) plus hot duplicated keys; indexer_bwd_det:
the same cases in deterministic mode (its row-bound, main and conversion
kernels). packed: SPEC §6 on all three kernels (packed_kernel_cases.py's
checks, which packing/test_gpu.py runs too): raw adversarial row ranges
(out-of-range and inverted key ranges, lengths of 0, on block edges and
past T) and packed calls with malformed cu_seqlens (decreasing, past S or
N, int32 extremes), no sequences, and per-row topk_length (rows with no
live block). ranges: every kernel (attn_dist, the indexer's forward, its
backward in both modes) on SPEC §6 row ranges far past N, below 0,
inverted, with lengths far past T or negative, and indices inside those
ranges but past N, checked against the clamp rule and the oracle
(packed_kernel_cases.py, far=True), with the key operand (k, index_k) in a
cudaMalloc of its exact size (through CuPy, which this mode needs) rather
than in XLA's pooled memory, where memcheck does not see a read past a
buffer's end; most cases have B = 1, so that memcheck reports any read of
a key row past N - 1 or before row 0. sparse_mla: its forward kernel (B 2,
S 8, H 128, both D) on adversarial indices (negative, >= N, INT32_MIN/MAX,
duplicates), rows with no valid slot and a first batch element whose first
rows see no key, and a packed call with cu_seqlens (padding rows) and
topk_length, checked against the float64 oracle. indexer_topk: the kernel
(HI 64, DI 128, B 2, S 9) on N 9000 without the causal rule (more than one
8192-key chunk per row: the multi-pass kernel, streaming at topk 64 and 2048,
radix passes at 3600) and N 300 causal with per-batch
q_start (rows with no key, rows with fewer keys than topk), topk 64 and
2048, and packed calls (a sequence of more than 8192 keys, padding rows),
and the float8 variant on one chunk and several, and on 300 pairs (the
resident kernel, several pairs per CTA), each row checked under
SPEC 9.3's rule. sparse_mla_bwd: the backward's
kernels (row terms, main, and the deterministic mode's bound and
conversion) on adversarial indices, rows with no valid slot and partial
head tiles, both D and both modes, gradients checked against the float64
oracle. sharded_steps: sparse_mla's and the indexer's deterministic
backward as a row-sharded call runs it per shard (bound, fixed-point sums
as limbs, their conversion), against the one call's bits. Exits non-zero if
a result is wrong.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import attn_dist_cases
import indexer_cases
import packed_kernel_cases
import sparse_mla_cases
import topk_inputs
from inputs import seed_of
from jax_attn_dist import indexer_topk, oracle
from packed_cases import CASES as PACKED_CASES

ATTN_DIST = [
    attn_dist_cases.Case(S=2, H=128, T=2048, D=576, N=3000, invalid_fraction=0.3, seed=1),   # full blocks, 2 groups
    attn_dist_cases.Case(S=3, H=96, T=200, D=576, N=500, B=3, per_batch_q_start=True, seed=2),  # 96-head tile, batched
    attn_dist_cases.Case(S=2, H=16, T=65, D=512, N=100, k_stride=4, lse_base="e", seed=3),   # tiny H, one slot past
    attn_dist_cases.Case(S=2, H=64, T=2049, D=512, N=5000, causal=False, seed=4),            # 64-head tile, T odd
    attn_dist_cases.Case(S=4, H=1, T=1, D=576, N=10, B=1, seed=5),                           # minimal
    attn_dist_cases.Case(S=2, H=192, T=127, D=576, N=300, invalid_fraction=1.0, seed=6),     # 2 head tiles, all invalid
    attn_dist_cases.Case(S=64, H=128, T=512, D=576, N=8192, invalid_fraction=0.1, seed=7),   # mid-size
    # More CTAs than SMs, so each asks L2 for its successor's rows (HT = 128
    # with a partial second head tile, across the batch boundary).
    attn_dist_cases.Case(S=150, H=160, T=130, D=576, N=700, B=2, per_batch_q_start=True, seed=8),
    # The 96-head tile with a partial second group, more CTAs than SMs.
    attn_dist_cases.Case(S=300, H=72, T=200, D=512, N=900, causal=False, seed=9),
]

INDEXER = [
    indexer_cases.Case(S=3, HI=64, T=2048, DI=128, N=8192, invalid_fraction=0.1, seed=1),  # V3.2's shape, full T
    indexer_cases.Case(S=4, HI=16, T=200, DI=64, N=300, B=3, per_batch_q_start=True, seed=2),  # HT 16, batched
    indexer_cases.Case(S=3, HI=20, T=65, DI=128, N=100, k_stride=4, seed=3),              # HT 32, partial heads
    indexer_cases.Case(S=2, HI=200, T=129, DI=128, N=500, causal=False, seed=4),           # 4 head tiles of 64
    indexer_cases.Case(S=2, HI=64, T=64, DI=64, N=50, invalid_fraction=1.0, seed=5),      # all invalid
    indexer_cases.Case(S=3, HI=1, T=0, DI=128, N=10, seed=6),                             # T = 0
    indexer_cases.Case(S=48, HI=64, T=512, DI=128, N=4096, seed=7),                       # mid-size
    # More rows than resident CTAs (396 and 264 on an H100): CTAs prefetch
    # their successors' rows, across a batch boundary and past the last row.
    indexer_cases.Case(S=500, HI=64, T=130, DI=128, N=600, B=2, per_batch_q_start=True, invalid_fraction=0.3, seed=8),
    indexer_cases.Case(S=300, HI=130, T=70, DI=64, N=200, seed=9),
]

INDEXER_BWD = [c for c in INDEXER if c.HI <= 64] + [
    indexer_cases.Case(S=16, HI=32, T=256, DI=64, N=4, causal=False, invalid_fraction=0.0, seed=8),  # hot duplicates
]

class Named:
    """A named check without arguments (the packed mode's test functions)."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn


def packed_checks():
    pkc = packed_kernel_cases
    checks = [Named("raw-ranges-attn_dist-h64",
                    functools.partial(pkc.check_attn_dist_kernel_on_raw_row_ranges, 64, 576, 48)),
              Named("raw-ranges-attn_dist-h130-d512",
                    functools.partial(pkc.check_attn_dist_kernel_on_raw_row_ranges, 130, 512, 48)),
              # Several waves of CTAs (1200): rows with no, one and several blocks on each SM.
              Named("raw-ranges-attn_dist-h64-waves",
                    functools.partial(pkc.check_attn_dist_kernel_on_raw_row_ranges, 64, 576, 600)),
              Named("raw-ranges-indexer",
                    functools.partial(pkc.check_indexer_kernels_on_raw_row_ranges, False, 64, 128)),
              Named("raw-ranges-indexer-det-h16",
                    functools.partial(pkc.check_indexer_kernels_on_raw_row_ranges, True, 16, 64)),
              Named("no-row-ranges", pkc.check_calls_without_row_ranges)]
    for case in PACKED_CASES:
        if case["name"] in ("bad-decreasing-q", "bad-k-past-N", "bad-extremes", "no-sequences", "topk-packed"):
            checks.append(Named(f"attn_dist-{case['name']}",
                                functools.partial(pkc.check_attn_dist_kernel_on_packed_inputs, case)))
            checks.append(Named(f"indexer-{case['name']}",
                                functools.partial(pkc.check_indexer_kernels_on_packed_inputs, case, False)))
    return checks


def ranges_checks():
    """Every kernel on far-out row ranges (packed_kernel_cases, far=True),
    its key operand in an allocation of its exact size."""
    pkc = packed_kernel_cases
    pkc.EXACT_KEY_ALLOCATIONS = True
    checks = []
    for H, D, S, B, N in [(64, 576, 64, 1, 37), (130, 512, 64, 1, 300), (96, 512, 48, 1, 1),
                          (128, 576, 64, 2, 100), (64, 576, 600, 1, 500)]:  # the last: several waves of CTAs
        checks.append(Named(f"ranges-attn_dist-h{H}-d{D}-s{S}-b{B}-n{N}",
                            functools.partial(pkc.check_attn_dist_kernel_on_raw_row_ranges, H, D, S, B=B, N=N,
                                              far=True)))
    for HI, DI, S, B, N in [(64, 128, 40, 1, 37), (16, 64, 40, 2, 100), (32, 64, 48, 1, 1), (64, 64, 300, 1, 200)]:
        for deterministic in (False, True):  # the forward kernel, then the backward in this mode
            checks.append(Named(f"ranges-indexer-hi{HI}-di{DI}-s{S}-b{B}-n{N}-det{int(deterministic)}",
                                functools.partial(pkc.check_indexer_kernels_on_raw_row_ranges, deterministic, HI,
                                                  DI, S=S, B=B, N=N, far=True)))
    return checks


def sparse_mla_call(q, kv, idx, kw, **packing):
    """sparse_mla on the kernel (jit, array keywords traced), checked against
    the float64 oracle (SPEC 8.2's tolerances)."""
    out, lse = jax.block_until_ready(sparse_mla_cases.run(q, kv, idx, dict(kw, implementation="cuda"), **packing))
    sparse_mla_cases.check_against_oracle(q, kv, idx, kw, out, lse, out_tol=oracle.SPARSE_MLA_OUT_TOLERANCE,
                                          lse_tol=oracle.SPARSE_MLA_LSE_TOLERANCE, **packing)


def sparse_mla_packed(D):
    """One unbatched packed call: 3 sequences (rows 14.. are padding), per-row
    topk_length from below 0 to past T, adversarial indices."""
    S, N, T = 16, 300, 130
    q, kv, idx, kw = sparse_mla_cases.make_sparse_mla_inputs(seed_of("sanitize-mla-packed", D), S=S, H=128, D=D,
                                                             N=N, T=T, invalid_fraction=0.3, empty_rows=0.1)
    rng = np.random.default_rng(seed_of("sanitize-mla-packed-topk", D))
    packing = dict(cu_seqlens_q=jnp.asarray([0, 5, 12, 14], jnp.int32),
                   cu_seqlens_k=jnp.asarray([0, 100, 250, 300], jnp.int32),
                   topk_length=jnp.asarray(rng.integers(-3, T + 10, (S,)), jnp.int32))
    sparse_mla_call(q, kv, idx, dict(kw, q_start_index=jnp.asarray([0, 40, 7], jnp.int32)), **packing)


def sparse_mla_checks():
    checks = []
    for D, causal in ((576, True), (512, False)):
        def case(D=D, causal=causal):
            # B 2, S 8, H 128, N 300, T 130: adversarial indices (30 % of the slots, every kind), a quarter of
            # the rows with no valid slot, the first batch element starting at q_start -2
            q, kv, idx, kw = sparse_mla_cases.make_sparse_mla_inputs(
                seed_of("sanitize-mla", D, causal), B=2, S=8, H=128, D=D, N=300, T=130, causal=causal,
                q_start_index="batch", invalid_fraction=0.3, empty_rows=0.25)
            sparse_mla_call(q, kv, idx, kw)
        checks.append(Named(f"sparse_mla-b2-s8-h128-d{D}-n300-t130-c{int(causal)}", case))
    checks.append(Named("sparse_mla-all-invalid", sparse_mla_all_invalid))
    checks.append(Named("sparse_mla-packed-topk_length-d576", functools.partial(sparse_mla_packed, 576)))
    return checks


def sparse_mla_all_invalid():
    """Every slot invalid (every kind of bad index): out 0, lse -inf."""
    q, kv, idx, kw = sparse_mla_cases.make_sparse_mla_inputs(seed_of("sanitize-mla-empty"), B=2, S=8, H=128,
                                                             D=576, N=300, T=130, invalid_fraction=1.0)
    out, lse = jax.block_until_ready(sparse_mla_cases.run(q, kv, idx, dict(kw, implementation="cuda")))
    assert np.all(np.asarray(out, np.float32) == 0.0), "all-invalid rows: out must be 0"
    assert np.isneginf(np.asarray(lse)).all(), "all-invalid rows: lse must be -inf"


def sparse_mla_bwd_checks():
    """The backward kernels in both modes: B 2, S 8, H 128 (two head tiles)
    and H 65 (a partial one), both paired, with D 576 and 512, and H 40
    (one tile, the unpaired kernel) with D 576; adversarial indices and rows with no
    valid slot, a first batch element whose first rows see no key, and a
    packed call with topk_length; gradients against the float64 oracle."""
    checks = []
    for D, H, causal in ((576, 128, True), (512, 65, False), (576, 40, True)):
        for det in (False, True):
            def case(D=D, H=H, causal=causal, det=det):
                q, kv, idx, kw = sparse_mla_cases.make_sparse_mla_inputs(
                    seed_of("sanitize-mla-bwd", D, causal), B=2, S=8, H=H, D=D, N=300, T=130, causal=causal,
                    q_start_index="batch", invalid_fraction=0.3, empty_rows=0.25)
                sparse_mla_cases.check_kernel_grads(q, kv, idx, kw, deterministic=det)
            checks.append(Named(f"sparse_mla_bwd-b2-s8-h{H}-d{D}-c{int(causal)}-det{int(det)}", case))
    return checks


def sharded_steps_checks():
    """The deterministic backwards' per-shard steps for sharded rows (bound,
    fixed-point sums as limbs, their conversion), on one GPU against the one
    call's bits: sparse_mla's and the indexer's."""
    return [Named("sparse_mla_bwd-sharded-steps", lambda: sparse_mla_cases.check_sharded_steps(
                seed_of("sanitize-mla-steps"), S=8, N=300, T=130)),
            Named("indexer_bwd-sharded-steps", lambda: indexer_cases.check_sharded_steps(
                seed_of("sanitize-indexer-steps"), S=8, N=300, T=130))]


def indexer_topk_call(topk, iq, ik, w, kw, **packing):
    """indexer_topk on the kernel (jit, q_start_index traced), every row
    checked under SPEC 9.3's rule against the float64 logits."""
    kw = dict(kw)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    f = jax.jit(lambda a, b, c, s, p: indexer_topk(a, b, c, topk=topk, q_start_index=s, implementation="cuda",
                                                   **kw, **p))
    got = jax.block_until_ready(f(iq, ik, w, qs, packing))
    host = {k: np.asarray(v) for k, v in packing.items()}
    topk_inputs.check_selection(got, iq, ik, w, dict(kw, q_start_index=np.asarray(qs)), topk,
                                topk_inputs.kernel_band(iq.dtype), **host)


def indexer_topk_checks():
    HI, DI = 64, 128
    checks = []
    # bf16 on both paths and both topk; the float8 variant on one chunk and several. N 9000 with topk
    # 64 and 2048 streams (checkpoints every 1024 keys); topk 3600 takes the radix passes instead.
    unpacked = [(N, causal, topk, "") for N, causal in ((9000, False), (300, True)) for topk in (64, 2048)]
    unpacked += [(9000, False, 2048, "-fp8"), (300, True, 64, "-fp8"), (9000, False, 3600, "")]
    for N, causal, topk, fp8 in unpacked:
        def case(N=N, causal=causal, topk=topk, fp8=fp8):
            # causal: the first element's rows see 0 to 6 keys (rows 0-2 none), the second's 151 to 159
            iq, ik, w, kw = topk_inputs.make_topk_inputs(
                seed_of(f"sanitize-topk{fp8}", N, causal), B=2, S=9, HI=HI, DI=DI, N=N, causal=causal,
                dtype=topk_inputs.FP8 if fp8 else jnp.bfloat16,
                q_start_index=np.asarray([-3, 150], np.int32) if causal else 0)
            indexer_topk_call(topk, iq, ik, w, kw)
        checks.append(Named(f"indexer_topk{fp8}-b2-s9-n{N}-c{int(causal)}-k{topk}", case))
    for causal, topk in ((False, 2048), (True, 64)):
        def packed(causal=causal, topk=topk):
            # rows 7 and 8 are padding; the third sequence has 8800 keys (more than one chunk), its rows
            # see 8701 to 8703 of them under the causal rule
            iq, ik, w, kw = topk_inputs.make_topk_inputs(seed_of("sanitize-topk-packed", causal), S=9, HI=HI,
                                                         DI=DI, N=9000, causal=causal)
            kw = dict(kw, q_start_index=np.asarray([0, 50, 8700], np.int32))
            indexer_topk_call(topk, iq, ik, w, kw, cu_seqlens_q=jnp.asarray([0, 3, 4, 7], jnp.int32),
                              cu_seqlens_k=jnp.asarray([0, 100, 200, 9000], jnp.int32))
        checks.append(Named(f"indexer_topk-packed-c{int(causal)}-k{topk}", packed))

    for fp8 in ("-fp8", ""):
        def resident_rounds(fp8=fp8):
            # N in one chunk runs the resident kernel: 300 pairs, more than one per SM, the first
            # element's early pairs with no selecting row, the second's rows of 4501 to 4800 keys
            iq, ik, w, kw = topk_inputs.make_topk_inputs(
                seed_of("sanitize-topk-resident") if fp8 else seed_of("sanitize-topk-resident", "bf16"), B=2, S=300,
                HI=HI, DI=DI, N=6000, causal=True, dtype=topk_inputs.FP8 if fp8 else jnp.bfloat16,
                q_start_index=np.asarray([-100, 4500], np.int32))
            indexer_topk_call(64, iq, ik, w, kw)
        checks.append(Named(f"indexer_topk{fp8 or '-bf16'}-resident-b2-s300-n6000-k64", resident_rounds))
    return checks


CHECKS = {
    "attn_dist": (ATTN_DIST, attn_dist_cases.check_case),
    "indexer": (INDEXER, indexer_cases.check_case),
    "indexer_bwd": (INDEXER_BWD, indexer_cases.check_bwd_case),
    "indexer_bwd_det": (INDEXER_BWD, functools.partial(indexer_cases.check_bwd_case, deterministic=True)),
    "packed": (packed_checks, lambda named: named.fn()),
    "ranges": (ranges_checks, lambda named: named.fn()),
    "sparse_mla": (sparse_mla_checks, lambda named: named.fn()),
    "indexer_topk": (indexer_topk_checks, lambda named: named.fn()),
    "sparse_mla_bwd": (sparse_mla_bwd_checks, lambda named: named.fn()),
    "sharded_steps": (sharded_steps_checks, lambda named: named.fn()),
}

if __name__ == "__main__":
    which = sys.argv[1:] or list(CHECKS)
    for name in which:
        cases, check = CHECKS[name]
        for case in cases() if callable(cases) else cases:
            check(case)
            print("ok", name, case.name, flush=True)
    sys.exit(0)
