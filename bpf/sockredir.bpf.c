// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Same-node socket redirection (Merbridge pattern), restricted to the pairs the platform intends.
 *
 * sock_ops inserts an established TCP socket into a SOCKHASH keyed by its own tuple (network byte
 * order), plus its network namespace cookie when the tuple is loopback (two pods may both use
 * 127.0.0.1:<p>; pod IPs are unique on a node, so a pod-to-pod pair across two namespaces keys
 * without it), but only:
 *  - a client socket (remote port selected) whose cgroup, or one of its ancestors, is in the
 *    allow-list map the agent fills from config (sockredir_allow);
 *  - a server socket (local port selected) whose client is already in the sockhash, so that a
 *    server socket is never inserted when its peer cannot be redirected to (remote clients,
 *    clients that are not allowed).
 * A client whose server socket never pairs (its peer is not a local socket: a remote server, or a
 * kube-proxy ClusterIP whose DNAT the client socket never sees) is evicted from the sockhash at
 * its first RTT sample: its data went over TCP and was acknowledged, so no pair can form any more.
 * sk_msg looks up the PEER's key (the same tuple swapped; same netns if loopback) and redirects
 * the payload straight into the peer's receive queue, unless the peer's queue already holds its sk_rcvbuf
 * worth of redirected bytes: then this socket goes back to the TCP path for good (TCP's own
 * window then throttles the sender). sk_msg always returns SK_PASS: on a miss the message takes
 * the normal TCP path.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include "sockredir.h"

#define AF_INET 2
#define AF_INET6 10
#define E2BIG 7
#define ENOMEM 12
#define ENOSPC 28

/* Set by the agent before load. */
const volatile struct sockredir_cfg sockredir_cfg = {};

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, __u64);
} sockredir_sockhash SEC(".maps");

/* cgroup ids whose sockets may be accelerated as clients; written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u8);
} sockredir_allow SEC(".maps");

/*
 * Every socket in the sockhash -> its struct sock address. A plain hash: sock_ops can test a
 * peer's presence and sk_msg can find the peer's queue without taking a socket reference (which
 * sk_msg programs may not release). Entries leave at TCP_CLOSE; the address is only ever read
 * with bpf_probe_read_kernel, so a stale entry can at worst send one socket back to TCP.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, struct sock_entry);
} sockredir_socks SEC(".maps");

/* Sockets sent back to TCP by flow control; they never redirect again (byte order). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, __u8);
} sockredir_bypass SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SOCKREDIR_NR_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} sockredir_counters SEC(".maps");

static __always_inline void count_n(__u32 which, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&sockredir_counters, &which);

	if (v)
		*v += n;
}

static __always_inline void count(__u32 which)
{
	count_n(which, 1);
}

static __always_inline bool map_full(long err)
{
	return err == -E2BIG || err == -ENOMEM || err == -ENOSPC;
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

static __always_inline bool is_loopback(__u32 ip4)
{
	return (ip4 & bpf_htonl(0xff000000)) == bpf_htonl(0x7f000000);
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
				    __u16 lport, __u16 rport, bool swap, __u64 netns,
				    struct sock_key *key)
{
	__u32 lip, rip;

	if (ip4_of(fam, l4, l6[0], l6[1], l6[2], l6[3], &lip) ||
	    ip4_of(fam, r4, r6[0], r6[1], r6[2], r6[3], &rip))
		return -1;
	/* Pod IPs are unique on a node, so only loopback tuples need the namespace to tell two pods
	 * apart; a pod-to-pod pair spans two namespaces and must key without it to pair. */
	key->netns_cookie = (is_loopback(lip) || is_loopback(rip)) ? netns : 0;
	key->local_ip4 = swap ? rip : lip;
	key->remote_ip4 = swap ? lip : rip;
	key->local_port = bpf_htons(swap ? rport : lport);
	key->remote_port = bpf_htons(swap ? lport : rport);
	return 0;
}

static __always_inline int key_of_sockops(struct bpf_sock_ops *skops, bool swap, struct sock_key *key)
{
	__u32 fam, l4, r4, l6[4], r6[4];
	__u16 lport, rport;

	READ_TUPLE(skops, fam, l4, r4, l6, r6, lport, rport);
	return make_key(fam, l4, r4, l6, r6, lport, rport, swap, bpf_get_netns_cookie(skops), key);
}

/* The socket's cgroup (the creating task's) or one of its ancestors is on the allow-list. */
static __always_inline bool cgroup_allowed(struct bpf_sock_ops *skops)
{
	struct bpf_sock *bsk = skops->sk;
	struct tcp_sock *tp;
	struct cgroup *cg;

	if (!bsk)
		return false;
	tp = bpf_skc_to_tcp_sock(bsk);
	if (!tp)
		return false;
	cg = BPF_CORE_READ((struct sock *)tp, sk_cgrp_data.cgroup);
	for (int i = 0; i < SOCKREDIR_ALLOW_DEPTH && cg; i++) {
		__u64 id = BPF_CORE_READ(cg, kn, id);

		if (bpf_map_lookup_elem(&sockredir_allow, &id))
			return true;
		cg = BPF_CORE_READ(cg, self.parent, cgroup);
	}
	return false;
}

static __always_inline void insert(struct bpf_sock_ops *skops, struct sock_key *key, bool client)
{
	struct bpf_sock *bsk = skops->sk;
	struct sock_entry entry = { .paired = !client };
	__u32 flags = BPF_SOCK_OPS_STATE_CB_FLAG;
	long err;

	if (bsk)
		entry.addr = (__u64)bpf_skc_to_tcp_sock(bsk);
	if (!entry.addr)
		return;
	err = bpf_map_update_elem(&sockredir_socks, key, &entry, BPF_NOEXIST);
	if (err) {
		count(map_full(err) ? SOCKREDIR_DROPPED : SOCKREDIR_ERROR);
		return;
	}
	err = bpf_sock_hash_update(skops, &sockredir_sockhash, key, BPF_NOEXIST);
	if (err) {
		bpf_map_delete_elem(&sockredir_socks, key);
		count(map_full(err) ? SOCKREDIR_DROPPED : SOCKREDIR_ERROR);
		return;
	}
	count(SOCKREDIR_INSERTED);
	/* A client also wants its RTT samples: the first one tells whether a pair formed. */
	if (client)
		flags |= BPF_SOCK_OPS_RTT_CB_FLAG;
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | flags);
}

/*
 * RTT_CB on a client: an ACK for data it sent over TCP. A paired client's data is redirected and
 * produces no RTT sample unless flow control moved it to TCP; either way the question is settled,
 * so the callback turns itself off. An unpaired client leaves the sockhash: nothing was ever
 * redirected into it (only its peer could, and the peer was never inserted), so its receive side
 * holds nothing the removal could drop, and its sends stop paying for the sk_msg path.
 */
static __always_inline void settle_client(struct bpf_sock_ops *skops)
{
	struct sock_key key = {};
	struct sock_entry *e;

	if (key_of_sockops(skops, false, &key))
		return;
	e = bpf_map_lookup_elem(&sockredir_socks, &key);
	if (e && !e->paired) {
		bpf_map_delete_elem(&sockredir_sockhash, &key);
		bpf_map_delete_elem(&sockredir_socks, &key);
		count(SOCKREDIR_EVICTED);
		bpf_sock_ops_cb_flags_set(skops, 0);
		return;
	}
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_RTT_CB_FLAG);
}

SEC("sockops")
int sockredir_sockops(struct bpf_sock_ops *skops)
{
	struct sock_key key = {}, peer = {};
	struct sock_entry *client;

	switch (skops->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		/* The client side: its remote port is a selected (server) port. */
		if (key_of_sockops(skops, false, &key))
			return 1; /* not IPv4: leave it on the normal path, not an error */
		if (!port_selected(bpf_ntohs(key.remote_port)))
			return 1;
		if (!cgroup_allowed(skops)) {
			count(SOCKREDIR_NOT_ALLOWED);
			return 1;
		}
		insert(skops, &key, true);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		/* The server side: only when its client is in the sockhash (same node, allowed). */
		if (key_of_sockops(skops, false, &key) || key_of_sockops(skops, true, &peer))
			return 1;
		if (!port_selected(bpf_ntohs(key.local_port)))
			return 1;
		client = bpf_map_lookup_elem(&sockredir_socks, &peer);
		if (!client) {
			count(SOCKREDIR_UNPAIRED);
			return 1;
		}
		client->paired = 1;
		insert(skops, &key, false);
		break;
	case BPF_SOCK_OPS_RTT_CB:
		settle_client(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		/* args[1] is the new state. SOCKHASH also unlinks closing sockets itself; the
		 * explicit delete keeps the map honest if that ever changes. */
		if (skops->args[1] != TCP_CLOSE)
			break;
		if (key_of_sockops(skops, false, &key))
			break;
		bpf_map_delete_elem(&sockredir_sockhash, &key);
		bpf_map_delete_elem(&sockredir_socks, &key);
		bpf_map_delete_elem(&sockredir_bypass, &key);
		count(SOCKREDIR_REMOVED);
		break;
	default:
		break;
	}
	return 1;
}

/*
 * Bytes already redirected into the peer's ingress queue and not yet read, against the peer's
 * receive buffer. sk_psock.msg_tot_len counts them; it came with upstream "bpf, sockmap: Fix
 * FIONREAD for sockmap" (bpf-next, January 2026, Fixes: 04919bed948dc, so also in stable trees that
 * took the backport, e.g. 6.18.44). Without it there is no bound to check and the caller redirects
 * as before.
 */
static __always_inline bool peer_queue_full(struct sock_key *peer)
{
	struct sock_entry *e = bpf_map_lookup_elem(&sockredir_socks, peer);
	struct sk_psock *psock;
	struct sock *sk;
	__u32 queued;
	int rcvbuf;

	if (!e || !bpf_core_field_exists(struct sk_psock, msg_tot_len))
		return false;
	sk = (struct sock *)e->addr;
	psock = (struct sk_psock *)((__u64)BPF_CORE_READ(sk, sk_user_data) & ~7ULL);
	if (!psock)
		return false;
	queued = BPF_CORE_READ(psock, msg_tot_len);
	rcvbuf = BPF_CORE_READ(sk, sk_rcvbuf);
	return rcvbuf > 0 && queued >= (__u32)rcvbuf;
}

SEC("sk_msg")
int sockredir_skmsg(struct sk_msg_md *msg)
{
	struct sock_key self = {}, peer = {};
	__u32 fam, l4, r4, l6[4], r6[4];
	__u16 lport, rport;
	__u64 netns = bpf_get_netns_cookie(msg);
	__u32 size = msg->size;
	__u8 one = 1;

	READ_TUPLE(msg, fam, l4, r4, l6, r6, lport, rport);
	/* The peer's key is this socket's tuple swapped, in the same network namespace. */
	if (make_key(fam, l4, r4, l6, r6, lport, rport, false, netns, &self) ||
	    make_key(fam, l4, r4, l6, r6, lport, rport, true, netns, &peer)) {
		count(SOCKREDIR_ERROR);
		return SK_PASS;
	}
	if (bpf_map_lookup_elem(&sockredir_bypass, &self)) {
		count(SOCKREDIR_FALLBACK);
		return SK_PASS;
	}
	if (peer_queue_full(&peer)) {
		bpf_map_update_elem(&sockredir_bypass, &self, &one, BPF_ANY);
		count(SOCKREDIR_FLOW_CONTROL);
		count(SOCKREDIR_FALLBACK);
		return SK_PASS;
	}
	if (bpf_msg_redirect_hash(msg, &sockredir_sockhash, &peer, BPF_F_INGRESS) == SK_PASS) {
		count(SOCKREDIR_REDIRECTED);
		count_n(SOCKREDIR_REDIRECTED_BYTES, size);
	} else {
		count(SOCKREDIR_FALLBACK);
	}
	return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
