"""Zero the CUDA machine code a shared library carries for every GPU architecture but the ones kept.

Why: Transformer Engine's core library is 343 MB, 264 MB of it the .nv_fatbin section holding one
cubin per architecture (sm_75 ... sm_120). The device tool carries 64 MiB a call, so the wheel takes
five calls on a machine that stays warm only 30 s between them. Zeroing the other architectures'
payloads in place keeps every offset and size in the ELF file, so the library loads as before on the
kept architecture, and the zeros compress to nothing: the H200 needs sm_90 only.

Fatbin layout (as read from the file; NVIDIA does not document it): a container header
(u32 magic 0xBA55ED50, u16 version, u16 header size, u64 payload size) followed by entries, each a
header (u16 kind: 1 PTX / 2 ELF, u16 version, u32 header size, u32 padded payload size, ...,
u32 sm at byte 28) followed by its payload.

    python tools/device/fatbin_keep_arch.py LIB.so OUT.so --keep 90
"""

from __future__ import annotations

import argparse
import struct
import subprocess
from collections import Counter

_MAGIC = 0xBA55ED50


def section(path: str, name: str) -> tuple[int, int]:
    out = subprocess.check_output(["readelf", "-S", "-W", path], text=True)
    for line in out.splitlines():
        if f" {name} " in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path}: no {name} section")


def keep_arch(data: bytearray, start: int, size: int, keep: set[int]) -> tuple[Counter, Counter]:
    """Zero the payloads of entries whose sm is not in keep; returns bytes kept and zeroed per (kind, sm)."""
    kept, zeroed = Counter(), Counter()
    pos, end = start, start + size
    while pos < end:
        magic, _, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != _MAGIC:
            pos += 8  # containers are 8-byte aligned with zero padding between them
            continue
        e, stop = pos + hsz, pos + hsz + fsz
        while e < stop:
            kind, _, ehsz, padded = struct.unpack_from("<HHII", data, e)
            sm = struct.unpack_from("<I", data, e + 28)[0]
            if sm in keep:
                kept[(kind, sm)] += padded
            else:
                data[e + ehsz : e + ehsz + padded] = bytes(padded)
                zeroed[(kind, sm)] += padded
            e += ehsz + padded
        pos = stop
    return kept, zeroed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib")
    ap.add_argument("out")
    ap.add_argument("--keep", default="90", help="comma-separated sm numbers to keep (default 90)")
    a = ap.parse_args()
    start, size = section(a.lib, ".nv_fatbin")
    data = bytearray(open(a.lib, "rb").read())
    kept, zeroed = keep_arch(data, start, size, {int(s) for s in a.keep.split(",")})
    with open(a.out, "wb") as f:
        f.write(data)
    print(f"kept {sum(kept.values()) / 1e6:.1f} MB {sorted(kept)}; zeroed {sum(zeroed.values()) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
