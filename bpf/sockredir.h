/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Shared between sockredir.bpf.c and the agent (agent/programs.py mirrors the layout). */
#ifndef GPUINFRA_SOCKREDIR_H
#define GPUINFRA_SOCKREDIR_H

#define SOCKREDIR_MAX_PORTS 16
/* How many cgroup levels above a socket's own cgroup the allow-list check walks. */
#define SOCKREDIR_ALLOW_DEPTH 8

/* Runtime knobs, the only variable in .rodata (the agent writes it at offset 0 before load). */
struct sockredir_cfg {
	__u16 ports[SOCKREDIR_MAX_PORTS]; /* host byte order */
	__u32 nr_ports;
};

/*
 * A connection waiting for its server side, as the client saw it when it was established: its
 * tuple (network byte order) and its sequence numbers then. The server socket finds it by its own
 * tuple swapped and its own rcv_nxt/snd_nxt, so only a socket that received exactly the client's
 * initial sequence number and sent the one the client acknowledged can pair; netns_cookie is set
 * for loopback tuples (both ends share a namespace there) and 0 otherwise (pod-to-pod pairs are in
 * two namespaces).
 */
struct pair_key {
	__u64 netns_cookie;
	__u32 client_ip4;
	__u32 server_ip4;
	__u16 client_port;
	__u16 server_port;
	__u32 client_snd_nxt; /* == the server's rcv_nxt at its establishment */
	__u32 client_rcv_nxt; /* == the server's snd_nxt at its establishment */
	__u32 pad;
};

/* sockredir_conns value, keyed by the socket's own cookie (bpf_get_socket_cookie: unique for the
 * boot, never reused). The sockhash is keyed by the same cookie. */
struct sock_conn {
	__u64 addr;         /* struct sock *, read only with bpf_probe_read_kernel */
	__u64 peer_cookie;  /* 0 until the pair is proven */
	__u64 netns_cookie; /* the socket's namespace; sk_msg checks it */
	__u32 local_ip4;    /* the tuple, network byte order (for the agent's view) */
	__u32 remote_ip4;
	__u16 local_port;
	__u16 remote_port;
	__u32 snd_nxt;      /* at establishment (clients: the pending key) */
	__u32 rcv_nxt;
	__u32 client;       /* 1: the active (connecting) end */
	__u32 redirecting;  /* sk_msg: this direction's TCP path was found empty and nothing was
			     * passed to TCP since, so it still is */
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
	SOCKREDIR_UNPAIRED = 7,    /* server sockets with no client of the same tuple and sequence numbers */
	SOCKREDIR_FLOW_CONTROL = 8, /* messages passed to TCP because the peer's queue was full */
	SOCKREDIR_DROPPED = 9,     /* inserts refused because a map was full */
	SOCKREDIR_EVICTED = 10,    /* client sockets removed because no server socket ever paired */
	SOCKREDIR_ORDERED = 11,    /* messages passed to TCP because TCP still held bytes of this direction */
	SOCKREDIR_PEER_MISMATCH = 12, /* sk_msg refused a redirect: peer or namespace did not check out */
	SOCKREDIR_NR_COUNTERS = 13,
};

#endif
