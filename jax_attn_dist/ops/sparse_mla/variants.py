"""The compiled variants of the sparse MLA forward kernel: the one list that
drives the instantiations (CMake generates one instantiation per entry),
the launcher's dispatch (a generated X-macro list) and the coverage that
Python reads (``contract.KERNEL_HEAD_DIMS``).

Plain data with no imports: CMake runs this file with the build's Python.

Each entry is ``(D, head_tile)``: the feature size of q and kv (MLA: 512
latent, +64 rope; the value part is the first 512) and the heads one CTA
holds. The launcher loops over head tiles for larger H and masks the last
partial tile.
"""

KERNEL_VARIANTS = ((512, 64), (576, 64))

if __name__ == "__main__":  # for CMake: one "D,head_tile" entry per line
    print("\n".join(",".join(str(x) for x in v) for v in KERNEL_VARIANTS))
