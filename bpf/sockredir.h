/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Shared between sockredir.bpf.c and the agent (agent/sockredir.py mirrors the layout). */
#ifndef GPUINFRA_SOCKREDIR_H
#define GPUINFRA_SOCKREDIR_H

#define SOCKREDIR_MAX_PORTS 16
/* How many cgroup levels above a socket's own cgroup the allow-list check walks. */
#define SOCKREDIR_ALLOW_DEPTH 8
/* A direction that sends more than this many messages while the other sends none is a stream:
 * the pair goes back to TCP (the default leaves streams alone: bench/README.md). */
#define SOCKREDIR_STREAM_MSGS 4
/* A socket whose pair went back to TCP leaves the sockhash (and gets TCP's own socket calls back)
 * no sooner than this after its peer's sk_msg last ran: a sendmsg that chose the redirect then may
 * still be on its way into this socket's queue, and unlinking would drop it. */
#define SOCKREDIR_EVICT_GRACE_NS 1000000000ULL
/* peer_sent_ns is refreshed at most this often (so a steady pair does not write the peer's entry
 * on every message); the grace above then holds with this much less margin. */
#define SOCKREDIR_SENT_NS_STEP 100000000ULL

/* The client's proof of the handshake, in a TCP option of kind 254 (RFC 6994 experimental) with
 * this 16-bit ExID: 2 + 2 + 8 bytes. */
#define SOCKREDIR_OPT_KIND 254
#define SOCKREDIR_OPT_LEN 12
#define SOCKREDIR_OPT_MAGIC 0x6770 /* "gp" */

/* Runtime knobs, the only variable in .rodata (the agent writes it at offset 0 before load). */
struct sockredir_cfg {
	__u16 ports[SOCKREDIR_MAX_PORTS]; /* host byte order */
	__u32 nr_ports;
};

/*
 * A client waiting for its server side: its tuple (network byte order) and the 64-bit random
 * nonce it puts in its TCP option after the handshake. The server socket finds it by its own
 * tuple swapped and the nonce in the segment that created it, so only a socket that received
 * that client's segment can pair. netns_cookie is set for loopback tuples (both ends share a
 * namespace there) and 0 otherwise (pod-to-pod pairs are in two namespaces).
 */
struct pair_key {
	__u64 netns_cookie;
	__u64 nonce;
	__u32 client_ip4;
	__u32 server_ip4;
	__u16 client_port;
	__u16 server_port;
	__u32 pad;
};

/* Why a pair takes TCP for good (sock_conn.tcp_only). The low ones are learned per cgroup. */
enum sockredir_reason {
	SOCKREDIR_R_SPLICE = 0,   /* splice(2)/sendfile(2) read from the socket */
	SOCKREDIR_R_OOB = 1,      /* MSG_OOB sent or received */
	SOCKREDIR_R_WAITALL = 2,  /* recv(MSG_WAITALL) */
	SOCKREDIR_R_TRUNC = 3,    /* recv(MSG_TRUNC): TCP discards */
	SOCKREDIR_R_RCVLOWAT = 4, /* SO_RCVLOWAT > 1 */
	SOCKREDIR_R_PEEK_OFF = 5, /* SO_PEEK_OFF */
	SOCKREDIR_R_ZEROCOPY = 6, /* SO_ZEROCOPY (MSG_ZEROCOPY completions come from TCP only) */
	SOCKREDIR_R_ZC_RECV = 7,  /* mmap() of the socket or TCP_ZEROCOPY_RECEIVE */
	SOCKREDIR_R_TLS = 8,      /* TCP_ULP (kTLS) or a TLS record as the first message */
	SOCKREDIR_R_REPAIR = 9,   /* TCP_REPAIR */
	SOCKREDIR_R_LEARNED_END = 10,
	SOCKREDIR_R_SHUTDOWN = 10, /* a FIN sent or received: half-close keeps TCP's order and errors */
	SOCKREDIR_R_STREAM = 11,   /* one direction streams */
	SOCKREDIR_R_NOT_ALLOWED = 12, /* an end left the allow-list */
	SOCKREDIR_NR_REASONS = 13,
};
#define SOCKREDIR_LEARNED_MASK ((1U << SOCKREDIR_R_LEARNED_END) - 1)

/* sockredir_conns value, keyed by the socket's own cookie (bpf_get_socket_cookie: unique for the
 * boot, never reused). The sockhash is keyed by the same cookie. */
struct sock_conn {
	__u64 addr;         /* struct sock *, read only with bpf_probe_read_kernel */
	__u64 psock;        /* its struct sk_psock * once in the sockhash (read the same way) */
	__u64 peer_cookie;  /* 0 until the pair is proven */
	__u64 netns_cookie; /* the socket's namespace; sk_msg checks it */
	__u64 nonce;        /* clients: the one they send; servers: the one they received */
	__u64 cgroup_id;    /* the socket's own cgroup (learned reasons are kept per cgroup) */
	__u64 allow_id;     /* the allow-list entry (this cgroup or an ancestor) that admitted it */
	__u64 allow_gen;    /* sockredir_gen when allow_id was last found on the list */
	__u64 peer_sent_ns; /* when the peer's sk_msg last ran (bpf_ktime_get_ns), written before it
			     * looks at tcp_only: no redirect into this socket was chosen after it */
	__u32 local_ip4;    /* the tuple, network byte order (for the agent's view) */
	__u32 remote_ip4;
	__u16 local_port;
	__u16 remote_port;
	__u32 tcp_only;     /* 1 << enum sockredir_reason: the pair takes TCP; only ever OR'ed */
	__u32 client;       /* 1: the active (connecting) end */
	__u32 redirecting;  /* sk_msg: this direction's TCP path was found empty and nothing was
			     * passed to TCP since, so it still is */
	__u32 streak;       /* messages sent since the peer last sent one */
	__u32 msgs;         /* messages sk_msg saw from this socket (saturates at 2) */
	__u32 sent;         /* messages this socket sent while paired (wraps) */
	__u32 seen_peer;    /* the peer's `sent` when this socket last sent: a change means it spoke */
	__u32 rcvbuf;       /* sk_rcvbuf when inserted: the flow-control bound on its redirect queue */
	__u32 pad;
};

enum sockredir_counter {
	SOCKREDIR_REDIRECTED = 0,  /* sk_msg found the peer and redirected (messages) */
	SOCKREDIR_FALLBACK = 1,    /* sk_msg passed the message to the normal TCP stack */
	SOCKREDIR_ERROR = 2,       /* insert failed or unsupported address family */
	SOCKREDIR_INSERTED = 3,    /* established sockets added to the sockhash */
	SOCKREDIR_REMOVED = 4,     /* TCP_CLOSE state callbacks of inserted sockets */
	SOCKREDIR_REDIRECTED_BYTES = 5, /* payload bytes of the redirected messages */
	SOCKREDIR_NOT_ALLOWED = 6, /* sockets on a selected port whose cgroup is not allowed */
	SOCKREDIR_UNPAIRED = 7,    /* server sockets with no client of the same tuple and nonce */
	SOCKREDIR_FLOW_CONTROL = 8, /* messages passed to TCP because the peer's queue was full */
	SOCKREDIR_DROPPED = 9,     /* inserts refused because a map was full */
	SOCKREDIR_EVICTED = 10,    /* client sockets removed because no server socket ever paired */
	SOCKREDIR_ORDERED = 11,    /* messages passed to TCP because TCP still held bytes of this direction */
	SOCKREDIR_PEER_MISMATCH = 12, /* sk_msg refused a redirect: peer or namespace did not check out */
	SOCKREDIR_NOT_HANDSHAKE = 13, /* sockets refused: repair mode, simultaneous open, no option */
	SOCKREDIR_LEARNED = 14,    /* sockets not inserted: their cgroup used a TCP-only feature before */
	SOCKREDIR_TCP_ONLY = 15,   /* messages passed to TCP because their pair went back to TCP */
	SOCKREDIR_RETURNED = 16,   /* sockets that left the sockhash after their pair went back to TCP */
	SOCKREDIR_LATE = 17,       /* TCP-only features first used with redirected bytes still unread */
	SOCKREDIR_REASON_BASE = 18, /* + enum sockredir_reason: pairs that went back to TCP, by reason */
	SOCKREDIR_NR_COUNTERS = SOCKREDIR_REASON_BASE + SOCKREDIR_NR_REASONS,
};

#endif
