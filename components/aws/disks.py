"""Pure decider: which disk holds a GPU pool's model cache on AWS, how fast it reads, and the
EC2NodeClass settings that put the cache there.

- `instance-store` (default): every GPU type in the catalog has local NVMe (p5.48xlarge: 30.4 TB).
  `instanceStorePolicy: RAID0` makes Karpenter's generated nodeadm NodeConfig stripe the disks into
  `/dev/md/0`, mounted at `/mnt/k8s-disks/0`, with kubelet's and containerd's state bind-mounted onto
  it (Karpenter v1.15 concepts/nodeclasses.md "spec.instanceStorePolicy"; awslabs/amazon-eks-ami
  templates/al2023/runtime/bin/setup-local-disks @81fec2e8). The model cache's hostPath goes under
  that mount point, not on the root volume.
- `root-volume`: the weights land on the gp3 root volume, so it gets provisioned throughput (gp3's
  baseline is 125 MiB/s) and the IOPS that throughput needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from components.catalog import InstanceType

RAID0_MOUNT = "/mnt/k8s-disks/0"
NVME_MODEL_CACHE_PATH = f"{RAID0_MOUNT}/models"

# gp3 (Karpenter v1.15 EC2NodeClass CRD, blockDeviceMappings[].ebs.throughput: "Minimum value of 125.
# Maximum value of 1000."; iops: "gp3: 3,000-16,000 IOPS"). EBS user guide, gp3: throughput may be
# at most 0.25 MiB/s per provisioned IOPS (https://docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html).
GP3_BASELINE_MIB_S = 125
GP3_MAX_MIB_S = 1000
GP3_BASELINE_IOPS = 3000
GP3_MIB_S_PER_IOPS = 0.25

NVME_READ_FLOOR_MIB_S = 650
"""A floor, not a measurement of these types: one older-generation NVMe instance-store device
(m5d.4xlarge, 300 GB) read 688-819 MB/s uncached with `hdparm -t` (third-party,
https://gist.github.com/ouranos/bcad6055ff7cfe5c3903a60ff5c3ade4). A RAID0 of N newer devices
reads faster, so a cold-start budget computed from this is long enough, never too short. AWS
publishes no sequential-read figure for these types' instance store."""

ModelCache = Literal["instance-store", "root-volume"]


@dataclass(frozen=True)
class CacheDisk:
    kind: ModelCache
    read_mib_s: int
    """Sustained read rate of the volume holding the model cache (GpuPoolInfo.cache_read_mib_s)."""
    host_path: str | None
    """Where the model cache's hostPath must live on the node; None: the serving default."""
    gp3_throughput_mib_s: int | None = None
    gp3_iops: int | None = None


def ebs_mib_s(t: InstanceType) -> int:
    """The instance's EBS bandwidth (Mbps, Karpenter's `instance-ebs-bandwidth`) in MiB/s."""
    return int(t.ebs_mbps * 1_000_000 / 8 / 2**20)


def gp3_settings(types: list[InstanceType]) -> tuple[int, int]:
    """(throughput MiB/s, IOPS) for a root volume that holds weights: as fast as gp3 goes, but no
    faster than the slowest type's EBS bandwidth (more would be paid for and never delivered)."""
    throughput = max(GP3_BASELINE_MIB_S, min(GP3_MAX_MIB_S, min(ebs_mib_s(t) for t in types)))
    iops = max(GP3_BASELINE_IOPS, math.ceil(throughput / GP3_MIB_S_PER_IOPS))
    return throughput, iops


def model_cache_disk(types: list[InstanceType], where: ModelCache) -> CacheDisk:
    """The disk that holds the model cache for a pool of `types` (validated: `instance-store` only
    when every type has NVMe)."""
    if where == "instance-store":
        if not all(t.local_nvme_gb > 0 for t in types):
            raise ValueError(f"no instance store on {[t.name for t in types if not t.local_nvme_gb]}")
        return CacheDisk("instance-store", NVME_READ_FLOOR_MIB_S, NVME_MODEL_CACHE_PATH)
    throughput, iops = gp3_settings(types)
    return CacheDisk("root-volume", throughput, None, throughput, iops)
