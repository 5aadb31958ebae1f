"""The compiled variants of the indexer_topk kernel: the one list that
drives the instantiations (CMake generates one instantiation per entry),
the launcher's dispatch and the coverage that Python reads
(``contract.kernel_supports``).

Plain data with no imports: CMake runs this file with the build's Python.

Each entry is ``(DI, HI)``: the indexer head dim and the number of indexer
heads the kernel is built for (DeepSeek-V3.2's indexer: DI = 128, HI = 64).
"""

KERNEL_VARIANTS = ((128, 64),)

#: The index_q/index_k dtypes the kernel reads.
KERNEL_DTYPES = ("bfloat16", "float8_e4m3fn")

if __name__ == "__main__":  # for CMake: one "DI,HI" entry per line
    print("\n".join(",".join(str(x) for x in v) for v in KERNEL_VARIANTS))
