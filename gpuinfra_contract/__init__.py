"""gpuinfra-contract: the typed stack outputs of gpu-inference-platform, for the teams that use it.

    from gpuinfra_contract import PlatformOutputs
    platform = PlatformOutputs.from_stack_reference("org/gpu-inference-platform/prod")
"""

from gpuinfra_contract.model import (
    CONTRACT_VERSION,
    PLAIN_OUTPUTS,
    SECRET_OUTPUTS,
    Cluster,
    ContractError,
    GpuPool,
    ModelEndpoint,
    PlatformOutputs,
    PlatformReference,
    ServedModel,
    check_compatible,
    parse_version,
)

__all__ = [
    "CONTRACT_VERSION",
    "PLAIN_OUTPUTS",
    "SECRET_OUTPUTS",
    "Cluster",
    "ContractError",
    "GpuPool",
    "ModelEndpoint",
    "PlatformOutputs",
    "PlatformReference",
    "ServedModel",
    "check_compatible",
    "parse_version",
]
