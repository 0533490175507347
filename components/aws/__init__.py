"""AWS: the VPC, EKS through pulumi-eks, Cilium as the CNI (kube-proxy replacement, ENI IPAM), and
Karpenter with spot GPU NodePools, an on-demand fallback, the SQS/EventBridge interruption queue and an
EC2NodeClass whose AL2023 nodeadm NodeConfig sets the NUMA kubelet. `config.py` holds the AWS
cluster's config model; `*_specs.py`, `*_values.py`, `nodeadm.py`, `network.py` and `eks.py` are the
pure deciders; `cluster.py`, `karpenter.py` and `cilium.py` are the components that wire them."""
