"""Assert that the installed jax_attn_dist extension carries sm_90a kernels.

Reads the CUDA ELF images (EM_CUDA) embedded in the module's fat binary
without needing cuobjdump: each must target SM 90, built with -arch sm_90a.
"""

import importlib.metadata
import struct
import sys

EM_CUDA = 190


def cubin_sm_versions(data: bytes):
    versions, i = [], data.find(b"\x7fELF")
    while i >= 0:
        if len(data) >= i + 52 and data[i + 4] == 2 and struct.unpack_from("<H", data, i + 18)[0] == EM_CUDA:
            versions.append((struct.unpack_from("<I", data, i + 48)[0] >> 8) & 0xFF)
        i = data.find(b"\x7fELF", i + 1)
    return versions


def main() -> int:
    dist = importlib.metadata.distribution("jax_attn_dist")
    paths = [f.locate() for f in dist.files or () if f.name.startswith("_cuda.") and f.suffix in (".so", ".pyd")]
    if not paths:
        print("no compiled extension in the installed jax_attn_dist", file=sys.stderr)
        return 1
    with open(paths[0], "rb") as f:
        data = f.read()
    versions = cubin_sm_versions(data)
    ok = len(versions) >= 4 and set(versions) == {90} and b"-arch sm_90a" in data
    print(f"{paths[0]}: {len(versions)} CUDA ELF images, SM {sorted(set(versions))}, "
          f"sm_90a: {b'-arch sm_90a' in data} -> {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
