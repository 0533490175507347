"""Resource-option helpers shared by the components."""

from __future__ import annotations

from typing import Optional

import pulumi


def inherited_depends_on(opts: Optional[pulumi.ResourceOptions]) -> list[pulumi.Resource]:
    """The component's own `depends_on`, for its children.

    Pulumi does not pass a component's `depends_on` down to its children, so a child such as a
    ServiceMonitor could otherwise be created before the add-ons (and their CRDs) it needs.
    """
    deps = opts.depends_on if opts is not None else None
    if deps is None:
        return []
    return list(deps) if isinstance(deps, (list, tuple)) else [deps]
