"""The platform's wiring: the `ClusterHandle` every cluster component exposes
(`cluster_handle.py`), the platform-wide config (namespaces, observability), the add-ons every cluster
gets (kube-prometheus-stack, KEDA: `addons.py`, values in `addons_values.py`) and `build.py`, which
builds each configured cluster and puts the agent and the serving stacks on it."""
