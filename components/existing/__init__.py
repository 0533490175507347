"""Existing clusters: a cluster this platform does not manage, reached through a kubeconfig from a
secret config value or another stack's output, so the serving layer and the eBPF agent can land on
it. `config.py` describes its GPU node groups (for validation only); `cluster.py` is the
`ExistingCluster` component."""
