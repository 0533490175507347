// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Host-side CUDA call latency: uprobe/uretprobe pairs on cudaLaunchKernel, cudaGraphLaunch,
 * cuLaunchKernel, cudaMemcpyAsync (the ENQUEUE time of work for the GPU), cudaMalloc and
 * cudaStreamSynchronize (calls that BLOCK the thread), and the _ptsz variants. The time measured
 * is how long the calling thread spent inside the API call, not how long the GPU took.
 *
 * The agent attaches both programs once per (library, symbol) with the call kind as the attach
 * cookie, so one pair of programs serves every call kind.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "common.bpf.h"
#include "cudalat.h"

/* Entry timestamps. LRU, so threads that die inside a call cannot fill the map. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct cuda_start_key);
	__type(value, __u64);
} cuda_call_start SEC(".maps");

/* Histogram updates refused because the map was full (exported as a counter). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} cudalat_dropped SEC(".maps");

/* Exported as ebpf_cuda_call_enqueue_seconds (launches, async copies) and
 * ebpf_cuda_call_blocking_seconds (malloc, synchronize): the agent splits by call kind. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct cuda_hist_key);
	__type(value, struct cuda_hist);
} cuda_call_enqueue_seconds SEC(".maps");

SEC("uprobe")
int cudalat_enter(struct pt_regs *ctx)
{
	struct cuda_start_key key = {
		.pid_tgid = bpf_get_current_pid_tgid(),
		.kind = (__u32)bpf_get_attach_cookie(ctx),
	};
	__u64 ts = bpf_ktime_get_ns();

	bpf_map_update_elem(&cuda_call_start, &key, &ts, BPF_ANY);
	return 0;
}

SEC("uretprobe")
int cudalat_exit(struct pt_regs *ctx)
{
	struct cuda_start_key key = {
		.pid_tgid = bpf_get_current_pid_tgid(),
		.kind = (__u32)bpf_get_attach_cookie(ctx),
	};
	struct cuda_hist_key hkey = {};
	struct cuda_hist zero = {}; /* on the stack: keeps .rodata empty */
	struct cuda_hist *hist;
	__u64 *start, delta;
	__u32 slot;

	start = bpf_map_lookup_elem(&cuda_call_start, &key);
	if (!start)
		return 0;
	delta = bpf_ktime_get_ns() - *start;
	bpf_map_delete_elem(&cuda_call_start, &key);

	hkey.cgroup_id = bpf_get_current_cgroup_id();
	hkey.kind = key.kind;
	hist = bpf_map_lookup_elem(&cuda_call_enqueue_seconds, &hkey);
	if (!hist) {
		bpf_map_update_elem(&cuda_call_enqueue_seconds, &hkey, &zero, BPF_NOEXIST);
		hist = bpf_map_lookup_elem(&cuda_call_enqueue_seconds, &hkey);
		if (!hist) {
			__u32 zero_key = 0;
			__u64 *d = bpf_map_lookup_elem(&cudalat_dropped, &zero_key);

			if (d)
				*d += 1;
			return 0;
		}
	}
	slot = delta ? log2_u64(delta) : 0;
	if (slot >= CUDALAT_SLOTS)
		slot = CUDALAT_SLOTS - 1;
	__sync_fetch_and_add(&hist->slots[slot], 1);
	__sync_fetch_and_add(&hist->sum_ns, delta);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
