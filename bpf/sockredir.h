/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Shared between sockredir.bpf.c and the agent (agent/sockredir.py mirrors the layout). */
#ifndef GPUINFRA_SOCKREDIR_H
#define GPUINFRA_SOCKREDIR_H

#define SOCKREDIR_MAX_PORTS 16

/* Runtime knobs, the only variable in .rodata (the agent writes it at offset 0 before load). */
struct sockredir_cfg {
	__u16 ports[SOCKREDIR_MAX_PORTS]; /* host byte order */
	__u32 nr_ports;
};

/* One TCP connection as seen from one socket. Every field is in network byte order. */
struct sock_key {
	__u32 local_ip4;
	__u32 remote_ip4;
	__u16 local_port;
	__u16 remote_port;
};

enum sockredir_counter {
	SOCKREDIR_REDIRECTED = 0, /* sk_msg found the peer and redirected */
	SOCKREDIR_FALLBACK = 1,   /* sk_msg found no local peer: normal TCP stack */
	SOCKREDIR_ERROR = 2,      /* insert failed or unsupported address family */
	SOCKREDIR_INSERTED = 3,   /* established sockets added to the sockhash */
	SOCKREDIR_REMOVED = 4,    /* TCP_CLOSE state callbacks */
	SOCKREDIR_NR_COUNTERS = 5,
};

#endif
