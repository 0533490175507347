#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU benchmark in one call on the device machine (one H200; python3 holds torch 2.11 for CUDA
# 13 and prometheus_client; root; no network). bench/gpu/prepare.sh must have run where the call is
# made, and the call carries its outputs:
#   run(command="bash bench/gpu/run_on_device.sh", carry=["bpf/build", ".gpu-bench"], timeout_s=540)
# Extra arguments go to the benchmark (e.g. --rounds 1 --seconds 3 for a short check). Results:
# $OUT/cuda_agent_gpu_bench.{log,json}. The benchmark mounts a bpffs of its own and unmounts it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LIBBPF_SO="$PWD/.gpu-bench/lib/libbpf.so.1"
{
    echo "== machine"
    date -u +%Y-%m-%dT%H:%M:%SZ
    uname -r
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
    nproc
    python3 -c 'import sys, torch, prometheus_client; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
    ls -l /sys/kernel/btf/vmlinux bpf/build/cudalat.bpf.o "$LIBBPF_SO" .gpu-bench/lib/libelf.so.1
    echo "== bench"
    python3 bench/gpu/cuda_agent_gpu_bench.py --out "$OUT/cuda_agent_gpu_bench.json" "$@"
    echo "rc=$?"
} 2>&1 | tee "$OUT/cuda_agent_gpu_bench.log"
