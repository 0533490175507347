"""The eBPF agent's Kubernetes side: its config model (`config.py`), the DaemonSet, Service and
ServiceMonitor deciders (`daemonset_spec.py`) and the `EbpfAgent` component (`ebpf_agent.py`). The
programs and the agent itself live in `bpf/` at the repository root."""
