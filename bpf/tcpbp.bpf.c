// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * TCP send backpressure, per cgroup.
 *
 * A send counts as backpressured when the socket's queued bytes exceed threshold_pct of its send
 * buffer (integer math: eBPF has no floating point), or when the sender had to wait for space.
 *
 * Two sets of programs, the agent loads one:
 *  - production: fentry on tcp_sendmsg and sk_stream_wait_memory (BTF trampolines);
 *  - fallback, for kernels that refuse fentry: the raw tracepoint tcp:tcp_sendmsg_locked. It
 *    cannot see sk_stream_wait_memory, so "blocked" stays 0 there; a full queue is still seen.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include "tcpbp.h"

/* Set by the agent before load; 80 means q * 100 > sndbuf * 80, i.e. q * 5 > sndbuf * 4. */
const volatile struct tcpbp_cfg tcpbp_cfg = { .threshold_pct = 80 };

/* Named after the exported metrics ebpf_tcp_send_{samples,backpressure,blocked}_total. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64); /* cgroup id */
	__type(value, struct tcpbp_counts);
} tcp_send_backpressure SEC(".maps");

/* Samples lost because tcp_send_backpressure was full (exported as a counter). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} tcpbp_dropped SEC(".maps");

static __always_inline struct tcpbp_counts *counts_for_current(void)
{
	struct tcpbp_counts zero = {};
	__u64 cgid = bpf_get_current_cgroup_id();
	struct tcpbp_counts *c = bpf_map_lookup_elem(&tcp_send_backpressure, &cgid);
	__u32 key = 0;
	__u64 *d;

	if (c)
		return c;
	bpf_map_update_elem(&tcp_send_backpressure, &cgid, &zero, BPF_NOEXIST);
	c = bpf_map_lookup_elem(&tcp_send_backpressure, &cgid);
	if (!c) {
		d = bpf_map_lookup_elem(&tcpbp_dropped, &key);
		if (d)
			*d += 1;
	}
	return c;
}

static __always_inline void sample(__s32 queued, __s32 sndbuf)
{
	struct tcpbp_counts *c = counts_for_current();

	if (!c)
		return;
	__sync_fetch_and_add(&c->samples, 1);
	if (sndbuf > 0 && queued > 0 && (__u64)queued * 100 > (__u64)sndbuf * tcpbp_cfg.threshold_pct)
		__sync_fetch_and_add(&c->events, 1);
}

SEC("raw_tracepoint/tcp_sendmsg_locked")
int tcpbp_sendmsg_tp(struct bpf_raw_tracepoint_args *ctx)
{
	struct sock *sk = (struct sock *)ctx->args[0];

	sample(BPF_CORE_READ(sk, sk_wmem_queued), BPF_CORE_READ(sk, sk_sndbuf));
	return 0;
}

SEC("fentry/tcp_sendmsg")
int BPF_PROG(tcpbp_sendmsg_fentry, struct sock *sk, struct msghdr *msg, size_t size)
{
	sample(sk->sk_wmem_queued, sk->sk_sndbuf);
	return 0;
}

SEC("fentry/sk_stream_wait_memory")
int BPF_PROG(tcpbp_wait_memory_fentry, struct sock *sk, long *timeo_p)
{
	struct tcpbp_counts *c = counts_for_current();

	if (c)
		__sync_fetch_and_add(&c->blocked, 1);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
