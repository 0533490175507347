// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Same-node socket redirection (Merbridge pattern), restricted to connections whose two ends are
 * proven to be each other's peer. docs/ebpf-agent.md has the threat model this answers.
 *
 * Identity. Every socket is known by its socket cookie (bpf_get_socket_cookie: a 64-bit number the
 * kernel hands out once per socket and never reuses), and the sockhash is keyed by it, so a
 * redirect names one exact socket: a key freed by a closed socket can never be taken by another.
 *
 * Pairing. sock_ops sees a client socket established (it has the SYN-ACK) before its server
 * socket (it has the final ACK). The client, if its cgroup is allowed and its remote port is
 * selected, is inserted and leaves a pending entry under its tuple AND its snd_nxt/rcv_nxt at
 * establishment (ISN+1 of each direction, the numbers TCP's own handshake proved). The server
 * socket, if ITS cgroup is allowed too, looks the entry up with its own tuple swapped and its own
 * rcv_nxt/snd_nxt: only the socket that took part in that very handshake holds those numbers
 * (initial sequence numbers are keyed hashes of the tuple: secure_tcp_seq), so a socket of
 * another namespace that merely shares the tuple never pairs. Both sockets then record each
 * other's cookie. Loopback tuples also carry the network namespace cookie in the pending key
 * (127.0.0.0/8 exists in every pod); other tuples cannot, because the two pods of a pair sit in
 * two namespaces.
 *
 * Redirect. sk_msg redirects a message into the peer's receive queue only when: this socket's
 * entry names a peer, the namespace is the one recorded, the peer's entry names this socket back,
 * nothing of this direction is still on the TCP path (every byte this socket sent over TCP is
 * acknowledged and the peer has read every byte TCP delivered: then a redirected byte cannot
 * overtake one sent earlier, because tcp_bpf_recvmsg serves the redirect queue first), the
 * peer's queue of redirected bytes is below its sk_rcvbuf (flow control; the field exists on
 * kernels with the "Fix FIONREAD for sockmap" change and is found through CO-RE), and the peer
 * asks for no SO_RCVLOWAT (which only the TCP path honours). Otherwise the message takes the
 * normal TCP path (SK_PASS), in order behind everything already queued.
 *
 * A client whose server never pairs (a remote server, a kube-proxy ClusterIP whose DNAT the client
 * never sees) is evicted at its first RTT sample: its data went over TCP and was acknowledged.
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
	__type(key, __u64); /* socket cookie */
	__type(value, __u64);
} sockredir_sockhash SEC(".maps");

/* cgroup ids whose sockets (either end) may be accelerated; written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u8);
} sockredir_allow SEC(".maps");

/* Every socket in the sockhash, by its cookie. A plain hash (never evicts a live entry). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct sock_conn);
} sockredir_conns SEC(".maps");

/* Clients waiting for their server socket: tuple + sequence numbers -> the client's cookie. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct pair_key);
	__type(value, __u64);
} sockredir_pending SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SOCKREDIR_NR_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} sockredir_counters SEC(".maps");

/*
 * sk_psock.msg_tot_len exists only on kernels with upstream "bpf, sockmap: Fix FIONREAD for
 * sockmap". A flavor of the struct with just that field compiles against any vmlinux.h; libbpf
 * matches it to the running kernel's struct sk_psock at load time, and bpf_core_field_exists()
 * tells the program whether the field is there.
 */
struct sk_psock___fionread {
	u32 msg_tot_len;
} __attribute__((preserve_access_index));

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

/* 127.0.0.0/8, from an address in network byte order. */
static __always_inline bool is_loopback4(__u32 ip)
{
	return (bpf_ntohl(ip) >> 24) == 127;
}

/*
 * The socket's tuple in network byte order. Every context field is read unconditionally at a
 * constant offset: the verifier rejects context loads through a computed pointer. local_port is
 * host order and remote_port holds the network-order port in its upper 16 bits on little-endian
 * hosts, so bpf_ntohl() yields the host-order value.
 */
static __always_inline int tuple_of(struct bpf_sock_ops *skops, __u32 *lip, __u32 *rip,
				    __u16 *lport, __u16 *rport)
{
	__u32 fam = skops->family, l4 = skops->local_ip4, r4 = skops->remote_ip4;
	__u32 l6[4], r6[4];

	l6[0] = skops->local_ip6[0];
	l6[1] = skops->local_ip6[1];
	l6[2] = skops->local_ip6[2];
	l6[3] = skops->local_ip6[3];
	r6[0] = skops->remote_ip6[0];
	r6[1] = skops->remote_ip6[1];
	r6[2] = skops->remote_ip6[2];
	r6[3] = skops->remote_ip6[3];
	*lport = bpf_htons((__u16)skops->local_port);
	*rport = (__u16)bpf_ntohl(skops->remote_port);
	*rport = bpf_htons(*rport);
	if (ip4_of(fam, l4, l6[0], l6[1], l6[2], l6[3], lip) ||
	    ip4_of(fam, r4, r6[0], r6[1], r6[2], r6[3], rip))
		return -1;
	return 0;
}

static __always_inline void pending_key(struct sock_conn *client, struct pair_key *k)
{
	k->netns_cookie = (is_loopback4(client->local_ip4) || is_loopback4(client->remote_ip4)) ?
			  client->netns_cookie : 0;
	k->client_ip4 = client->local_ip4;
	k->server_ip4 = client->remote_ip4;
	k->client_port = client->local_port;
	k->server_port = client->remote_port;
	k->client_snd_nxt = client->snd_nxt;
	k->client_rcv_nxt = client->rcv_nxt;
}

/* The socket's cgroup (the creating task's; an accepted socket inherits its listener's) or one of
 * its ancestors is on the allow-list. */
static __always_inline bool cgroup_allowed(struct tcp_sock *tp)
{
	struct cgroup *cg = BPF_CORE_READ((struct sock *)tp, sk_cgrp_data.cgroup);

	for (int i = 0; i < SOCKREDIR_ALLOW_DEPTH && cg; i++) {
		__u64 id = BPF_CORE_READ(cg, kn, id);

		if (bpf_map_lookup_elem(&sockredir_allow, &id))
			return true;
		cg = BPF_CORE_READ(cg, self.parent, cgroup);
	}
	return false;
}

/* MSG_ZEROCOPY completions are never queued for a message the sk_msg path copied: an application
 * that turned SO_ZEROCOPY on keeps plain TCP. */
static __always_inline bool wants_zerocopy(struct tcp_sock *tp)
{
	unsigned long flags = BPF_CORE_READ((struct sock *)tp, __sk_common.skc_flags);

	return flags & (1UL << bpf_core_enum_value(enum sock_flags, SOCK_ZEROCOPY));
}

/* Fills the entry of an established socket on a selected port whose cgroup is allowed. */
static __always_inline int conn_of(struct bpf_sock_ops *skops, bool client, struct sock_conn *c,
				   struct tcp_sock **tpp)
{
	struct bpf_sock *bsk = skops->sk;
	struct tcp_sock *tp;

	if (tuple_of(skops, &c->local_ip4, &c->remote_ip4, &c->local_port, &c->remote_port))
		return -1; /* not IPv4: the normal path, not an error */
	if (!port_selected(bpf_ntohs(client ? c->remote_port : c->local_port)))
		return -1;
	if (!bsk)
		return -1;
	tp = bpf_skc_to_tcp_sock(bsk);
	if (!tp)
		return -1;
	if (!cgroup_allowed(tp)) {
		count(SOCKREDIR_NOT_ALLOWED);
		return -1;
	}
	if (wants_zerocopy(tp))
		return -1;
	c->addr = (__u64)tp;
	c->netns_cookie = bpf_get_netns_cookie(skops);
	c->snd_nxt = BPF_CORE_READ(tp, snd_nxt);
	c->rcv_nxt = BPF_CORE_READ(tp, rcv_nxt);
	c->client = client;
	*tpp = tp;
	return 0;
}

static __always_inline int insert(struct bpf_sock_ops *skops, __u64 cookie, struct sock_conn *c)
{
	long err = bpf_map_update_elem(&sockredir_conns, &cookie, c, BPF_NOEXIST);

	if (err) {
		count(map_full(err) ? SOCKREDIR_DROPPED : SOCKREDIR_ERROR);
		return -1;
	}
	err = bpf_sock_hash_update(skops, &sockredir_sockhash, &cookie, BPF_NOEXIST);
	if (err) {
		bpf_map_delete_elem(&sockredir_conns, &cookie);
		count(map_full(err) ? SOCKREDIR_DROPPED : SOCKREDIR_ERROR);
		return -1;
	}
	count(SOCKREDIR_INSERTED);
	return 0;
}

static __always_inline void forget(__u64 cookie)
{
	bpf_map_delete_elem(&sockredir_sockhash, &cookie);
	bpf_map_delete_elem(&sockredir_conns, &cookie);
}

static __always_inline void client_established(struct bpf_sock_ops *skops)
{
	struct sock_conn c = {};
	struct pair_key k = {};
	struct tcp_sock *tp;
	__u64 cookie;
	long err;

	if (conn_of(skops, true, &c, &tp))
		return;
	cookie = bpf_get_socket_cookie(skops);
	pending_key(&c, &k);
	err = bpf_map_update_elem(&sockredir_pending, &k, &cookie, BPF_NOEXIST);
	if (err) {
		count(map_full(err) ? SOCKREDIR_DROPPED : SOCKREDIR_ERROR);
		return;
	}
	if (insert(skops, cookie, &c)) {
		bpf_map_delete_elem(&sockredir_pending, &k);
		return;
	}
	/* The first RTT sample tells whether a pair formed; TCP_CLOSE cleans up. */
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG |
				  BPF_SOCK_OPS_RTT_CB_FLAG);
}

static __always_inline void server_established(struct bpf_sock_ops *skops)
{
	struct sock_conn s = {}, *client;
	struct pair_key k = {};
	struct tcp_sock *tp;
	__u64 cookie, *client_cookie, cc;

	if (conn_of(skops, false, &s, &tp))
		return;
	/* What the client recorded: its tuple is ours swapped, its snd_nxt our rcv_nxt, its rcv_nxt
	 * our snd_nxt (nothing was sent or received past the handshake when each side's callback ran:
	 * sock_ops runs before the segment that completed the handshake queues its payload). */
	k.netns_cookie = (is_loopback4(s.local_ip4) || is_loopback4(s.remote_ip4)) ? s.netns_cookie : 0;
	k.client_ip4 = s.remote_ip4;
	k.server_ip4 = s.local_ip4;
	k.client_port = s.remote_port;
	k.server_port = s.local_port;
	k.client_snd_nxt = s.rcv_nxt;
	k.client_rcv_nxt = s.snd_nxt;
	client_cookie = bpf_map_lookup_elem(&sockredir_pending, &k);
	if (!client_cookie) {
		count(SOCKREDIR_UNPAIRED);
		return;
	}
	cc = *client_cookie;
	client = bpf_map_lookup_elem(&sockredir_conns, &cc);
	if (!client || client->peer_cookie || !client->client) {
		count(SOCKREDIR_UNPAIRED);
		return;
	}
	cookie = bpf_get_socket_cookie(skops);
	s.peer_cookie = cc;
	if (insert(skops, cookie, &s))
		return;
	client->peer_cookie = cookie;
	bpf_map_delete_elem(&sockredir_pending, &k);
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

/*
 * RTT_CB on a client: an ACK for data it sent over TCP. An unpaired client leaves the sockhash:
 * nothing was ever redirected into it (only its peer could, and the peer was never inserted), so
 * its receive side holds nothing the removal could drop. Either way the question is settled.
 */
static __always_inline void settle_client(struct bpf_sock_ops *skops)
{
	__u64 cookie = bpf_get_socket_cookie(skops);
	struct sock_conn *c = bpf_map_lookup_elem(&sockredir_conns, &cookie);
	struct pair_key k = {};

	if (c && !c->peer_cookie) {
		pending_key(c, &k);
		bpf_map_delete_elem(&sockredir_pending, &k);
		forget(cookie);
		count(SOCKREDIR_EVICTED);
		bpf_sock_ops_cb_flags_set(skops, 0);
		return;
	}
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_RTT_CB_FLAG);
}

static __always_inline void closed(struct bpf_sock_ops *skops)
{
	__u64 cookie = bpf_get_socket_cookie(skops);
	struct sock_conn *c = bpf_map_lookup_elem(&sockredir_conns, &cookie);
	struct pair_key k = {};

	if (!c)
		return;
	if (c->client && !c->peer_cookie) {
		pending_key(c, &k);
		bpf_map_delete_elem(&sockredir_pending, &k);
	}
	/* SOCKHASH unlinks a closing socket itself; the explicit delete keeps the map honest. */
	forget(cookie);
	count(SOCKREDIR_REMOVED);
}

SEC("sockops")
int sockredir_sockops(struct bpf_sock_ops *skops)
{
	switch (skops->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		client_established(skops);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		server_established(skops);
		break;
	case BPF_SOCK_OPS_RTT_CB:
		settle_client(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (skops->args[1] == TCP_CLOSE) /* args[1] is the new state */
			closed(skops);
		break;
	default:
		break;
	}
	return 1;
}

/* Nothing of this direction is still on the TCP path: every byte the sender gave TCP is
 * acknowledged, and the receiver has read every byte TCP delivered. */
static __always_inline bool tcp_path_empty(struct tcp_sock *self, struct tcp_sock *peer)
{
	return self->snd_una == self->write_seq &&
	       BPF_CORE_READ(peer, copied_seq) == BPF_CORE_READ(peer, rcv_nxt);
}

/* Bytes already redirected into the peer's queue and not yet read, against its receive buffer. */
static __always_inline bool peer_queue_full(struct sock *sk)
{
	struct sk_psock___fionread *psock;
	__u32 queued;
	int rcvbuf;

	if (!bpf_core_field_exists(struct sk_psock___fionread, msg_tot_len))
		return false;
	psock = (void *)((__u64)BPF_CORE_READ(sk, sk_user_data) & ~7ULL);
	if (!psock)
		return false;
	queued = BPF_CORE_READ(psock, msg_tot_len);
	rcvbuf = BPF_CORE_READ(sk, sk_rcvbuf);
	return rcvbuf > 0 && queued >= (__u32)rcvbuf;
}

/*
 * sk_msg programs may not call bpf_get_socket_cookie(); sock_ops called it when the socket was
 * inserted, which stored the cookie in sk_cookie for good (sock_gen_cookie), so it is read from
 * there, through the BTF pointer bpf_skc_to_tcp_sock() returns (direct loads, no helper call).
 */
SEC("sk_msg")
int sockredir_skmsg(struct sk_msg_md *msg)
{
	struct bpf_sock *bsk = msg->sk;
	struct sock_conn *self, *peer;
	struct tcp_sock *tp;
	__u64 cookie, peer_cookie;
	struct sock *peer_sk;
	__u32 size = msg->size;

	tp = bsk ? bpf_skc_to_tcp_sock(bsk) : NULL;
	if (!tp) {
		count(SOCKREDIR_FALLBACK);
		return SK_PASS;
	}
	cookie = tp->inet_conn.icsk_inet.sk.__sk_common.skc_cookie.counter;
	self = bpf_map_lookup_elem(&sockredir_conns, &cookie);
	if (!self || !self->peer_cookie) {
		count(SOCKREDIR_FALLBACK);
		return SK_PASS;
	}
	peer_cookie = self->peer_cookie;
	peer = bpf_map_lookup_elem(&sockredir_conns, &peer_cookie);
	if (!peer) { /* the peer closed */
		self->redirecting = 0;
		count(SOCKREDIR_FALLBACK);
		return SK_PASS;
	}
	if (peer->peer_cookie != cookie || self->netns_cookie != bpf_get_netns_cookie(msg)) {
		self->redirecting = 0;
		count(SOCKREDIR_PEER_MISMATCH);
		count(SOCKREDIR_FALLBACK);
		return SK_PASS;
	}
	peer_sk = (struct sock *)peer->addr;
	/* The TCP path is checked until it is found empty; from then on every message of this
	 * direction is redirected until one is passed, so it stays empty without looking again. */
	if ((!self->redirecting && !tcp_path_empty(tp, (struct tcp_sock *)peer_sk)) ||
	    BPF_CORE_READ(peer_sk, sk_rcvlowat) > 1) {
		self->redirecting = 0;
		count(SOCKREDIR_ORDERED);
		count(SOCKREDIR_FALLBACK);
		return SK_PASS;
	}
	if (peer_queue_full(peer_sk)) {
		self->redirecting = 0;
		count(SOCKREDIR_FLOW_CONTROL);
		count(SOCKREDIR_FALLBACK);
		return SK_PASS;
	}
	if (bpf_msg_redirect_hash(msg, &sockredir_sockhash, &peer_cookie, BPF_F_INGRESS) == SK_PASS) {
		self->redirecting = 1;
		count(SOCKREDIR_REDIRECTED);
		count_n(SOCKREDIR_REDIRECTED_BYTES, size);
	} else {
		self->redirecting = 0;
		count(SOCKREDIR_FALLBACK);
	}
	return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
