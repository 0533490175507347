# SPDX-License-Identifier: Apache-2.0
"""The eBPF agent's image folder. The image runs the agent as `python3 -m agent` from its own folder
(bpf/Dockerfile); the mutation gate and tests/kernel/test_pins_uninstall.py import it as
`bpf.agent` from the repository root. Its modules import each other relatively, so both work."""
