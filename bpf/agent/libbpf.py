# SPDX-License-Identifier: Apache-2.0
"""A small ctypes layer over the system libbpf (libbpf.so.1, tested with 1.1.2).

Only the calls the agent needs. libbpf 1.x returns NULL or a negative errno and sets errno, so
every wrapper raises BpfError with the OS error text.
"""
from __future__ import annotations

import ctypes
import logging
import os

_lib = ctypes.CDLL(os.environ.get("LIBBPF_SO", "libbpf.so.1"), use_errno=True)

_vp = ctypes.c_void_p
_cp = ctypes.c_char_p


def _sig(name: str, restype, *argtypes) -> None:
    fn = getattr(_lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


_sig("bpf_object__open_file", _vp, _cp, _vp)
_sig("bpf_object__load", ctypes.c_int, _vp)
_sig("bpf_object__close", None, _vp)
_sig("bpf_object__find_program_by_name", _vp, _vp, _cp)
_sig("bpf_object__find_map_by_name", _vp, _vp, _cp)
_sig("bpf_program__set_autoload", ctypes.c_int, _vp, ctypes.c_bool)
_sig("bpf_program__set_expected_attach_type", ctypes.c_int, _vp, ctypes.c_int)
_sig("bpf_program__fd", ctypes.c_int, _vp)
_sig("bpf_program__attach", _vp, _vp)
_sig("bpf_program__attach_cgroup", _vp, _vp, ctypes.c_int)
_sig("bpf_program__attach_uprobe_opts", _vp, _vp, ctypes.c_int, _cp, ctypes.c_size_t, _vp)
_sig("bpf_link__destroy", ctypes.c_int, _vp)
_sig("bpf_map__fd", ctypes.c_int, _vp)
_sig("bpf_map__initial_value", _vp, _vp, ctypes.POINTER(ctypes.c_size_t))
_sig("bpf_map__set_pin_path", ctypes.c_int, _vp, _cp)
_sig("bpf_map__type", ctypes.c_int, _vp)
_sig("bpf_map__key_size", ctypes.c_uint32, _vp)
_sig("bpf_map__value_size", ctypes.c_uint32, _vp)
_sig("bpf_map__max_entries", ctypes.c_uint32, _vp)
_sig("libbpf_set_print", _vp, _vp)
_sig("bpf_map__unpin", ctypes.c_int, _vp, _cp)
_sig("bpf_prog_attach", ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint)
_sig("bpf_prog_detach2", ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
_sig("bpf_map_lookup_elem", ctypes.c_int, ctypes.c_int, _vp, _vp)
_sig("bpf_map_delete_elem", ctypes.c_int, ctypes.c_int, _vp)
_sig("bpf_map_update_elem", ctypes.c_int, ctypes.c_int, _vp, _vp, ctypes.c_uint64)
_sig("bpf_map_get_next_key", ctypes.c_int, ctypes.c_int, _vp, _vp)
_sig("libbpf_num_possible_cpus", ctypes.c_int)
_sig("bpf_obj_get", ctypes.c_int, _cp)
_sig("bpf_obj_get_info_by_fd", ctypes.c_int, ctypes.c_int, _vp, ctypes.POINTER(ctypes.c_uint32))
_sig("bpf_program__attach_iter", _vp, _vp, _vp)
_sig("bpf_program__attach_raw_tracepoint", _vp, _vp, _cp)
_sig("bpf_link__fd", ctypes.c_int, _vp)
_sig("bpf_link__pin", ctypes.c_int, _vp, _cp)
_sig("bpf_iter_create", ctypes.c_int, ctypes.c_int)
_sig("bpf_prog_get_next_id", ctypes.c_int, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32))
_sig("bpf_prog_get_fd_by_id", ctypes.c_int, ctypes.c_uint32)
_sig("bpf_map_get_fd_by_id", ctypes.c_int, ctypes.c_uint32)

# enum bpf_attach_type, enum bpf_map_type (include/uapi/linux/bpf.h)
BPF_SK_MSG_VERDICT = 7
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_SOCKHASH = 18
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
BPF_LINK_CREATE = 28  # enum bpf_cmd
_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)


class BpfError(OSError):
    pass


def _raise(what: str, err: int | None = None) -> None:
    err = abs(err) if err else ctypes.get_errno()
    raise BpfError(err, f"{what}: {os.strerror(err)}")


class _UprobeOpts(ctypes.Structure):
    # struct bpf_uprobe_opts as of libbpf 1.1; sz tells newer libbpf which fields we know.
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("ref_ctr_offset", ctypes.c_size_t),
        ("bpf_cookie", ctypes.c_uint64),
        ("retprobe", ctypes.c_bool),
        ("func_name", ctypes.c_char_p),
    ]


# libbpf's messages (verifier logs, attach errors) go to Python logging, not to raw stderr.
_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_libc = ctypes.CDLL(None)
_libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}  # enum libbpf_print_level
_liblog = logging.getLogger("libbpf")


@_PRINT_FN
def _print(level: int, fmt: bytes, args: int) -> int:
    buf = ctypes.create_string_buffer(4096)
    n = _libc.vsnprintf(buf, len(buf), fmt, args)
    _liblog.log(_LEVELS.get(level, logging.DEBUG), "%s", buf.value.decode(errors="replace").rstrip())
    return n


def route_log_to_logging() -> None:
    _lib.libbpf_set_print(ctypes.cast(_print, _vp))


def num_possible_cpus() -> int:
    n = _lib.libbpf_num_possible_cpus()
    if n <= 0:
        _raise("libbpf_num_possible_cpus", n)
    return n


class Link:
    """A bpf_link (destroyed on detach), a link fd made with BPF_LINK_CREATE (closed), or a legacy
    prog->target attachment (detached)."""

    def __init__(self, name: str, ptr: int | None = None, legacy: tuple[int, int, int] | None = None,
                 fd: int | None = None):
        self.name, self._ptr, self._legacy, self._fd = name, ptr, legacy, fd

    def pin(self, path: str) -> None:
        """Pin in bpffs: the attachment then outlives this process (destroy() only closes our fd)."""
        err = _lib.bpf_link__pin(self._ptr, path.encode())
        if err:
            _raise(f"pin {self.name} at {path}", err)

    def destroy(self) -> None:
        if self._ptr:
            _lib.bpf_link__destroy(self._ptr)
            self._ptr = None
        if self._legacy:
            _lib.bpf_prog_detach2(*self._legacy)
            self._legacy = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _UprobeMultiAttr(ctypes.Structure):
    # union bpf_attr's link_create with its uprobe_multi member (include/uapi/linux/bpf.h, Linux
    # 6.6+; checked against this kernel's BTF in tests/kernel/test_cudalat_sampling.py).
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("multi_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


_libc_bpf = ctypes.CDLL(None, use_errno=True)
_libc_bpf.syscall.restype = ctypes.c_long


class Map:
    def __init__(self, ptr: int, name: str):
        self._ptr, self.name = ptr, name

    @property
    def fd(self) -> int:
        return _lib.bpf_map__fd(self._ptr)

    def layout(self) -> tuple[str, int, int, int, int]:
        """(name, type, key size, value size, max entries) as the object defines them."""
        return (self.name, _lib.bpf_map__type(self._ptr), _lib.bpf_map__key_size(self._ptr),
                _lib.bpf_map__value_size(self._ptr), _lib.bpf_map__max_entries(self._ptr))

    def set_pin_path(self, path: str) -> None:
        err = _lib.bpf_map__set_pin_path(self._ptr, path.encode())
        if err:
            _raise(f"pin path {path}", err)

    def unpin(self) -> None:
        _lib.bpf_map__unpin(self._ptr, None)

    def initial_value(self) -> tuple[int, int]:
        size = ctypes.c_size_t()
        ptr = _lib.bpf_map__initial_value(self._ptr, ctypes.byref(size))
        if not ptr:
            _raise(f"initial value of {self.name}")
        return ptr, size.value

    def write_initial(self, data: bytes) -> None:
        """Overwrite the start of a .rodata/.data map before load."""
        ptr, size = self.initial_value()
        if len(data) > size:
            raise ValueError(f"{self.name}: {len(data)} bytes do not fit in {size}")
        ctypes.memmove(ptr, data, len(data))

    def keys(self, key_size: int) -> list[bytes]:
        out, cur = [], None
        nxt = ctypes.create_string_buffer(key_size)
        while True:
            err = _lib.bpf_map_get_next_key(self.fd, cur, nxt)
            if err:
                return out
            out.append(nxt.raw)
            cur = ctypes.create_string_buffer(nxt.raw, key_size)

    def lookup(self, key: bytes, value_size: int) -> bytes | None:
        kbuf = ctypes.create_string_buffer(key, len(key))
        vbuf = ctypes.create_string_buffer(value_size)
        if _lib.bpf_map_lookup_elem(self.fd, kbuf, vbuf):
            return None
        return vbuf.raw

    def update(self, key: bytes, value: bytes) -> None:
        kbuf = ctypes.create_string_buffer(key, len(key))
        vbuf = ctypes.create_string_buffer(value, len(value))
        err = _lib.bpf_map_update_elem(self.fd, kbuf, vbuf, 0)
        if err:
            _raise(f"update {self.name}", err)

    def delete(self, key: bytes) -> bool:
        kbuf = ctypes.create_string_buffer(key, len(key))
        return _lib.bpf_map_delete_elem(self.fd, kbuf) == 0

    def items(self, key_size: int, value_size: int) -> list[tuple[bytes, bytes]]:
        out = []
        for k in self.keys(key_size):
            v = self.lookup(k, value_size)
            if v is not None:
                out.append((k, v))
        return out


class PinnedMap:
    """A map opened by its pin path or its id (no object file needed): what --uninstall empties."""

    def __init__(self, path: str = "", map_id: int = 0):
        self.path = path or f"map id {map_id}"
        self.fd = _lib.bpf_obj_get(path.encode()) if path else _lib.bpf_map_get_fd_by_id(map_id)
        if self.fd < 0:
            _raise(f"open {self.path}")
        # struct bpf_map_info: type, id, key_size, value_size, max_entries, map_flags, name[16]
        info = ctypes.create_string_buffer(128)
        size = ctypes.c_uint32(len(info))
        err = _lib.bpf_obj_get_info_by_fd(self.fd, info, ctypes.byref(size))
        if err:
            os.close(self.fd)
            _raise(f"map info {self.path}", err)
        self.type = int.from_bytes(info.raw[0:4], "little")
        self.id = int.from_bytes(info.raw[4:8], "little")
        self.key_size = int.from_bytes(info.raw[8:12], "little")
        self.value_size = int.from_bytes(info.raw[12:16], "little")
        self.name = info.raw[24:40].split(b"\0", 1)[0].decode()

    def keys(self) -> list[bytes]:
        out, cur, nxt = [], None, ctypes.create_string_buffer(self.key_size)
        while _lib.bpf_map_get_next_key(self.fd, cur, nxt) == 0:
            out.append(nxt.raw)
            cur = ctypes.create_string_buffer(nxt.raw, self.key_size)
        return out

    def lookup(self, key: bytes) -> bytes | None:
        vbuf = ctypes.create_string_buffer(self.value_size)
        if _lib.bpf_map_lookup_elem(self.fd, ctypes.create_string_buffer(key, len(key)), vbuf):
            return None
        return vbuf.raw

    def delete(self, key: bytes) -> bool:
        return _lib.bpf_map_delete_elem(self.fd, ctypes.create_string_buffer(key, len(key))) == 0

    def clear(self) -> int:
        """Deletes every entry; returns how many went."""
        n, key = 0, ctypes.create_string_buffer(self.key_size)
        while _lib.bpf_map_get_next_key(self.fd, None, key) == 0:
            if _lib.bpf_map_delete_elem(self.fd, key):
                _raise(f"delete from {self.path}")
            n += 1
        return n

    def close(self) -> None:
        os.close(self.fd)


class Program:
    def __init__(self, ptr: int, name: str):
        self._ptr, self.name = ptr, name

    @property
    def fd(self) -> int:
        return _lib.bpf_program__fd(self._ptr)

    def set_autoload(self, on: bool) -> None:
        err = _lib.bpf_program__set_autoload(self._ptr, on)
        if err:
            _raise(f"autoload {self.name}", err)

    def attach(self) -> Link:
        """Attach by SEC() name (tracepoints, fentry)."""
        ptr = _lib.bpf_program__attach(self._ptr)
        if not ptr:
            _raise(f"attach {self.name}")
        return Link(self.name, ptr=ptr)

    def attach_cgroup(self, cgroup_path: str) -> Link:
        fd = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            ptr = _lib.bpf_program__attach_cgroup(self._ptr, fd)
            if not ptr:
                _raise(f"attach {self.name} to cgroup {cgroup_path}")
        finally:
            os.close(fd)
        return Link(self.name, ptr=ptr)

    def attach_raw_tracepoint(self, name: str) -> Link:
        ptr = _lib.bpf_program__attach_raw_tracepoint(self._ptr, name.encode())
        if not ptr:
            _raise(f"attach {self.name} to raw tracepoint {name}")
        return Link(self.name, ptr=ptr)

    def iterate(self) -> bytes:
        """Runs an iterator program (iter/tcp, ...) once, in the calling thread's namespaces;
        returns what it wrote (bpf_seq_write)."""
        ptr = _lib.bpf_program__attach_iter(self._ptr, None)
        if not ptr:
            _raise(f"attach iterator {self.name}")
        try:
            fd = _lib.bpf_iter_create(_lib.bpf_link__fd(ptr))
            if fd < 0:
                _raise(f"iterate {self.name}", fd)
            try:
                chunks = []
                while chunk := os.read(fd, 65536):
                    chunks.append(chunk)
                return b"".join(chunks)
            finally:
                os.close(fd)
        finally:
            _lib.bpf_link__destroy(ptr)

    def attach_to_map(self, m: Map, attach_type: int) -> Link:
        err = _lib.bpf_prog_attach(self.fd, m.fd, attach_type, 0)
        if err:
            _raise(f"attach {self.name} to map {m.name}", err)
        return Link(self.name, legacy=(self.fd, m.fd, attach_type))

    def set_expected_attach_type(self, attach_type: int) -> None:
        err = _lib.bpf_program__set_expected_attach_type(self._ptr, attach_type)
        if err:
            _raise(f"expected attach type of {self.name}", err)

    def attach_uprobe_multi(self, binary: str, offsets: list[int], cookies: list[int], retprobe: bool) -> Link:
        """One link holding a uprobe (or uretprobe) at each file offset, each with its cookie, in
        every process (BPF_LINK_CREATE with BPF_TRACE_UPROBE_MULTI, Linux 6.6+; libbpf 1.1 has no
        wrapper). The program must have been loaded with that expected attach type. Closing the link
        unregisters all of them with one wait for the kernel's grace periods, where a link per
        uprobe waits once each."""
        if _SYS_BPF is None:
            raise BpfError(38, f"attach {self.name}: bpf() syscall number unknown for {os.uname().machine}")
        path = ctypes.create_string_buffer(binary.encode())
        offs = (ctypes.c_uint64 * len(offsets))(*offsets)
        cks = (ctypes.c_uint64 * len(cookies))(*cookies)
        attr = _UprobeMultiAttr(prog_fd=self.fd, attach_type=BPF_TRACE_UPROBE_MULTI,
                                path=ctypes.addressof(path), offsets=ctypes.addressof(offs),
                                cookies=ctypes.addressof(cks), cnt=len(offsets),
                                multi_flags=BPF_F_UPROBE_MULTI_RETURN if retprobe else 0)
        fd = _libc_bpf.syscall(_SYS_BPF, BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
        if fd < 0:
            _raise(f"attach {self.name} to {binary} ({len(offsets)} uprobe{'s' if len(offsets) != 1 else ''})")
        return Link(f"{self.name}:{binary}", fd=int(fd))

    def attach_uprobe(self, binary: str, symbol: str, retprobe: bool, cookie: int, pid: int = -1) -> Link:
        opts = _UprobeOpts(sz=ctypes.sizeof(_UprobeOpts), bpf_cookie=cookie, retprobe=retprobe,
                           func_name=symbol.encode())
        ptr = _lib.bpf_program__attach_uprobe_opts(self._ptr, pid, binary.encode(), 0, ctypes.byref(opts))
        if not ptr:
            _raise(f"attach {self.name} to {binary}:{symbol}")
        return Link(f"{self.name}:{symbol}", ptr=ptr)


class Object:
    """One opened .bpf.o. Use as a context manager or call close()."""

    def __init__(self, path: str):
        self.path = path
        self._ptr = _lib.bpf_object__open_file(path.encode(), None)
        if not self._ptr:
            _raise(f"open {path}")

    def program(self, name: str) -> Program:
        ptr = _lib.bpf_object__find_program_by_name(self._ptr, name.encode())
        if not ptr:
            raise KeyError(f"{self.path}: no program {name}")
        return Program(ptr, name)

    def map(self, name: str) -> Map:
        ptr = _lib.bpf_object__find_map_by_name(self._ptr, name.encode())
        if not ptr:
            raise KeyError(f"{self.path}: no map {name}")
        return Map(ptr, name)

    def load(self) -> None:
        err = _lib.bpf_object__load(self._ptr)
        if err:
            _raise(f"load {self.path}", err)

    def close(self) -> None:
        if self._ptr:
            _lib.bpf_object__close(self._ptr)
            self._ptr = None

    def __enter__(self) -> "Object":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
