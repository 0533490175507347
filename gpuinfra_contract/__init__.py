"""gpuinfra-contract: the typed stack outputs of gpu-inference-platform, for the teams that use it.

    from gpuinfra_contract import PlatformOutputs
    platform = PlatformOutputs.from_stack_reference("org/gpu-inference-platform/prod")

`kubeconfig_for(outputs, cluster)` builds a consumer's kubeconfig from the plain outputs alone (1.3).
`load_schema()` returns the contract as a JSON Schema (schema/contract-<version>.json), for
validating outputs outside Python.
"""

from gpuinfra_contract.json_schema import contract_json_schema, load_schema, schema_path
from gpuinfra_contract.kubeconfig import kubeconfig_for

from gpuinfra_contract.model import (
    CONTRACT_VERSION,
    PLAIN_OUTPUTS,
    SECRET_OUTPUTS,
    Cluster,
    ContractError,
    GpuPool,
    KubeAuth,
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
    "KubeAuth",
    "ModelEndpoint",
    "PlatformOutputs",
    "PlatformReference",
    "ServedModel",
    "check_compatible",
    "contract_json_schema",
    "kubeconfig_for",
    "load_schema",
    "parse_version",
    "schema_path",
]
