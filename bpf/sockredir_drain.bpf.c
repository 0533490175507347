// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Reports, for every TCP socket of the iterating task's network namespace that has a psock (is in
 * a sockmap or sockhash), its cookie and whether its redirect queue is empty: a BPF iterator over
 * TCP sockets (iter/tcp) writes one struct sockredir_drain_row per such socket. `--uninstall`
 * runs it in every network namespace of the host and unlinks from the sockredir sockhashes only
 * the sockets reported empty: unlinking drops the socket's psock, which restores TCP's own socket
 * calls (sk_psock_drop -> sk_psock_restore_proto, include/linux/skmsg.h) and purges whatever the
 * queue still held (sk_psock_destroy), so a socket whose reader has not read its redirected bytes
 * yet is left for a later pass. (A map iterator, iter/sockmap, would need no namespace walk, but
 * kernels built like this one refuse to load map-element iterators.)
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#define SK_USER_DATA_PSOCK 4UL /* include/net/sock.h */

struct sockredir_drain_row {
	__u64 cookie;
	__u32 empty;  /* list_empty(&psock->ingress_msg) */
	__u32 queued; /* psock->msg_tot_len where the kernel has it, else 0 */
};

struct sk_psock___fionread {
	u32 msg_tot_len;
} __attribute__((preserve_access_index));

SEC("iter/tcp")
int sockredir_drain(struct bpf_iter__tcp *ctx)
{
	struct sockredir_drain_row row = {};
	struct sock_common *skc = ctx->sk_common;
	struct sk_psock *psock;
	struct tcp_sock *tp;
	__u64 ud;

	if (!skc)
		return 0;
	tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0; /* request and timewait sockets */
	ud = (__u64)BPF_CORE_READ((struct sock *)tp, sk_user_data);
	row.cookie = BPF_CORE_READ((struct sock *)tp, __sk_common.skc_cookie.counter);
	if (!(ud & SK_USER_DATA_PSOCK) || !row.cookie)
		return 0;
	psock = (void *)(ud & ~7ULL);
	row.empty = BPF_CORE_READ(psock, ingress_msg.next) == &psock->ingress_msg;
	if (bpf_core_field_exists(struct sk_psock___fionread, msg_tot_len))
		row.queued = BPF_CORE_READ((struct sk_psock___fionread *)psock, msg_tot_len);
	bpf_seq_write(ctx->meta->seq, &row, sizeof(row));
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
