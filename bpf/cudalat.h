/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Shared between cudalat.bpf.c and the agent (agent/programs.py mirrors the layout). */
#ifndef GPUINFRA_CUDALAT_H
#define GPUINFRA_CUDALAT_H

/* Slot i counts calls whose host-side duration d (ns) has floor(log2(d)) == i, i.e.
 * 2^i <= d < 2^(i+1); the last slot also takes everything longer. */
#define CUDALAT_SLOTS 40

/* The uprobe's attach cookie carries the call kind. */
enum cuda_call_kind {
	CUDA_LAUNCH_KERNEL = 0,     /* libcudart cudaLaunchKernel */
	CU_LAUNCH_KERNEL = 1,       /* libcuda cuLaunchKernel (driver API) */
	CUDA_MALLOC = 2,            /* libcudart cudaMalloc */
	CUDA_MEMCPY_ASYNC = 3,      /* libcudart cudaMemcpyAsync */
	CUDA_STREAM_SYNCHRONIZE = 4, /* libcudart cudaStreamSynchronize */
	CUDA_GRAPH_LAUNCH = 5,      /* libcudart cudaGraphLaunch (vLLM decodes through CUDA graphs) */
	/* Per-thread default stream builds (--default-stream per-thread) call the _ptsz symbols. */
	CUDA_LAUNCH_KERNEL_PTSZ = 6,
	CUDA_MEMCPY_ASYNC_PTSZ = 7,
	CUDA_STREAM_SYNCHRONIZE_PTSZ = 8,
	CUDA_GRAPH_LAUNCH_PTSZ = 9,
	CU_LAUNCH_KERNEL_PTSZ = 10,
	CUDA_NR_KINDS = 11,
};

struct cuda_start_key {
	__u64 pid_tgid;
	__u32 kind;
	__u32 pad;
};

struct cuda_hist_key {
	__u64 cgroup_id;
	__u32 kind;
	__u32 pad;
};

struct cuda_hist {
	__u64 slots[CUDALAT_SLOTS];
	__u64 sum_ns;
};

#endif
