// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Same-node socket redirection (Merbridge pattern).
 *
 * sock_ops inserts established TCP sockets whose local or remote port is one of the configured
 * ports into a SOCKHASH, keyed by the socket's own 4-tuple in network byte order. sk_msg looks up
 * the PEER's key (the same tuple swapped) and redirects the payload straight into the peer's
 * receive queue. sk_msg always returns SK_PASS: on a miss the message takes the normal TCP path.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "sockredir.h"

#define AF_INET 2
#define AF_INET6 10

/* Set by the agent before load. */
const volatile struct sockredir_cfg sockredir_cfg = {};

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, __u32);
} sockredir_sockhash SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SOCKREDIR_NR_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} sockredir_counters SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *v = bpf_map_lookup_elem(&sockredir_counters, &which);

	if (v)
		*v += 1;
}

static __always_inline bool port_selected(__u16 port)
{
	for (__u32 i = 0; i < SOCKREDIR_MAX_PORTS; i++) {
		if (i >= sockredir_cfg.nr_ports)
			break;
		if (sockredir_cfg.ports[i] == port)
			return true;
	}
	return false;
}

/* IPv4, or IPv4-mapped IPv6 (::ffff:a.b.c.d). Anything else is not accelerated. */
static __always_inline int ip4_of(__u32 family, __u32 ip4, __u32 w0, __u32 w1, __u32 w2,
				  __u32 w3, __u32 *out)
{
	if (family == AF_INET) {
		*out = ip4;
		return 0;
	}
	if (family == AF_INET6 && w0 == 0 && w1 == 0 && w2 == bpf_htonl(0x0000ffff)) {
		*out = w3;
		return 0;
	}
	return -1;
}

/*
 * Every context field is read unconditionally at a constant offset: the verifier rejects
 * context loads through a computed pointer, which clang emits when it merges conditional loads.
 * In both contexts local_port is host order and remote_port holds the network-order port in its
 * upper 16 bits on little-endian hosts, so bpf_ntohl() yields the host-order value everywhere.
 */
#define READ_TUPLE(ctx, fam, l4, r4, l6, r6, lport, rport)			\
	do {									\
		fam = (ctx)->family;						\
		l4 = (ctx)->local_ip4;						\
		r4 = (ctx)->remote_ip4;						\
		l6[0] = (ctx)->local_ip6[0];					\
		l6[1] = (ctx)->local_ip6[1];					\
		l6[2] = (ctx)->local_ip6[2];					\
		l6[3] = (ctx)->local_ip6[3];					\
		r6[0] = (ctx)->remote_ip6[0];					\
		r6[1] = (ctx)->remote_ip6[1];					\
		r6[2] = (ctx)->remote_ip6[2];					\
		r6[3] = (ctx)->remote_ip6[3];					\
		lport = (__u16)(ctx)->local_port;				\
		rport = (__u16)bpf_ntohl((ctx)->remote_port);			\
	} while (0)

/* Fills this socket's own key (swap=false) or its peer's key (swap=true). */
static __always_inline int make_key(__u32 fam, __u32 l4, __u32 r4, __u32 *l6, __u32 *r6,
				    __u16 lport, __u16 rport, bool swap, struct sock_key *key)
{
	__u32 lip, rip;

	if (ip4_of(fam, l4, l6[0], l6[1], l6[2], l6[3], &lip) ||
	    ip4_of(fam, r4, r6[0], r6[1], r6[2], r6[3], &rip))
		return -1;
	key->local_ip4 = swap ? rip : lip;
	key->remote_ip4 = swap ? lip : rip;
	key->local_port = bpf_htons(swap ? rport : lport);
	key->remote_port = bpf_htons(swap ? lport : rport);
	return 0;
}

static __always_inline int key_of_sockops(struct bpf_sock_ops *skops, struct sock_key *key)
{
	__u32 fam, l4, r4, l6[4], r6[4];
	__u16 lport, rport;

	READ_TUPLE(skops, fam, l4, r4, l6, r6, lport, rport);
	return make_key(fam, l4, r4, l6, r6, lport, rport, false, key);
}

SEC("sockops")
int sockredir_sockops(struct bpf_sock_ops *skops)
{
	struct sock_key key = {};

	switch (skops->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		if (key_of_sockops(skops, &key))
			return 1; /* not IPv4: leave it on the normal path, not an error */
		if (!port_selected(bpf_ntohs(key.local_port)) &&
		    !port_selected(bpf_ntohs(key.remote_port)))
			return 1;
		if (bpf_sock_hash_update(skops, &sockredir_sockhash, &key, BPF_NOEXIST)) {
			count(SOCKREDIR_ERROR);
			return 1;
		}
		count(SOCKREDIR_INSERTED);
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags |
						 BPF_SOCK_OPS_STATE_CB_FLAG);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		/* args[1] is the new state. SOCKHASH also unlinks closing sockets itself; the
		 * explicit delete keeps the map honest if that ever changes. */
		if (skops->args[1] != TCP_CLOSE)
			break;
		if (key_of_sockops(skops, &key))
			break;
		bpf_map_delete_elem(&sockredir_sockhash, &key);
		count(SOCKREDIR_REMOVED);
		break;
	default:
		break;
	}
	return 1;
}

SEC("sk_msg")
int sockredir_skmsg(struct sk_msg_md *msg)
{
	struct sock_key peer = {};

	__u32 fam, l4, r4, l6[4], r6[4];
	__u16 lport, rport;

	READ_TUPLE(msg, fam, l4, r4, l6, r6, lport, rport);
	/* The peer's key is this socket's tuple swapped. */
	if (make_key(fam, l4, r4, l6, r6, lport, rport, true, &peer)) {
		count(SOCKREDIR_ERROR);
		return SK_PASS;
	}

	if (bpf_msg_redirect_hash(msg, &sockredir_sockhash, &peer, BPF_F_INGRESS) == SK_PASS)
		count(SOCKREDIR_REDIRECTED);
	else
		count(SOCKREDIR_FALLBACK);
	return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
