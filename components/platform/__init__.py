"""The platform layer every domain builds on: the `ClusterHandle` each cluster component exposes
(`cluster_handle.py`), the platform-wide config (namespaces, observability) and the add-ons every
cluster gets (kube-prometheus-stack, KEDA: `addons.py`, values in `addons_values.py`). It imports no
domain: the wiring that builds every configured cluster and puts the agent, serving and router on it
stands above the domains, in `components/wiring.py`."""
