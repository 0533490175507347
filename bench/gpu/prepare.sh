#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run HERE (the machine with clang and Debian's libbpf) before the GPU run: builds the CO-RE objects
# into bpf/build and copies Debian's libbpf.so.1 and its libelf.so.1 into .gpu-bench/lib. Both are
# ignored by git; the device run carries them (carry: ["bpf/build", ".gpu-bench"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
make -C bpf
mkdir -p .gpu-bench/lib
for lib in libbpf.so.1 libelf.so.1; do
    path=$(/sbin/ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ {print $NF; exit}')
    [ -n "$path" ] || { echo "prepare: $lib not found (apt-get install libbpf1 libelf1)" >&2; exit 1; }
    cp -L "$path" ".gpu-bench/lib/$lib"
done
ls -l bpf/build/*.bpf.o .gpu-bench/lib
