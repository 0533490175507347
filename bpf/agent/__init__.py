# SPDX-License-Identifier: Apache-2.0
"""gpuinfra eBPF agent: loads the bpf/ programs, attaches them fail-open, serves /metrics."""
