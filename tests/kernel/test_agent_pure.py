# SPDX-License-Identifier: Apache-2.0
"""Pure agent logic (no kernel, no root): cgroup resolution, bucket conversion, config, maps scan."""
import os
import re

import pytest
from hypothesis import given, settings, strategies as st

import conftest  # noqa: F401  (puts bpf/ on sys.path)
from agent import config
from agent.cgroups import (Workload, find_cgroup2_mount, parse_cgroup_path, parse_container_log_name,
                           parse_pod_log_dir, resolve)
from agent.cudalibs import parse_maps
from agent.metrics import FIRST_SLOT, LAST_SLOT, log2_to_cumulative

UID = "0b0e4ff6-4b5c-4d1e-9a2f-2f2b8f7e2c11"
CID = "a" * 64


@pytest.mark.parametrize("path", [
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope",
    f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/docker-{CID}.scope",
    f"/kubepods/besteffort/pod{UID}/{CID}",
    f"/kubepods/pod{UID}/crio-{CID}",
])
def test_parse_kubelet_cgroup_paths(path):
    assert parse_cgroup_path(path) == (UID, CID)


@pytest.mark.parametrize("path", ["/", "/system.slice/containerd.service", f"/user.slice/{CID}"])
def test_non_kubelet_paths_have_no_pod(path):
    assert parse_cgroup_path(path) == (None, None)


def test_pod_level_cgroup_has_uid_only():
    assert parse_cgroup_path(f"/kubepods/burstable/pod{UID}") == (UID, None)


def test_log_names():
    assert parse_container_log_name(f"vllm-0_serving_vllm-{CID}.log") == ("serving", "vllm-0", "vllm", CID)
    assert parse_container_log_name(f"router-7d_ns_my-sidecar-{CID}.log") == ("ns", "router-7d", "my-sidecar", CID)
    assert parse_container_log_name("garbage.log") is None
    assert parse_pod_log_dir(f"serving_vllm-0_{UID}") == ("serving", "vllm-0", UID)
    assert parse_pod_log_dir("nope") is None


def test_resolve_prefers_container_names_then_pod_then_path():
    path = f"/kubepods/burstable/pod{UID}/{CID}"
    assert resolve(path, {CID: ("serving", "vllm-0", "vllm")}, {}) == Workload("serving", "vllm-0", "vllm", path, UID)
    assert resolve(path, {}, {UID: ("serving", "vllm-0")}) == Workload("serving", "vllm-0", CID[:12], path, UID)
    assert resolve("/system.slice/x", {}, {}) == Workload("", "", "", "/system.slice/x")


def test_find_cgroup2_mount():
    info = ("30 24 0:26 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
            "35 24 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    assert find_cgroup2_mount(info) == "/sys/fs/cgroup/unified"
    assert find_cgroup2_mount("1 2 0:1 / / rw - ext4 /dev/x rw\n") is None


def test_parse_maps_finds_cuda_libraries():
    maps = ("7f00-7f10 r-xp 00000000 08:01 123 /usr/local/cuda/lib64/libcudart.so.12.4.127\n"
            "7f10-7f20 r-xp 00000000 08:01 124 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
            "7f20-7f30 r-xp 00000000 08:01 125 /usr/lib/libcudnn.so.9\n"
            "7f30-7f40 rw-p 00000000 00:00 0 \n")
    assert parse_maps(maps) == {("libcudart", "/usr/local/cuda/lib64/libcudart.so.12.4.127"),
                                ("libcuda", "/usr/lib/x86_64-linux-gnu/libcuda.so.1")}


def test_bucket_bounds_are_seconds():
    b = log2_to_cumulative([0] * 40)
    assert b[0] == (repr(2 ** (FIRST_SLOT + 1) / 1e9), 0)
    assert b[-2][0] == repr(2 ** (LAST_SLOT + 1) / 1e9)
    assert b[-1] == ("+Inf", 0)


@settings(database=None)  # write no .hypothesis/ directory into the shared tree
@given(st.lists(st.integers(min_value=0, max_value=10 ** 9), min_size=40, max_size=40))
def test_buckets_cumulative_and_complete(slots):
    b = log2_to_cumulative(slots)
    counts = [c for _, c in b]
    assert counts == sorted(counts)
    assert b[-1] == ("+Inf", sum(slots))
    assert b[0][1] == sum(slots[:FIRST_SLOT + 1])
    assert len(b) == LAST_SLOT - FIRST_SLOT + 2


def test_config_flags_env_and_errors():
    s = config.parse([], environ={"GPUINFRA_EBPF_PORTS": "8000,8080", "GPUINFRA_EBPF_METRICS_PORT": "9500"})
    assert s.ports == (8000, 8080) and s.metrics_port == 9500 and s.programs == config.PROGRAMS
    assert config.parse(["--ports", "1234"], environ={"GPUINFRA_EBPF_PORTS": "8000"}).ports == (1234,)
    assert config.parse([], environ={}).metrics_port == 9435
    with pytest.raises(SystemExit):
        config.parse(["--programs", "sockredir,bogus"], environ={})
    with pytest.raises(SystemExit):
        config.parse(["--ports", "70000"], environ={})


def test_exported_bucket_bounds_are_the_documented_ones():
    """bpf/README.md's metrics table states the histogram's bucket range; keep it true."""
    import os

    buckets = log2_to_cumulative([0] * 40)
    first, last = float(buckets[0][0]), float(buckets[-2][0])
    assert (first, last) == (2 ** (FIRST_SLOT + 1) / 1e9, 2 ** (LAST_SLOT + 1) / 1e9)
    readme = open(os.path.join(conftest.BPF_DIR, "README.md"), encoding="utf-8").read()
    assert f"buckets {first * 1e6:.3f} µs … {last:.1f} s" in readme, (first, last)


def test_a_cgroup_is_dead_only_when_two_walks_miss_it():
    from agent.cgroups import confirmed_dead

    assert confirmed_dead(set(), {7, 8}) == set()
    assert confirmed_dead({7, 8}, {8, 9}) == {8}


@pytest.mark.parametrize("env,needle", [
    ({"GPUINFRA_EBPF_PORTS": "abc"}, "GPUINFRA_EBPF_PORTS='abc'"),
    ({"GPUINFRA_EBPF_PORTS": ",".join(str(8000 + i) for i in range(17))}, "at most 16"),
    ({"GPUINFRA_EBPF_PORTS": "8000,8000"}, "duplicate ports [8000]"),
    ({"GPUINFRA_EBPF_CUDA_RESCAN_SECONDS": "0"}, "> 0"),
    ({"GPUINFRA_EBPF_CUDA_RESCAN_SECONDS": "-1"}, "> 0"),
    ({"GPUINFRA_EBPF_METRICS_PORT": "http"}, "GPUINFRA_EBPF_METRICS_PORT"),
    ({"GPUINFRA_EBPF_TCPBP_MODE": "kprobe"}, "allowed: auto, fentry, tracepoint"),
    ({"GPUINFRA_EBPF_TCPBP_THRESHOLD_PCT": "0"}, "1..100"),
    ({"GPUINFRA_EBPF_ALLOW_CLIENTS": "pod:x"}, "cgroup:<path> or namespace:<name>"),
    ({"GPUINFRA_EBPF_UNPIN_ON_EXIT": "maybe"}, "true or false"),
    ({"GPUINFRA_EBPF_CUDA_SAMPLE_FRACTION": "0"}, "GPUINFRA_EBPF_CUDA_SAMPLE_FRACTION='0': 0; allowed: 0.01 to 1"),
    ({"GPUINFRA_EBPF_CUDA_SAMPLE_FRACTION": "1.5"}, "allowed: 0.01 to 1"),
    ({"GPUINFRA_EBPF_CUDA_SAMPLE_FRACTION": "nan"}, "allowed: 0.01 to 1"),
    ({"GPUINFRA_EBPF_CUDA_SAMPLE_FRACTION": "a tenth"}, "allowed: 0.01 to 1"),
    ({"GPUINFRA_EBPF_CUDA_SAMPLE_PERIOD_SECONDS": "0"}, "allowed: 1 to 3600 seconds"),
    ({"GPUINFRA_EBPF_CUDA_SAMPLE_PERIOD_SECONDS": "inf"}, "allowed: 1 to 3600 seconds"),
])
def test_env_values_get_the_flags_validation_and_a_clear_error(env, needle, capsys):
    """An environment variable is validated like its flag: exit 2 with the variable named, no traceback."""
    with pytest.raises(SystemExit) as e:
        config.parse([], environ=env)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,needle", [
    (["--ports", "8000,8000"], "duplicate"),
    (["--ports", ",".join(str(8000 + i) for i in range(17))], "at most 16"),
    (["--cuda-rescan-seconds", "0"], "> 0"),
    (["--cgroup-gc-seconds", "nan"], "> 0"),
    (["--cuda-sample-fraction", "0.001"], "allowed: 0.01 to 1"),
    (["--cuda-sample-period-seconds", "0.5"], "allowed: 1 to 3600 seconds"),
])
def test_flags_reject_what_would_disable_or_spin(argv, needle, capsys):
    with pytest.raises(SystemExit):
        config.parse(argv, environ={})
    assert needle in capsys.readouterr().err


def test_metric_identity_is_stable_across_container_restarts():
    """Two cgroups of the same pod's container (before and after a restart) get the same labels."""
    from agent.metrics import AgentCollector

    class FakeResolver:
        def lookup(self, cgid):
            cid = ("a" if cgid == 1 else "b") * 64
            return resolve(f"/kubepods/burstable/pod{UID}/{cid}", {"a" * 64: ("serving", "vllm-0", "vllm"),
                                                                  "b" * 64: ("serving", "vllm-0", "vllm")}, {})

    c = AgentCollector([], FakeResolver())
    assert c._labels(1) == c._labels(2) == ("serving", "vllm-0", "vllm", UID)


def test_build_id_identifies_a_library(tmp_path):
    import shutil
    import subprocess

    from agent.cudalibs import build_id, identity

    if shutil.which("clang") is None:
        pytest.skip("needs clang")
    src = tmp_path / "x.c"
    src.write_text("int f(void) { return 1; }\n")
    lib = tmp_path / "libcudart.so.12"
    subprocess.run(["clang", "-shared", "-fPIC", "-Wl,--build-id=sha1", "-o", str(lib), str(src)], check=True)
    bid = build_id(lib.read_bytes())
    assert len(bid) == 20
    ro = subprocess.run(["readelf", "-n", str(lib)], capture_output=True, text=True)
    if ro.returncode == 0:
        assert bid.hex() in ro.stdout
    assert identity(str(lib)) == (lib.stat().st_ino, bid)


def test_missing_kernel_btf_is_a_clear_error_before_anything_is_touched(monkeypatch, tmp_path, caplog):
    """Without /sys/kernel/btf/vmlinux no CO-RE object can be relocated: the agent says so once and
    exits 2 before taking the lock, pinning or serving anything."""
    import agent.__main__ as entry

    monkeypatch.setattr(entry, "BTF", str(tmp_path / "no-btf"))
    pins = tmp_path / "pins"
    with caplog.at_level("ERROR"):
        rc = entry.main(["--pin-dir", str(pins), "--metrics-port", "1", "--cuda-scan", "false"])
    assert rc == 2
    msgs = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(msgs) == 1 and "kernel BTF" in msgs[0] and "CONFIG_DEBUG_INFO_BTF=y" in msgs[0], msgs
    assert not pins.exists()


# ---- cudalat's duty cycle (issue 35) --------------------------------------------------------------


def test_window_lengths_split_the_period_by_the_fraction():
    from agent.cudalat import window_lengths

    assert window_lengths(0.1, 30) == pytest.approx((3.0, 27.0))
    assert window_lengths(1, 30) == (30, 0)
    for bad in (0, 0.009, 1.01, float("nan")):
        with pytest.raises(ValueError, match="allowed: 0.01 to 1"):
            window_lengths(bad, 30)
    with pytest.raises(ValueError, match="seconds > 0"):
        window_lengths(0.5, 0)


@given(fraction=st.floats(0.01, 0.99), period=st.floats(1, 3600), since=st.floats(0, 1e6))
def test_next_switch_alternates_open_and_closed_over_one_period(fraction, period, since):
    """An open window closes after fraction x period; the next opens (1 - fraction) x period after
    that: one window per period, open the configured share of it."""
    from agent.cudalat import next_switch

    close = next_switch(True, since, fraction, period)
    reopen = next_switch(False, close, fraction, period)
    assert close - since == pytest.approx(fraction * period)
    assert reopen - since == pytest.approx(period)


def test_at_fraction_one_the_probes_stay_attached():
    from agent.cudalat import next_switch

    assert next_switch(True, 5.0, 1.0, 30) == float("inf")
    assert next_switch(False, 5.0, 1.0, 30) == float("inf"), "a window that could not open waits for a rescan"


def test_symbol_offsets_of_a_shared_library_are_libbpfs(tmp_path):
    """agent.cudalibs.symbol_offsets (what uprobe_multi links attach at) against libbpf.so.1's own
    exports as `nm -D` lists them, converted from address to file offset through the PT_LOAD
    headers `readelf -lW` prints."""
    import re
    import shutil
    import subprocess

    from agent.cudalibs import symbol_offsets

    if not (shutil.which("nm") and shutil.which("readelf")):
        pytest.skip("binutils (nm, readelf) missing")
    lib = "/usr/lib/x86_64-linux-gnu/libbpf.so.1"
    if not os.path.exists(lib):
        pytest.skip(f"{lib} missing")
    loads = [tuple(int(x, 16) for x in m.groups()) for m in re.finditer(
        r"LOAD\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+0x[0-9a-f]+\s+(0x[0-9a-f]+)",
        subprocess.run(["readelf", "-lW", lib], capture_output=True, text=True, check=True).stdout)]
    want = {}
    for line in subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        addr, kind, name = line.split()
        name = name.split("@")[0]
        if kind == "T" and name in ("bpf_link__destroy", "bpf_object__load", "libbpf_num_possible_cpus"):
            (off,) = [int(addr, 16) - va + fo for fo, va, sz in loads if va <= int(addr, 16) < va + sz]
            want[name] = off
    assert len(want) == 3
    assert symbol_offsets(lib, frozenset(want) | {"no_such_function"}) == want
    (tmp_path / "x").write_bytes(b"not an ELF file at all, longer than a header" * 2)
    with pytest.raises(ValueError, match="not a 64-bit"):
        symbol_offsets(str(tmp_path / "x"), frozenset({"f"}))


def test_the_router_splices_nothing_so_its_connections_keep_the_fast_path(tmp_path):
    """sockredir sends a pair back to TCP when a reader splices (docs/ebpf-agent.md, "Socket calls
    and options"), and a splice that finds redirected bytes unread sees them late. The router's
    rendered haproxy.cfg, with and without prefix affinity, turns none of HAProxy's splicing on
    (`option splice-auto|splice-request|splice-response`, HAProxy 2.6 configuration manual, 4.2)."""
    from components.router.haproxy_cfg import Affinity, Route
    from tests.router_harness import render

    for routes in ([Route("m")], [Route("m", "m-economy", affinity=Affinity()), Route("m-economy")]):
        conf, _ = render(tmp_path, routes)
        spliced = re.findall(r"^\s*option\s+splice-\w+", conf.read_text(), re.M)
        assert not spliced, spliced
