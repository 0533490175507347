# SPDX-License-Identifier: Apache-2.0
"""Find the CUDA libraries that running processes have mapped.

Uprobes attach to an inode, so one attachment per distinct library file covers every process
that maps it. Paths in /proc/<pid>/maps are in the process's mount namespace; the agent opens
them through /proc/<pid>/root (needs hostPID in Kubernetes).
"""
from __future__ import annotations

import os
import re
import struct

# libcudart.so, libcudart.so.12, libcudart.so.12.4.127; libcuda.so.1, ...
_LIB_RE = re.compile(r"/(libcudart|libcuda)\.so(?:\.[0-9.]+)?$")

RUNTIME = "libcudart"
DRIVER = "libcuda"


def parse_maps(text: str) -> set[tuple[str, str]]:
    """{(kind, path)} for the CUDA libraries in one /proc/<pid>/maps text; kind is libcudart or libcuda."""
    found = set()
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6:
            path = fields[5].strip()
            kind = classify(path)
            if kind:
                found.add((kind, path))
    return found


def classify(path: str) -> str | None:
    m = _LIB_RE.search(path)
    return m.group(1) if m else None


def build_id(data: bytes) -> bytes:
    """The NT_GNU_BUILD_ID note of a 64-bit little-endian ELF image (b"" if none)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return b""
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        off, end = p_offset, p_offset + p_filesz
        while off + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, off)
            name_end = off + 12 + ((namesz + 3) & ~3)
            desc = data[name_end:name_end + descsz]
            if ntype == 3 and data[off + 12:off + 12 + namesz] == b"GNU\x00":  # NT_GNU_BUILD_ID
                return desc
            off = name_end + ((descsz + 3) & ~3)
    return b""


def symbol_offsets(path: str, names: set[str] | frozenset[str]) -> dict[str, int]:
    """{name: file offset} of the defined functions among `names` in a 64-bit little-endian ELF
    shared library's .dynsym (what a uprobe needs: the offset in the file, not the address; libbpf
    computes the same, `elf_sym_offset`). Names it does not define are absent."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        f.seek(phoff)
        ph = f.read(phentsize * phnum)
        loads = []
        for i in range(phnum):
            p_type, _flags, p_offset, p_vaddr, _pa, p_filesz = struct.unpack_from("<IIQQQQ", ph, i * phentsize)
            if p_type == 1:  # PT_LOAD
                loads.append((p_vaddr, p_filesz, p_offset))
        f.seek(shoff)
        sh = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", sh, i * shentsize) for i in range(shnum)]
        out: dict[str, int] = {}
        for _name, sh_type, _fl, _addr, offset, size, link, _info, _align, entsize in sections:
            if sh_type != 11 or not entsize:  # SHT_DYNSYM
                continue
            f.seek(offset)
            syms = f.read(size)
            f.seek(sections[link][4])
            strtab = f.read(sections[link][5])
            for j in range(size // entsize):
                st_name, st_info, _other, st_shndx, st_value, _size = struct.unpack_from("<IBBHQQ", syms, j * entsize)
                if st_shndx == 0 or st_info & 0xF != 2 or not st_value:  # undefined, or not STT_FUNC
                    continue
                name = strtab[st_name:strtab.index(b"\0", st_name)].decode(errors="replace")
                if name in names:
                    for vaddr, filesz, off in loads:
                        if vaddr <= st_value < vaddr + filesz:
                            out[name] = st_value - vaddr + off
                            break
    return out


def identity(path: str) -> tuple[int, bytes]:
    """(inode number, build-id): the same file seen through two overlay mounts has a different
    st_dev but the same inode number and build-id, and a uprobe attaches to the file underneath,
    so it is probed once; a different file with the same build-id is a different inode."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
        st = os.fstat(f.fileno())
    return st.st_ino, build_id(head)


def scan(proc: str = "/proc") -> dict[tuple[int, bytes], tuple[str, str]]:
    """{(inode, build-id): (kind, host-openable path)} over every live process in proc."""
    libs: dict[tuple[int, bytes], tuple[str, str]] = {}
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(f"{proc}/{pid}/maps") as f:
                found = parse_maps(f.read())
        except OSError:
            continue
        for kind, path in found:
            host_path = f"{proc}/{pid}/root{path}"
            try:
                ident = identity(host_path)
            except OSError:
                continue
            libs.setdefault(ident, (kind, host_path))
    return libs
