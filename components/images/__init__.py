"""The project's own images: the eBPF agent (`bpf/Dockerfile`) and the runtime image
(`runtime/Dockerfile`: drain sidecar, pre-warm, router watcher). `config.py` says where they come
from (built by `pulumi up` and pushed to each cluster's registry, or prebuilt by digest),
`specs.py` decides tags, repository names and retention, and `images.py` builds them with
pulumi-docker-build and hands the workloads `<repository>@sha256:<digest>` references."""
