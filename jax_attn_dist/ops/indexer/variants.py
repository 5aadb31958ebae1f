"""The compiled variants of the indexer_kl kernels: the one list that drives
the instantiations (CMake generates one instantiation per entry), the
launchers' dispatch (generated X-macro lists) and the coverage that Python
reads (``contract.KERNEL_HEAD_DIMS``, ``KERNEL_MAX_HEADS``,
``BWD_KERNEL_MAX_HEADS``).

Plain data with no imports: CMake runs this file with the build's Python.

* Forward, ``(DI, head_tile, head_tiles)``: the indexer head dim, the WGMMA
  width in heads, and how many such tiles one CTA runs over the same key
  stages (it serves up to ``head_tile * head_tiles`` heads).
* Backward, ``(DI, head_tile, deterministic)``: one head tile;
  ``deterministic`` sums d index_k as exact fixed-point integers.

Each launcher takes, for the call's DI (and mode), the smallest variant that
holds HI.
"""

FWD_KERNEL_VARIANTS = (
    (64, 16, 1), (64, 32, 1), (64, 64, 1), (64, 64, 4),
    (128, 16, 1), (128, 32, 1), (128, 64, 1), (128, 64, 4),
)

BWD_KERNEL_VARIANTS = (
    (64, 16, False), (64, 32, False), (64, 64, False),
    (64, 16, True), (64, 32, True), (64, 64, True),
    (128, 16, False), (128, 32, False), (128, 64, False),
    (128, 16, True), (128, 32, True), (128, 64, True),
)

if __name__ == "__main__":  # for CMake: "fwd|bwd,DI,head_tile,third" per line (bools as 0/1)
    for kind, variants in (("fwd", FWD_KERNEL_VARIANTS), ("bwd", BWD_KERNEL_VARIANTS)):
        for v in variants:
            print(",".join([kind] + [str(int(x)) for x in v]))
