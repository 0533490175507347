"""GCP: a VPC with pod/service ranges and Cloud NAT, and GKE with private nodes, Workload Identity and
Dataplane V2, spot GPU node pools with a NUMA `kubelet_config`, and an on-demand fallback (a twin pool
or a ComputeClass). `config.py` is the GCP cluster's config model, `specs.py` the pure deciders and
`cluster.py` the `GcpGpuCluster` component."""
