/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Shared between cudalat.bpf.c and the agent (agent/cudalat.py mirrors the layout). */
#ifndef GPUINFRA_CUDALAT_H
#define GPUINFRA_CUDALAT_H

/* Slot i counts calls whose host-side duration d (ns) has floor(log2(d)) == i, i.e.
 * 2^i <= d < 2^(i+1); the last slot also takes everything longer. */
#define CUDALAT_SLOTS 40

/* The uprobe's attach cookie carries the call kind. The numbers are kept across releases: the
 * pinned histograms are keyed by them. Kernel and graph launches are probed once, at the driver's
 * entry points in libcuda, which see the runtime's launches (libcudart calls them), Triton's and
 * the libraries' (cuBLAS carries its own static runtime) alike (issue 35); the runtime-side launch
 * kinds (0, 5, 6, 9) are no longer attached and stay only so that an older agent's pinned entries
 * keep their label. */
enum cuda_call_kind {
	CUDA_LAUNCH_KERNEL = 0,      /* libcudart cudaLaunchKernel: not attached since issue 35 */
	CU_LAUNCH_KERNEL = 1,        /* libcuda cuLaunchKernel */
	CUDA_MALLOC = 2,             /* libcudart cudaMalloc */
	CUDA_MEMCPY_ASYNC = 3,       /* libcudart cudaMemcpyAsync */
	CUDA_STREAM_SYNCHRONIZE = 4, /* libcudart cudaStreamSynchronize */
	CUDA_GRAPH_LAUNCH = 5,       /* libcudart cudaGraphLaunch: not attached since issue 35 */
	/* Per-thread default stream builds (--default-stream per-thread) call the _ptsz symbols. */
	CUDA_LAUNCH_KERNEL_PTSZ = 6, /* not attached since issue 35 */
	CUDA_MEMCPY_ASYNC_PTSZ = 7,
	CUDA_STREAM_SYNCHRONIZE_PTSZ = 8,
	CUDA_GRAPH_LAUNCH_PTSZ = 9,  /* not attached since issue 35 */
	CU_LAUNCH_KERNEL_PTSZ = 10,
	CU_LAUNCH_KERNEL_EX = 11,    /* libcuda cuLaunchKernelEx (cudaLaunchKernelExC, Triton) */
	CU_LAUNCH_KERNEL_EX_PTSZ = 12,
	CU_GRAPH_LAUNCH = 13,        /* libcuda cuGraphLaunch (cudaGraphLaunch: vLLM's decode) */
	CU_GRAPH_LAUNCH_PTSZ = 14,
	CUDA_NR_KINDS = 15,
};

struct cuda_start_key {
	__u64 pid_tgid;
	__u32 kind;
	__u32 pad;
};

/* When a call entered, and in which sampling window. */
struct cuda_start {
	__u64 ts;
	__u64 window;
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
