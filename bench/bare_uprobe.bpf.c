// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The floor for the CUDA probe benchmark: a uprobe and a uretprobe that do nothing. What cudalat
 * costs above this pair is the cost of its own work (maps, timestamps); the rest is the kernel's
 * breakpoint and return-trampoline traps, which any uprobe pays. */
struct pt_regs;

__attribute__((section("uprobe"), used)) int bare_enter(struct pt_regs *ctx)
{
	return 0;
}

__attribute__((section("uretprobe"), used)) int bare_exit(struct pt_regs *ctx)
{
	return 0;
}

char LICENSE[] __attribute__((section("license"), used)) = "Dual BSD/GPL";
