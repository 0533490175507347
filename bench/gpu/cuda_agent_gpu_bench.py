# SPDX-License-Identifier: Apache-2.0
"""What the eBPF agent's CUDA probes cost a real model on a real GPU, and whether they count every
launch (issue 35). One run, side by side, rounds alternating the order of the modes:

- off:      no agent;
- sampled:  the agent with cudalat at --fraction of every --period seconds (the budget it keeps);
- always:   the agent with its probes attached all the time (fraction 1: what a launch pays inside
            a window, and exact counts to check against the launches made).

Workloads (bench/gpu/workloads.py): a random-weight decoder of Llama 3.2 1B's shape, bf16, batch 1,
greedy, decoded eagerly and by replaying one CUDA graph per token; 1-element `x.add_(1)` launches;
a CUDA graph of 100 tiny kernels, replayed. Each runs for --seconds per (round, mode).

Prints the time per unit, each mode's ratio to off, and the launches the agent counted against the
launches made (kernel launches from the profiler's kernel count for the eager decoder; graph
launches from the replays), with the share of time the windows covered. Exits 0 with `SKIP: <why>`
where it cannot run (no torch, no CUDA GPU, not root, no libbpf, objects not built, no BTF).
Run on the device: bench/gpu/run_on_device.sh (it mounts bpffs and points the agent at the libbpf
carried from here).
"""
from __future__ import annotations

import argparse
import ctypes.util
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BPF = os.path.join(REPO, "bpf")
sys.path.insert(0, BPF)
sys.path.insert(0, HERE)

KERNEL_LAUNCHES = ("cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cuGraphLaunch",)
WORKLOADS = ("decode-eager", "decode-graph", "tiny-launch", "graph-100")
UNITS = {"decode-eager": ("ms/token", 1e3), "decode-graph": ("ms/token", 1e3),
         "tiny-launch": ("us/launch", 1e6), "graph-100": ("us/graph", 1e6)}


def skip_reason(bpf_dir: str, libbpf: str | None) -> str | None:
    """Why this machine cannot run the benchmark (None: it can)."""
    try:
        import torch
    except ImportError as e:
        return f"no torch ({e})"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    if os.geteuid() != 0:
        return "not root (the agent loads eBPF programs and mounts bpffs)"
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return "no kernel BTF (/sys/kernel/btf/vmlinux)"
    if not os.path.exists(os.path.join(bpf_dir, "cudalat.bpf.o")):
        return f"{bpf_dir}/cudalat.bpf.o not built (make -C bpf here, or bench/gpu/prepare.sh and carry it)"
    if not (libbpf and os.path.exists(libbpf)) and not ctypes.util.find_library("bpf"):
        return "no libbpf.so.1 (set LIBBPF_SO; bench/gpu/prepare.sh copies Debian's)"
    return None


# ---- the agent ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """{metric name + sorted labels: value} from the agent's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name + json.dumps(dict(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def launch_counts(m: dict[str, float]) -> dict[str, float]:
    """Calls counted per `call` label (summed over workloads/cgroups), the covered seconds and windows."""
    out: dict[str, float] = {"sampled_s": 0.0, "windows": 0.0}
    for key, v in m.items():
        name, labels = key.split("{", 1)
        if name in ("ebpf_cuda_call_enqueue_seconds_count", "ebpf_cuda_call_blocking_seconds_count"):
            call = json.loads("{" + labels)["call"]
            out[call] = out.get(call, 0.0) + v
        elif name == "ebpf_cuda_sampled_seconds_total":
            out["sampled_s"] = v
        elif name == "ebpf_cuda_sample_windows_total":
            out["windows"] = v
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


class Agent:
    """`python -m agent --programs cudalat` on the CUDA libraries this process maps."""

    def __init__(self, libs: list[str], pin_dir: str, bpf_dir: str, fraction: float, period: float, libbpf: str | None):
        self.port = free_port()
        env = dict(os.environ)
        if libbpf:
            env["LIBBPF_SO"] = libbpf
            env["LD_LIBRARY_PATH"] = os.path.dirname(libbpf) + ":" + env.get("LD_LIBRARY_PATH", "")
        cmd = [sys.executable, "-m", "agent", "--programs", "cudalat", "--bpf-dir", bpf_dir, "--pin-dir", pin_dir,
               "--metrics-addr", "127.0.0.1", "--metrics-port", str(self.port), "--cuda-scan", "false",
               "--cuda-libs", ",".join(libs), "--cuda-sample-fraction", repr(fraction),
               "--cuda-sample-period-seconds", repr(period), "--unpin-on-exit", "true", "--log-level", "WARNING"]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, cwd=BPF, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                m = scrape(self.port)
                if m.get('ebpf_program_loaded{"program": "cudalat"}') == 1:
                    self.mode = next((json.loads("{" + k.split("{", 1)[1])["mode"] for k in m
                                      if k.startswith("ebpf_cuda_attach_mode_info")), "?")
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self.log.seek(0)
                raise RuntimeError(f"the agent did not load cudalat:\n{self.log.read()[-3000:]}")
            time.sleep(0.2)

    def counts(self) -> dict[str, float]:
        return launch_counts(scrape(self.port))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


# ---- the run --------------------------------------------------------------------------------


def cuda_libraries() -> list[str]:
    """The libcuda and libcudart files this process maps (after CUDA is initialized)."""
    from agent.cudalibs import parse_maps

    with open("/proc/self/maps") as f:
        found = parse_maps(f.read())
    return sorted({os.path.realpath(path) for _kind, path in found})


def made(workload: str, units: int, per_token: float | None, per_reset: float | None, chunk: int) -> float | None:
    """Launches a run made of the kind the agent counts for it: kernel launches (eager decode, the
    tiny loop) or graph launches (one per replay). An eager decode run is `units` tokens in chunks of
    `chunk`, each chunk starting with a reset."""
    if workload == "decode-eager":
        if per_token is None or per_reset is None:
            return None
        return units * per_token + units // chunk * per_reset
    return float(units)


def run(a) -> dict:
    import torch

    from workloads import Decoder, Shape, decode, graph_of_100, kernels_per_call, replay, tiny_launches

    torch.zeros(1, device="cuda")
    libs = cuda_libraries()
    if not any("libcuda." in os.path.basename(p) for p in libs):
        raise RuntimeError(f"this process maps no libcuda.so: {libs}")
    dec = Decoder(torch, Shape(), "cuda", torch.bfloat16)
    dec.reset()
    for _ in range(8):
        dec.step()
    graph = dec.capture()
    g100 = graph_of_100(torch)
    x = torch.zeros(1, device="cuda")
    jobs = {"decode-eager": lambda t: decode(dec, t), "decode-graph": lambda t: decode(dec, t, graph),
            "tiny-launch": lambda t: tiny_launches(torch, x, t), "graph-100": lambda t: replay(torch, g100, t)}
    for job in jobs.values():  # warm-up, one chunk each: cuBLAS handles, allocator, clocks
        job(0)

    bpffs = tempfile.mkdtemp(prefix="gpuinfra-bench-bpffs-")
    subprocess.run(["mount", "-t", "bpf", "bpf", bpffs], check=True, timeout=30)
    modes = {m: f for m, f in {"off": None, "sampled": a.fraction, "always": 1.0}.items() if m in a.modes}
    results: dict[str, dict[str, list]] = {w: {m: [] for m in modes} for w in WORKLOADS}
    counts: dict[str, dict[str, list]] = {w: {m: [] for m in modes} for w in WORKLOADS}
    attach_mode = "?"
    try:
        for r in range(a.rounds):
            order = list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]
            for mode in order:
                agent = None
                if modes[mode] is not None:
                    agent = Agent(libs, os.path.join(bpffs, f"pins-{r}-{mode}"), a.bpf_dir, modes[mode],
                                  a.period, a.libbpf)
                    attach_mode = agent.mode
                try:
                    for w in a.workloads:
                        before = agent.counts() if agent else {}
                        t0 = time.monotonic()
                        units, elapsed = jobs[w](a.seconds)
                        wall = time.monotonic() - t0
                        results[w][mode].append(elapsed / units)
                        if agent:
                            d = delta(before, agent.counts())
                            calls = GRAPH_LAUNCHES if w in ("decode-graph", "graph-100") else KERNEL_LAUNCHES
                            seen = sum(d.get(c, 0.0) for c in calls)
                            counts[w][mode].append({"seen": seen, "units": units, "covered": d["sampled_s"] / wall,
                                                    "windows": d["windows"],
                                                    "other": {k: v for k, v in d.items() if v and k not in calls
                                                              and k not in ("sampled_s", "windows")}})
                        print(f"round {r + 1} {mode:8s} {w:13s} {elapsed / units * UNITS[w][1]:10.3f} {UNITS[w][0]}",
                              flush=True)
                finally:
                    if agent:
                        agent.stop()
    finally:
        subprocess.run(["umount", "-l", bpffs], check=False, timeout=30)
    # The launches made, from the profiler (CUPTI), after every timed run: its callbacks must not
    # slow any of them. An eager token's kernels, and the kernels of the reset that starts a chunk.
    dec.reset()
    per_token = kernels_per_call(torch, dec.step, 32) or None  # 0: the profiler saw nothing
    per_reset = kernels_per_call(torch, dec.reset, 8)
    for w in WORKLOADS:
        for rows in counts[w].values():
            for row in rows:
                row["made"] = made(w, row["units"], per_token, per_reset, dec.s.max_len)
    return {"results": results, "counts": counts, "kernels_per_token": per_token, "attach_mode": attach_mode,
            "libraries": libs, "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0)}


def table(out: dict, a) -> str:
    med = {w: {m: statistics.median(v) for m, v in out["results"][w].items() if v} for w in WORKLOADS}

    def cell(m: dict, mode: str, scale: float) -> str:
        return f"{m[mode] * scale:.3f}" if mode in m else "n/a"

    lines = [f"| workload | off | sampled ({a.fraction:g} of {a.period:g} s) | ratio | always on | ratio | "
             "counted/made (always) | counted/made (sampled), windows' share | sampled/off by round (min-max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w in WORKLOADS:
        unit, scale = UNITS[w]
        m = med[w]
        if not m:
            continue

        def ratio(mode: str) -> str:
            return f"{m[mode] / m['off']:.3f}x" if mode in m and "off" in m else "n/a"

        def seen(mode: str) -> str:
            rows = out["counts"][w].get(mode, [])
            if not rows or rows[0]["made"] is None:
                return "n/a (no profiler count)" if rows else "n/a"
            got, made = sum(x["seen"] for x in rows), sum(x["made"] for x in rows)
            cov = sum(x["covered"] for x in rows) / len(rows)
            return f"{got:,.0f}/{made:,.0f} = {got / made:.4f}" + (f", {cov:.3f}" if mode == "sampled" else "")

        # Each round runs every mode back to back: its own ratio shows the spread the medians hide.
        by_round = [s / o for s, o in zip(out["results"][w].get("sampled", []), out["results"][w].get("off", []))]
        spread = f"{min(by_round):.3f}-{max(by_round):.3f}" if by_round else "n/a"
        lines.append(f"| {w} ({unit}) | {cell(m, 'off', scale)} | {cell(m, 'sampled', scale)} | {ratio('sampled')} | "
                     f"{cell(m, 'always', scale)} | {ratio('always')} | {seen('always')} | {seen('sampled')} | {spread} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0, help="per workload, round and mode")
    ap.add_argument("--fraction", type=float, default=0.1, help="the sampled mode's share (the stack's default)")
    ap.add_argument("--period", type=float, default=2.0,
                    help="the sampled mode's period; shorter than the stack's 30 s so that every run spans "
                         "several windows (15x the window switches of the default: an upper bound on their cost)")
    ap.add_argument("--workloads", type=lambda s: [w for w in s.split(",") if w], default=list(WORKLOADS),
                    help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=["off", "sampled", "always"],
                    help="comma-separated subset of off,sampled,always")
    ap.add_argument("--bpf-dir", default=os.path.join(BPF, "build"))
    ap.add_argument("--libbpf", default=os.environ.get("LIBBPF_SO"))
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    if set(a.workloads) - set(WORKLOADS) or set(a.modes) - {"off", "sampled", "always"} or "off" not in a.modes:
        ap.error(f"--workloads from {','.join(WORKLOADS)}; --modes from off,sampled,always and including off")
    reason = skip_reason(a.bpf_dir, a.libbpf)
    if reason:
        print(f"SKIP: {reason}")
        return 0
    out = run(a)
    out.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               kernel=platform.release(), rounds=a.rounds, seconds=a.seconds, fraction=a.fraction, period=a.period)
    print(f"\n{out['gpu']}, torch {out['torch']} (CUDA {out['cuda']}), kernel {out['kernel']}, {out['date']}; "
          f"cudalat attach mode {out['attach_mode']}; probed {', '.join(out['libraries'])}; "
          f"kernels per eager token (profiler): {out['kernels_per_token']}; medians of {a.rounds} rounds x "
          f"{a.seconds:g} s\n")
    print(table(out, a))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
