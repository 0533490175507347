// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Same-node socket redirection (Merbridge pattern), restricted to connections whose two ends are
 * proven to be each other's peer, and to the socket calls whose TCP semantics the redirect keeps.
 * docs/ebpf-agent.md has the threat model and the table of socket features this answers.
 *
 * Identity. Every socket is known by its socket cookie (bpf_get_socket_cookie: a 64-bit number the
 * kernel hands out once per socket and never reuses), and the sockhash is keyed by it, so a
 * redirect names one exact socket: a key freed by a closed socket can never be taken by another.
 *
 * Pairing. sock_ops sees a client socket established (it has the SYN-ACK) before its server
 * socket (it has the final ACK). The client, if its cgroup is allowed, its remote port selected
 * and its handshake real (a SYN-ACK, not repair mode), draws a 64-bit random nonce, leaves a
 * pending entry under its tuple and that nonce, and writes the nonce in a TCP option (kind 254,
 * RFC 6994) into every segment it sends until it is paired. The server socket, if ITS cgroup is
 * allowed too and it is a listener's child (no struct socket yet: a connect()ed socket that met a
 * simultaneous open has one), reads the option from the segment that created it and looks the
 * entry up with its own tuple swapped and that nonce. Only a socket that received the client's own
 * segment knows the nonce: it is never derived from anything another namespace can see or guess
 * (sequence numbers are). Loopback tuples also carry the network namespace cookie in the key.
 *
 * Redirect. sk_msg redirects a message into the peer's receive queue only when: this socket's
 * entry names a peer, the peer's entry names this socket back,
 * neither end is TCP-only (below), both ends are still on the allow-list, nothing of this
 * direction is still on the TCP path (every byte this socket sent over TCP is acknowledged and the
 * peer has read every byte TCP delivered: then a redirected byte cannot overtake one sent earlier,
 * because tcp_bpf_recvmsg serves the redirect queue first) and the peer's queue of redirected
 * bytes is below its sk_rcvbuf (flow control). Otherwise the message takes the normal TCP path
 * (SK_PASS), in order behind everything already queued.
 *
 * TCP-only. A pair goes back to TCP for good, before the call that needs it runs, when either end
 * uses a socket feature that only TCP's own calls implement: splice/sendfile reads, MSG_OOB,
 * MSG_WAITALL, MSG_TRUNC, SO_RCVLOWAT, SO_PEEK_OFF, SO_ZEROCOPY, zero-copy receive, kTLS (TCP_ULP,
 * or a TLS record as the first message), TCP_REPAIR; when a FIN is sent or received (half-close);
 * when one direction streams (SOCKREDIR_STREAM_MSGS messages without a reply); or when an end
 * leaves the allow-list. Calls and options are seen at syscall entry (raw tracepoint sys_enter). The features, not the streams, are also
 * remembered per cgroup: that pod's later sockets are never inserted. Once a socket's pair is
 * TCP-only, its redirect queue is empty and its peer's sk_msg has not run for
 * SOCKREDIR_EVICT_GRACE_NS, it leaves the sockhash at its next RTT sample, and with it tcp_bpf's
 * socket calls.
 *
 * A client whose server never pairs (a remote server, a kube-proxy ClusterIP whose DNAT the client
 * never sees) is evicted at its first RTT sample: its data went over TCP and was acknowledged.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include "sockredir.h"

#define AF_INET 2
#define AF_INET6 10
#define E2BIG 7
#define ENOMEM 12
#define ENOSPC 28
#define TCPHDR_SYN 0x02
#define TCPHDR_ACK 0x10
/* include/uapi/asm-generic/socket.h, include/uapi/linux/tcp.h, include/linux/socket.h */
#define SOL_SOCKET 1
#define SO_RCVLOWAT 18
#define SO_PEEK_OFF 42
#define SO_ZEROCOPY 60
#define SOL_TCP 6
#define TCP_REPAIR 19
#define TCP_ULP 31
#define TCP_ZEROCOPY_RECEIVE 35
#define MSG_OOB 0x1
#define MSG_TRUNC 0x20
#define MSG_WAITALL 0x100

/* Syscall numbers: arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h. */
#if defined(__TARGET_ARCH_x86)
#define NR_mmap 9
#define NR_sendfile 40
#define NR_sendto 44
#define NR_recvfrom 45
#define NR_sendmsg 46
#define NR_recvmsg 47
#define NR_setsockopt 54
#define NR_getsockopt 55
#define NR_splice 275
#define NR_recvmmsg 299
#define NR_sendmmsg 307
#elif defined(__TARGET_ARCH_arm64)
#define NR_splice 76
#define NR_sendfile 71
#define NR_sendto 206
#define NR_recvfrom 207
#define NR_setsockopt 208
#define NR_getsockopt 209
#define NR_sendmsg 211
#define NR_recvmsg 212
#define NR_mmap 222
#define NR_recvmmsg 243
#define NR_sendmmsg 269
#else
#error "sockredir: syscall numbers for this architecture"
#endif

#define BIT(r) (1U << (r))

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

/* Bumped by the agent whenever it removes an entry from sockredir_allow: each pair then checks
 * its two allow entries again at its next message. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} sockredir_gen SEC(".maps");

/* Every socket in the sockhash, by its cookie. A plain hash (never evicts a live entry). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct sock_conn);
} sockredir_conns SEC(".maps");

/* Clients waiting for their server socket: tuple + nonce -> the client's cookie. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct pair_key);
	__type(value, __u64);
} sockredir_pending SEC(".maps");

/* Cgroups that used a TCP-only feature on an accelerated socket -> 1 << reason: their new
 * sockets are never inserted. The agent drops entries of deleted cgroups. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u32);
} sockredir_learned SEC(".maps");

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

struct nonce_opt {
	__u8 kind;
	__u8 len;
	__u8 magic[2];
	__u64 nonce;
} __attribute__((packed));

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
	k->nonce = client->nonce;
	k->client_ip4 = client->local_ip4;
	k->server_ip4 = client->remote_ip4;
	k->client_port = client->local_port;
	k->server_port = client->remote_port;
}

static __always_inline __u64 allow_gen(void)
{
	__u32 zero = 0;
	__u64 *g = bpf_map_lookup_elem(&sockredir_gen, &zero);

	return g ? *g : 0;
}

/* The allow-list entry that admits the socket: its cgroup (the creating task's; an accepted
 * socket inherits its listener's) or the nearest listed ancestor; 0 if none. *own is the
 * socket's own cgroup id. */
static __always_inline __u64 allow_of(struct tcp_sock *tp, __u64 *own)
{
	struct cgroup *cg = BPF_CORE_READ((struct sock *)tp, sk_cgrp_data.cgroup);

	*own = 0;
	for (int i = 0; i < SOCKREDIR_ALLOW_DEPTH && cg; i++) {
		__u64 id = BPF_CORE_READ(cg, kn, id);

		if (i == 0)
			*own = id;
		if (bpf_map_lookup_elem(&sockredir_allow, &id))
			return id;
		cg = BPF_CORE_READ(cg, self.parent, cgroup);
	}
	return 0;
}

/* Options set before the connection was established that only TCP's own calls honour:
 * SO_ZEROCOPY (completions), SO_RCVLOWAT, SO_PEEK_OFF, a ULP (kTLS). */
static __always_inline bool tcp_only_options(struct tcp_sock *tp)
{
	struct sock *sk = (struct sock *)tp;
	unsigned long flags = BPF_CORE_READ(sk, __sk_common.skc_flags);

	if (flags & (1UL << bpf_core_enum_value(enum sock_flags, SOCK_ZEROCOPY)))
		return true;
	if (BPF_CORE_READ(sk, sk_rcvlowat) > 1 || BPF_CORE_READ(sk, sk_peek_off) >= 0)
		return true;
	return BPF_CORE_READ(tp, inet_conn.icsk_ulp_ops);
}

/* The redirect queue of a socket in the sockhash holds nothing (list_empty(&psock->ingress_msg)). */
static __always_inline bool queue_empty(struct sock *sk)
{
	struct sk_psock *psock = (void *)((__u64)BPF_CORE_READ(sk, sk_user_data) & ~7ULL);

	if (!psock)
		return true;
	return BPF_CORE_READ(psock, ingress_msg.next) == &psock->ingress_msg;
}

static __always_inline void count_reasons(__u32 bits)
{
	for (__u32 r = 0; r < SOCKREDIR_NR_REASONS; r++)
		if (bits & BIT(r))
			count(SOCKREDIR_REASON_BASE + r);
}

/* tcp_only is only ever OR'ed: a racing writer can lose the other's bit (counters, learning) but
 * never make it 0 again, and any bit sends the pair to TCP. */
static __always_inline void mark(struct sock_conn *c, __u32 bits, bool counted)
{
	__u32 old = c->tcp_only;

	c->tcp_only = old | bits;
	if (counted)
		count_reasons(bits & ~old);
}

/* Both ends of the pair go back to TCP (the peer, if there is one yet). */
static __always_inline void mark_pair(struct sock_conn *c, __u32 bits)
{
	__u64 pc = c->peer_cookie;
	struct sock_conn *p;

	mark(c, bits, true);
	if (pc) {
		p = bpf_map_lookup_elem(&sockredir_conns, &pc);
		if (p)
			mark(p, bits, false);
	}
}

static __always_inline void learn(__u64 cgroup_id, __u32 bits)
{
	__u32 *v;

	bits &= SOCKREDIR_LEARNED_MASK;
	if (!bits || !cgroup_id)
		return;
	v = bpf_map_lookup_elem(&sockredir_learned, &cgroup_id);
	if (v)
		*v |= bits;
	else if (bpf_map_update_elem(&sockredir_learned, &cgroup_id, &bits, BPF_NOEXIST) == -E2BIG)
		count(SOCKREDIR_DROPPED);
}

enum reader { READS_NOTHING, READS_OWN, READS_PEER };

/*
 * A socket call that only TCP implements is about to run on c's socket. Its pair goes back to TCP
 * before it runs, so every later byte is TCP's; bytes already redirected to the reader and not
 * read yet are counted as late (that one call sees them through the redirect queue). `reader`
 * says whose queue the call reads: c's own, its peer's (MSG_OOB sends), or none (send options).
 */
static __always_inline void tcp_only(struct sock_conn *c, __u32 bits, enum reader reader)
{
	struct sock_conn *p = NULL;
	__u64 pc = c->peer_cookie;
	__u64 sk = 0;

	if (pc)
		p = bpf_map_lookup_elem(&sockredir_conns, &pc);
	if (p && !((c->tcp_only | p->tcp_only) & bits))
		sk = reader == READS_OWN ? c->addr : reader == READS_PEER ? p->addr : 0;
	if (sk && !queue_empty((struct sock *)sk))
		count(SOCKREDIR_LATE);
	learn(c->cgroup_id, bits);
	mark_pair(c, bits);
}

/* Fills the entry of an established socket on a selected port whose cgroup is allowed. */
static __always_inline int conn_of(struct bpf_sock_ops *skops, bool client, struct sock_conn *c,
				   struct tcp_sock **tpp)
{
	struct bpf_sock *bsk = skops->sk;
	struct tcp_sock *tp;
	__u64 own;

	if (tuple_of(skops, &c->local_ip4, &c->remote_ip4, &c->local_port, &c->remote_port))
		return -1; /* not IPv4: the normal path, not an error */
	if (!port_selected(bpf_ntohs(client ? c->remote_port : c->local_port)))
		return -1;
	if (!bsk)
		return -1;
	tp = bpf_skc_to_tcp_sock(bsk);
	if (!tp)
		return -1;
	c->allow_id = allow_of(tp, &own);
	if (!c->allow_id) {
		count(SOCKREDIR_NOT_ALLOWED);
		return -1;
	}
	if (bpf_map_lookup_elem(&sockredir_learned, &own)) {
		count(SOCKREDIR_LEARNED);
		return -1;
	}
	if (BPF_CORE_READ_BITFIELD_PROBED(tp, repair)) { /* established by connect() in repair mode */
		count(SOCKREDIR_NOT_HANDSHAKE);
		return -1;
	}
	if (tcp_only_options(tp))
		return -1;
	c->addr = (__u64)tp;
	c->netns_cookie = bpf_get_netns_cookie(skops);
	c->cgroup_id = own;
	c->allow_gen = allow_gen();
	c->client = client;
	*tpp = tp;
	return 0;
}

static __always_inline int insert(struct bpf_sock_ops *skops, __u64 cookie, struct sock_conn *c)
{
	long err = bpf_map_update_elem(&sockredir_conns, &cookie, c, BPF_NOEXIST);
	struct sock *sk = (struct sock *)c->addr;
	struct sock_conn *entry;

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
	/* The psock exists now, and stays until the socket leaves the sockhash (when its entry goes
	 * too). Its receive buffer as of now bounds its redirect queue: autotuning only grows it, on
	 * TCP's receive path, so the bound errs small. */
	entry = bpf_map_lookup_elem(&sockredir_conns, &cookie);
	if (entry) {
		entry->psock = (__u64)BPF_CORE_READ(sk, sk_user_data) & ~7ULL;
		entry->rcvbuf = BPF_CORE_READ(sk, sk_rcvbuf);
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
	/* Established by the SYN-ACK it received. A socket connect()ed in repair mode is established
	 * by tcp_finish_connect(sk, NULL), with no segment at all (net/ipv4/tcp_output.c tcp_connect). */
	if ((skops->skb_tcp_flags & (TCPHDR_SYN | TCPHDR_ACK)) != (TCPHDR_SYN | TCPHDR_ACK)) {
		count(SOCKREDIR_NOT_HANDSHAKE);
		return;
	}
	c.nonce = ((__u64)bpf_get_prandom_u32() << 32) | bpf_get_prandom_u32();
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
	/* The nonce rides on every segment until a server pairs; the first RTT sample tells whether
	 * one did; TCP_CLOSE and FINs are state changes. */
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG |
				  BPF_SOCK_OPS_RTT_CB_FLAG | BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
}

/* A client still waiting for its server: reserve room for the nonce option, or stop writing it. */
static __always_inline void option_len(struct bpf_sock_ops *skops)
{
	__u64 cookie = bpf_get_socket_cookie(skops);
	struct sock_conn *c = bpf_map_lookup_elem(&sockredir_conns, &cookie);

	if (c && c->client && !c->peer_cookie) {
		bpf_reserve_hdr_opt(skops, SOCKREDIR_OPT_LEN, 0);
		return;
	}
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
}

static __always_inline void option_write(struct bpf_sock_ops *skops)
{
	__u64 cookie = bpf_get_socket_cookie(skops);
	struct sock_conn *c = bpf_map_lookup_elem(&sockredir_conns, &cookie);
	struct nonce_opt opt = {
		.kind = SOCKREDIR_OPT_KIND,
		.len = SOCKREDIR_OPT_LEN,
		.magic = { SOCKREDIR_OPT_MAGIC >> 8, SOCKREDIR_OPT_MAGIC & 0xff },
	};

	if (!c || !c->client)
		return;
	opt.nonce = c->nonce;
	bpf_store_hdr_opt(skops, &opt, sizeof(opt), 0);
}

static __always_inline void server_established(struct bpf_sock_ops *skops)
{
	struct sock_conn s = {}, *client;
	struct nonce_opt opt = {
		.kind = SOCKREDIR_OPT_KIND,
		.len = 4, /* search by kind and 2-byte magic (bpf_load_hdr_opt) */
		.magic = { SOCKREDIR_OPT_MAGIC >> 8, SOCKREDIR_OPT_MAGIC & 0xff },
	};
	struct pair_key k = {};
	struct tcp_sock *tp;
	__u64 cookie, *client_cookie, cc;

	if (conn_of(skops, false, &s, &tp))
		return;
	/* A listener's child has no struct socket until accept() grafts one, and accept() needs the
	 * socket lock this callback runs under (net/ipv4/af_inet.c __inet_accept). A socket that
	 * connect()ed and met a simultaneous open reaches this callback too, with its own socket. */
	if (BPF_CORE_READ((struct sock *)tp, sk_socket)) {
		count(SOCKREDIR_NOT_HANDSHAKE);
		return;
	}
	if (bpf_load_hdr_opt(skops, &opt, sizeof(opt), 0) != SOCKREDIR_OPT_LEN) {
		count(SOCKREDIR_UNPAIRED);
		return;
	}
	s.nonce = opt.nonce;
	k.netns_cookie = (is_loopback4(s.local_ip4) || is_loopback4(s.remote_ip4)) ? s.netns_cookie : 0;
	k.nonce = s.nonce;
	k.client_ip4 = s.remote_ip4;
	k.server_ip4 = s.local_ip4;
	k.client_port = s.remote_port;
	k.server_port = s.local_port;
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
	s.tcp_only = client->tcp_only; /* the client went back to TCP before its server appeared */
	if (insert(skops, cookie, &s))
		return;
	client->peer_cookie = cookie;
	bpf_map_delete_elem(&sockredir_pending, &k);
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG |
				  BPF_SOCK_OPS_RTT_CB_FLAG);
}

/*
 * RTT_CB: an ACK for data the socket sent over TCP. An unpaired client leaves the sockhash: nothing
 * was ever redirected into it (only its peer could, and the peer was never inserted). A socket
 * whose pair went back to TCP leaves it once its redirect queue is empty and its peer's sk_msg has
 * not run for the grace (a one-way stream's sender at once: its reader sends nothing).
 */
static __always_inline void rtt_sample(struct bpf_sock_ops *skops)
{
	__u64 cookie = bpf_get_socket_cookie(skops);
	struct sock_conn *c = bpf_map_lookup_elem(&sockredir_conns, &cookie);
	struct pair_key k = {};

	if (!c)
		return;
	if (!c->peer_cookie) {
		pending_key(c, &k);
		bpf_map_delete_elem(&sockredir_pending, &k);
		forget(cookie);
		count(SOCKREDIR_EVICTED);
		bpf_sock_ops_cb_flags_set(skops, 0);
		return;
	}
	if (!c->tcp_only || bpf_ktime_get_coarse_ns() - c->peer_sent_ns < SOCKREDIR_EVICT_GRACE_NS)
		return;
	if (!queue_empty((struct sock *)c->addr))
		return;
	forget(cookie);
	count(SOCKREDIR_RETURNED);
	bpf_sock_ops_cb_flags_set(skops, 0);
}

static __always_inline void state_changed(struct bpf_sock_ops *skops, __u32 state)
{
	__u64 cookie = bpf_get_socket_cookie(skops);
	struct sock_conn *c = bpf_map_lookup_elem(&sockredir_conns, &cookie);
	struct pair_key k = {};

	if (!c || state == TCP_ESTABLISHED) /* a child's SYN_RECV -> ESTABLISHED comes after its callback */
		return;
	if (state != TCP_CLOSE) {
		/* FIN_WAIT1 (shutdown or close), CLOSE_WAIT (a FIN came in), ...: TCP keeps the FIN
		 * behind the bytes before it and fails sends after it (EPIPE). */
		mark_pair(c, BIT(SOCKREDIR_R_SHUTDOWN));
		return;
	}
	if (c->client && !c->peer_cookie) {
		pending_key(c, &k);
		bpf_map_delete_elem(&sockredir_pending, &k);
	}
	/* Only the entry goes. The socket stays in the sockhash, its redirect queue readable, until
	 * close() unlinks it (sock_map_close): after a half-close the peer's last reply may still be
	 * queued there, and TCP keeps a closed socket's received bytes readable too. */
	bpf_map_delete_elem(&sockredir_conns, &cookie);
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
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
		option_len(skops);
		break;
	case BPF_SOCK_OPS_WRITE_HDR_OPT_CB:
		option_write(skops);
		break;
	case BPF_SOCK_OPS_RTT_CB:
		rtt_sample(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		state_changed(skops, skops->args[1]); /* args[1] is the new state */
		break;
	default:
		break;
	}
	return 1;
}

/* The conns entry of the socket behind a file descriptor of the calling task, if it is one of
 * ours. A socket's file points back at it (sock->file), which no other file's private data does. */
static __always_inline struct sock_conn *conn_of_fd(long fd)
{
	struct task_struct *task = (void *)bpf_get_current_task();
	struct fdtable *fdt = BPF_CORE_READ(task, files, fdt);
	struct file **fds = BPF_CORE_READ(fdt, fd);
	struct file *f = NULL;
	struct socket *sock;
	struct sock *sk;
	__u64 cookie;

	if (fd < 0 || fd >= BPF_CORE_READ(fdt, max_fds))
		return NULL;
	if (bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]) || !f)
		return NULL;
	sock = BPF_CORE_READ(f, private_data);
	if (!sock || BPF_CORE_READ(sock, file) != f)
		return NULL;
	sk = BPF_CORE_READ(sock, sk);
	if (!sk)
		return NULL;
	cookie = BPF_CORE_READ(sk, __sk_common.skc_cookie.counter);
	return cookie ? bpf_map_lookup_elem(&sockredir_conns, &cookie) : NULL;
}

static __always_inline __u32 recv_reasons(unsigned long flags)
{
	return (flags & MSG_OOB ? BIT(SOCKREDIR_R_OOB) : 0) |
	       (flags & MSG_WAITALL ? BIT(SOCKREDIR_R_WAITALL) : 0) |
	       (flags & MSG_TRUNC ? BIT(SOCKREDIR_R_TRUNC) : 0);
}

/* Options that only TCP's own calls honour: SO_RCVLOWAT above 1 and SO_PEEK_OFF (tcp_recvmsg;
 * tcp_bpf_recvmsg returns whatever the redirect queue holds, from its start), SO_ZEROCOPY
 * (completions are queued by tcp_sendmsg_locked only), TCP_ULP (kTLS) and TCP_REPAIR. The value
 * is read from the caller's memory; if it cannot be, the option counts as set. */
static __always_inline __u32 option_reasons(long level, long name, void *optval)
{
	int v = 1;

	if (level == SOL_SOCKET && (name == SO_RCVLOWAT || name == SO_PEEK_OFF || name == SO_ZEROCOPY) &&
	    bpf_probe_read_user(&v, sizeof(v), optval))
		v = 1;
	if (level == SOL_SOCKET && name == SO_RCVLOWAT)
		return v > 1 ? BIT(SOCKREDIR_R_RCVLOWAT) : 0;
	if (level == SOL_SOCKET && name == SO_PEEK_OFF)
		return v >= 0 ? BIT(SOCKREDIR_R_PEEK_OFF) : 0;
	if (level == SOL_SOCKET && name == SO_ZEROCOPY)
		return v ? BIT(SOCKREDIR_R_ZEROCOPY) : 0;
	if (level == SOL_TCP && name == TCP_ULP)
		return BIT(SOCKREDIR_R_TLS);
	if (level == SOL_TCP && name == TCP_REPAIR)
		return BIT(SOCKREDIR_R_REPAIR); /* on or off: a repaired socket is never trusted again */
	return 0;
}

/*
 * Socket calls whose per-call flags, path or options only TCP implements, seen at syscall entry
 * (before the call runs): recv with MSG_OOB/MSG_WAITALL/MSG_TRUNC (tcp_bpf_recvmsg ignores them),
 * splice/sendfile reading the socket (tcp_splice_read reads only the TCP receive queue), send
 * with MSG_OOB (the redirect carries no urgent pointer), mmap of the socket and
 * TCP_ZEROCOPY_RECEIVE (tcp_zerocopy_receive maps only TCP's queue), and setsockopt of the
 * options above.
 */
SEC("raw_tracepoint/sys_enter")
int sockredir_sys_enter(struct bpf_raw_tracepoint_args *ctx)
{
	struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
	unsigned long flags;
	struct sock_conn *c;
	enum reader reader = READS_OWN;
	__u32 bits;
	long fd;

	switch (ctx->args[1]) {
	case NR_recvfrom:
	case NR_recvmmsg:
		flags = PT_REGS_PARM4_CORE_SYSCALL(regs);
		bits = recv_reasons(flags);
		break;
	case NR_recvmsg:
		flags = PT_REGS_PARM3_CORE_SYSCALL(regs);
		bits = recv_reasons(flags);
		break;
	case NR_sendto:
	case NR_sendmmsg:
		flags = PT_REGS_PARM4_CORE_SYSCALL(regs);
		bits = flags & MSG_OOB ? BIT(SOCKREDIR_R_OOB) : 0;
		reader = READS_PEER;
		break;
	case NR_sendmsg:
		flags = PT_REGS_PARM3_CORE_SYSCALL(regs);
		bits = flags & MSG_OOB ? BIT(SOCKREDIR_R_OOB) : 0;
		reader = READS_PEER;
		break;
	case NR_splice:
		bits = BIT(SOCKREDIR_R_SPLICE);
		break;
	case NR_sendfile:
		bits = BIT(SOCKREDIR_R_SPLICE);
		break;
	case NR_mmap:
		bits = BIT(SOCKREDIR_R_ZC_RECV);
		break;
	case NR_getsockopt:
		bits = PT_REGS_PARM2_CORE_SYSCALL(regs) == SOL_TCP &&
		       PT_REGS_PARM3_CORE_SYSCALL(regs) == TCP_ZEROCOPY_RECEIVE ? BIT(SOCKREDIR_R_ZC_RECV) : 0;
		break;
	case NR_setsockopt:
		bits = option_reasons(PT_REGS_PARM2_CORE_SYSCALL(regs), PT_REGS_PARM3_CORE_SYSCALL(regs),
				      (void *)PT_REGS_PARM4_CORE_SYSCALL(regs));
		if (bits & (BIT(SOCKREDIR_R_ZEROCOPY) | BIT(SOCKREDIR_R_REPAIR)))
			reader = READS_NOTHING; /* sender-side */
		break;
	default:
		return 0;
	}
	if (!bits)
		return 0;
	switch (ctx->args[1]) {
	case NR_sendfile:
		fd = PT_REGS_PARM2_CORE_SYSCALL(regs); /* in_fd */
		break;
	case NR_mmap:
		fd = (int)PT_REGS_PARM5_CORE_SYSCALL(regs);
		break;
	default:
		fd = (int)PT_REGS_PARM1_CORE_SYSCALL(regs);
		break;
	}
	c = conn_of_fd(fd);
	if (c)
		tcp_only(c, bits, reader);
	return 0;
}

/* Nothing of this direction is still on the TCP path: every byte the sender gave TCP is
 * acknowledged, and the receiver has read every byte TCP delivered. */
static __always_inline bool tcp_path_empty(struct tcp_sock *self, struct tcp_sock *peer)
{
	return self->snd_una == self->write_seq &&
	       BPF_CORE_READ(peer, copied_seq) == BPF_CORE_READ(peer, rcv_nxt);
}

/* Bytes already redirected into the peer's queue and not yet read, against its receive buffer
 * (both recorded when it was inserted: one read per message). */
static __always_inline bool peer_queue_full(struct sock_conn *peer)
{
	struct sk_psock___fionread *psock = (void *)peer->psock;

	if (!bpf_core_field_exists(struct sk_psock___fionread, msg_tot_len) || !psock)
		return false;
	return peer->rcvbuf > 0 && BPF_CORE_READ(psock, msg_tot_len) >= peer->rcvbuf;
}

/* A TLS record header (content type 20..24, version 3.x): a kTLS connection's handshake. */
static __always_inline bool tls_record(struct sk_msg_md *msg)
{
	__u8 *d = msg->data, *end = msg->data_end;

	if (d + 3 > end)
		return false;
	return d[0] >= 20 && d[0] <= 24 && d[1] == 3 && d[2] <= 4;
}

static __always_inline int pass(struct sock_conn *self, __u32 why)
{
	if (self)
		self->redirecting = 0;
	if (why)
		count(why);
	count(SOCKREDIR_FALLBACK);
	return SK_PASS;
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
	__u64 cookie, peer_cookie, gen, now;
	struct sock *peer_sk;
	__u32 size = msg->size;

	tp = bsk ? bpf_skc_to_tcp_sock(bsk) : NULL;
	if (!tp)
		return pass(NULL, 0);
	cookie = tp->inet_conn.icsk_inet.sk.__sk_common.skc_cookie.counter;
	self = bpf_map_lookup_elem(&sockredir_conns, &cookie);
	if (!self)
		return pass(NULL, 0);
	if (self->msgs < 2 && self->msgs++ == 0 && tls_record(msg)) {
		learn(self->cgroup_id, BIT(SOCKREDIR_R_TLS));
		mark_pair(self, BIT(SOCKREDIR_R_TLS));
	}
	if (!self->peer_cookie)
		return pass(self, 0);
	peer_cookie = self->peer_cookie;
	peer = bpf_map_lookup_elem(&sockredir_conns, &peer_cookie);
	if (!peer) /* the peer closed or left the sockhash */
		return pass(self, 0);
	if (peer->peer_cookie != cookie)
		return pass(self, SOCKREDIR_PEER_MISMATCH);
	/* Before tcp_only is read: the peer leaves the sockhash only once this is older than the
	 * grace, so a redirect chosen below is never into a socket being unlinked. Refreshed in
	 * steps, so a steady pair does not write the peer's entry on every message. */
	now = bpf_ktime_get_coarse_ns();
	if (now - peer->peer_sent_ns > SOCKREDIR_SENT_NS_STEP)
		peer->peer_sent_ns = now;
	/* A stream: more than SOCKREDIR_STREAM_MSGS messages while the peer's count stood still
	 * (each end writes only its own entry). */
	if (peer->sent != self->seen_peer) {
		self->seen_peer = peer->sent;
		self->streak = 0;
	}
	self->sent++;
	if (++self->streak > SOCKREDIR_STREAM_MSGS && !(self->tcp_only & BIT(SOCKREDIR_R_STREAM)))
		mark_pair(self, BIT(SOCKREDIR_R_STREAM));
	if (self->tcp_only | peer->tcp_only)
		return pass(self, SOCKREDIR_TCP_ONLY);
	gen = allow_gen();
	if (self->allow_gen != gen) {
		if (!bpf_map_lookup_elem(&sockredir_allow, &self->allow_id) ||
		    !bpf_map_lookup_elem(&sockredir_allow, &peer->allow_id)) {
			mark_pair(self, BIT(SOCKREDIR_R_NOT_ALLOWED));
			return pass(self, SOCKREDIR_TCP_ONLY);
		}
		self->allow_gen = gen;
	}
	peer_sk = (struct sock *)peer->addr;
	/* The TCP path is checked until it is found empty; from then on every message of this
	 * direction is redirected until one is passed, so it stays empty without looking again. */
	if (!self->redirecting && !tcp_path_empty(tp, (struct tcp_sock *)peer_sk))
		return pass(self, SOCKREDIR_ORDERED);
	if (peer_queue_full(peer))
		return pass(self, SOCKREDIR_FLOW_CONTROL);
	if (bpf_msg_redirect_hash(msg, &sockredir_sockhash, &peer_cookie, BPF_F_INGRESS) != SK_PASS)
		return pass(self, 0);
	if (!self->redirecting)
		self->redirecting = 1;
	count(SOCKREDIR_REDIRECTED);
	count_n(SOCKREDIR_REDIRECTED_BYTES, size);
	return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
