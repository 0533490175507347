"""gpu-inference-platform: GPU spot clusters on AWS/GCP, the eBPF agent and vLLM serving.

The stack's config is the only input: parse it once, build every cluster and the platform layers
on it, export the stack-output contract. `pulumi up` and the offline render run this same file.
"""

import pulumi

from components.config_loader import load_stack_config
from components.contract import contract_outputs
from components.cost import cost_output, estimate_whole_stack
from components.wiring import build_platform

loaded = load_stack_config()
layers = build_platform(loaded)

# The versioned output contract (docs/contract.md) and the cost estimate (docs/cost.md).
for key, value in contract_outputs(loaded.stack, layers).items():
    pulumi.export(key, value)
cost = estimate_whole_stack(loaded.stack)
pulumi.export("estimated_cost", cost_output(cost.gpu, platform=cost.platform))
