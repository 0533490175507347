"""Offline tooling: the mock-engine harness, the render command and the policy runner."""
