"""Reusable Pulumi components and the pure deciders behind them, one folder per domain: `aws/`,
`gcp/`, `existing/` (the three cluster shapes), `serving/` (vLLM), `agent/` (the eBPF agent's
DaemonSet) and `platform/` (the cluster handle, add-ons and the wiring). Beside them sit the pieces
every domain shares: the config base types (`config_types.py`), the GPU-pool base and CPU
arithmetic (`node_pools.py`), the stack model with its cross-domain rules (`stack_config.py`), config
loading (`config_loader.py`), the GPU catalog (`catalog.py`, `data/`), the cost estimate (`cost.py`)
and the stack-output contract (`contract.py`)."""
