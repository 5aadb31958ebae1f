"""The compiled variants of the attn_dist kernel: the one list that drives
the instantiations (CMake generates one instantiation per entry), the
launcher's dispatch (a generated X-macro list) and the coverage that Python
reads (``contract.KERNEL_HEAD_DIMS``).

Plain data with no imports: CMake runs this file with the build's Python.

Each entry is ``(D, head_tile)``: the feature size (MLA: 512 latent, +64
rope) and the heads one CTA holds. The launcher takes, for the call's D, the
smallest head tile that holds H, and the largest tile (looping over head
tiles) past it.
"""

KERNEL_VARIANTS = (
    (512, 64), (512, 96), (512, 128),
    (576, 64), (576, 96), (576, 128),
)

if __name__ == "__main__":  # for CMake: one "D,head_tile" entry per line
    print("\n".join(",".join(str(x) for x in v) for v in KERNEL_VARIANTS))
