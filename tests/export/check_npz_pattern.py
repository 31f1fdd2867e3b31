"""Reads x.npy of a model.npz with Python's zipfile and numpy, as a user
would, without holding it whole: its .npy header says float32 of N
elements, every element holds tests/core/big_tensors.cpp's pattern, and
zipfile checks the member's CRC-32 when it reaches its end; b.npy, the
member after it, is three 0.5 float32. Above 4 GiB the
archive is ZIP64 (sizes and offsets in its extra fields and end records),
which is what this reads then.

    check_npz_pattern.py MODEL_NPZ N
"""
import sys
import zipfile

import numpy as np


def main() -> int:
    path, n = sys.argv[1], int(sys.argv[2])
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("x.npy")
        with z.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version != (1, 0):
                raise SystemExit(f"check_npz_pattern: .npy version {version}")
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            if shape != (n,) or fortran or dtype != np.dtype("<f4"):
                raise SystemExit(f"check_npz_pattern: x.npy is {shape} {dtype}, expected ({n},) float32")
            at = 0
            while True:
                block = f.read(1 << 24)
                if not block:
                    break
                got = np.frombuffer(block, dtype="<u4")
                i = np.arange(at, at + got.size, dtype=np.uint64)
                want = (((i >> 30) & 1) << 31) | ((64 + ((i >> 23) & 127)) << 23) | (i & 0x7FFFFF)
                bad = np.flatnonzero(got != want.astype(np.uint32))
                if bad.size:
                    raise SystemExit(f"check_npz_pattern: element {at + bad[0]} differs ({bad.size} in its block)")
                at += got.size
            if at != n:
                raise SystemExit(f"check_npz_pattern: {at} elements, expected {n}")
        # The member after it (at an offset above 4 GiB in the largest case).
        b = np.lib.format.read_array(z.open("b.npy"))
        if b.dtype != np.dtype("<f4") or b.tolist() != [0.5, 0.5, 0.5]:
            raise SystemExit(f"check_npz_pattern: b.npy is {b!r}, expected three 0.5 float32")
    zip64 = info.file_size >= 0xFFFFFFFF
    print(f"check_npz_pattern: zipfile and numpy read x.npy whole ({info.file_size} bytes"
          f"{', ZIP64' if zip64 else ''}), CRC-32 checked, every element as written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
