// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Host-side CUDA call latency: uprobe/uretprobe pairs on the driver's launch entry points
 * cuLaunchKernel, cuLaunchKernelEx and cuGraphLaunch (libcuda: every kernel and graph launch, once,
 * whoever makes it), on the runtime's cudaMemcpyAsync (the ENQUEUE time of work for the GPU),
 * cudaMalloc and cudaStreamSynchronize (calls that BLOCK the thread), and the _ptsz variants. The
 * time measured is how long the calling thread spent inside the API call, not how long the GPU took.
 *
 * The agent attaches an entry and a return program at every probed symbol with the call kind as
 * the attach cookie, so one pair of programs serves every call kind: as one link per library where
 * the kernel has uprobe_multi links, else as one perf-event link per (library, symbol).
 *
 * Sampling: the agent attaches the probes only during sampling windows (a uprobe costs its trap
 * even when the program returns at once, so detaching is what saves the cost) and numbers each
 * window in cudalat_window. A call is counted only when it entered and returned inside one window:
 * nothing is recorded while the probes are being attached or detached (window 0), and an entry left
 * over from an earlier window (a thread that died inside a call) is never paired with a later return.
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
	__type(value, struct cuda_start);
} cuda_call_start SEC(".maps");

/* The open sampling window's number (0: none open). Written by the agent only: set after every
 * probe of a window is attached, cleared before the first is detached. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} cudalat_window SEC(".maps");

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

static __always_inline __u64 open_window(void)
{
	__u32 zero = 0;
	__u64 *w = bpf_map_lookup_elem(&cudalat_window, &zero);

	return w ? *w : 0;
}

static __always_inline int enter(struct pt_regs *ctx)
{
	struct cuda_start_key key = {
		.pid_tgid = bpf_get_current_pid_tgid(),
		.kind = (__u32)bpf_get_attach_cookie(ctx),
	};
	struct cuda_start start = {};

	start.window = open_window();
	if (!start.window)
		return 0;
	start.ts = bpf_ktime_get_ns();
	bpf_map_update_elem(&cuda_call_start, &key, &start, BPF_ANY);
	return 0;
}

static __always_inline int leave(struct pt_regs *ctx)
{
	struct cuda_start_key key = {
		.pid_tgid = bpf_get_current_pid_tgid(),
		.kind = (__u32)bpf_get_attach_cookie(ctx),
	};
	struct cuda_hist_key hkey = {};
	struct cuda_hist zero = {}; /* on the stack: keeps .rodata empty */
	struct cuda_hist *hist;
	struct cuda_start *start;
	__u64 delta, window;
	__u32 slot;

	start = bpf_map_lookup_elem(&cuda_call_start, &key);
	if (!start)
		return 0;
	delta = bpf_ktime_get_ns() - start->ts;
	window = start->window;
	bpf_map_delete_elem(&cuda_call_start, &key);
	if (window != open_window())
		return 0; /* entered in another window, or returned after this one closed */

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

/* One uprobe per (library, symbol), each its own perf-event link: any kernel with uprobe cookies. */
SEC("uprobe")
int cudalat_enter(struct pt_regs *ctx)
{
	return enter(ctx);
}

SEC("uretprobe")
int cudalat_exit(struct pt_regs *ctx)
{
	return leave(ctx);
}

/* The same, loaded with expected attach type BPF_TRACE_UPROBE_MULTI (set by the agent: libbpf 1.1
 * knows no uprobe.multi section) for one link per library holding all its uprobes (Linux 6.6+).
 * Detaching a link waits for the kernel's grace periods once; a window's end then costs one wait
 * per library instead of one per probe. */
SEC("uprobe")
int cudalat_enter_multi(struct pt_regs *ctx)
{
	return enter(ctx);
}

SEC("uprobe")
int cudalat_exit_multi(struct pt_regs *ctx)
{
	return leave(ctx);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
