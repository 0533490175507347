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
 * One TCP connection as seen from one socket. The addresses and ports are in network byte order;
 * netns_cookie (bpf_get_netns_cookie) keeps two pods that both talk over 127.0.0.1 with the same
 * ports apart; it is 0 for any other tuple (pod IPs are unique on a node, and a pod-to-pod pair
 * spans two namespaces).
 */
struct sock_key {
	__u64 netns_cookie;
	__u32 local_ip4;
	__u32 remote_ip4;
	__u16 local_port;
	__u16 remote_port;
	__u32 pad;
};

/* sockredir_socks value: where the socket is, and whether its pair ever formed. */
struct sock_entry {
	__u64 addr;   /* struct sock *, read only with bpf_probe_read_kernel */
	__u32 paired; /* set on the client's entry when its server socket is inserted */
	__u32 pad;
};

enum sockredir_counter {
	SOCKREDIR_REDIRECTED = 0,  /* sk_msg found the peer and redirected (messages) */
	SOCKREDIR_FALLBACK = 1,    /* sk_msg found no local peer: normal TCP stack */
	SOCKREDIR_ERROR = 2,       /* insert failed or unsupported address family */
	SOCKREDIR_INSERTED = 3,    /* established sockets added to the sockhash */
	SOCKREDIR_REMOVED = 4,     /* TCP_CLOSE state callbacks */
	SOCKREDIR_REDIRECTED_BYTES = 5, /* payload bytes of the redirected messages */
	SOCKREDIR_NOT_ALLOWED = 6, /* client sockets on a selected port whose cgroup is not allowed */
	SOCKREDIR_UNPAIRED = 7,    /* server sockets whose client is not in the sockhash: not inserted */
	SOCKREDIR_FLOW_CONTROL = 8, /* sockets moved back to TCP because the peer's queue was full */
	SOCKREDIR_DROPPED = 9,     /* inserts refused because a map was full */
	SOCKREDIR_EVICTED = 10,    /* client sockets removed because no server socket ever paired */
	SOCKREDIR_NR_COUNTERS = 11,
};

#endif
