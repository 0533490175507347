/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Shared between tcpbp.bpf.c and the agent (agent/programs.py mirrors the layout). */
#ifndef GPUINFRA_TCPBP_H
#define GPUINFRA_TCPBP_H

/* Runtime knobs, the only variable in .rodata (the agent writes it at offset 0 before load). */
struct tcpbp_cfg {
	__u32 threshold_pct; /* queued * 100 > sndbuf * threshold_pct is backpressure */
};

/* Per-cgroup TCP send-path counters. events / samples is the backpressure ratio. */
struct tcpbp_counts {
	__u64 samples; /* send-path observations */
	__u64 events;  /* observations with the send queue above the threshold */
	__u64 blocked; /* sends that had to wait for send-buffer space */
};

#endif
