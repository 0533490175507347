"""Assembles the gpu-serving policy pack; the rules live in the domain modules next to this file."""

import sys
from pathlib import Path

# The CLI runs this file with `policies/` as the script directory; the rules import as `policies.*`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pulumi_policy import EnforcementLevel, PolicyPack  # noqa: E402

from policies.pack import PACK_NAME, POLICIES  # noqa: E402
from policies.secret_values import install as keep_secrets_marked  # noqa: E402

keep_secrets_marked()
PolicyPack(name=PACK_NAME, policies=POLICIES, enforcement_level=EnforcementLevel.MANDATORY)
