"""gpu-inference-platform: GPU spot clusters on AWS/GCP, the eBPF agent and vLLM serving.

The stack's config is the only input: parse it once, build every cluster and the platform layers
on it, export the stack-output contract. `pulumi up` and the offline render run this same file.
"""

import pulumi

from components.config_loader import load_stack_config
from components.platform import build_platform

loaded = load_stack_config()
layers = build_platform(loaded)

pulumi.export("environment", loaded.stack.environment)
pulumi.export("clusters", {name: {"cloud": l.handle.cloud, "region": l.handle.region} for name, l in layers.items()})
