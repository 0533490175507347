"""A fresh GCP project: every API the stack's resources live in is enabled by the stack (or listed as
the deployer's one-time prerequisite), each resource waits for its API, and the deployer's role
table in docs/gcp.md is generated from the resource types the program really creates.

A GCP resource created before its API is on fails with `SERVICE_DISABLED` ("<api> has not been used in
project … before or it is disabled"); Pulumi orders creation only along dependencies (Pulumi
`dependsOn` docs), so each resource must depend, directly or through what it depends on, on the
`projects.Service` of its API. The API of each type and the role that creates it are stated once, in
components/gcp/apis.py, with their sources.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from components.gcp.apis import PREREQUISITE_APIS, RESOURCE_TYPES, deployer_table
from tests.conftest import stack_run
from tools.offline import ProgramRun, available_stacks

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "gcp:projects/service:Service"


def gcp_resources(run: ProgramRun) -> list:
    return [r for r in run.resources if r.custom and r.type.startswith("gcp:")]


def depends_on(run: ProgramRun, r, target_urn: str) -> bool:
    """`r` waits for `target_urn` through dependencies (not parents: a component's children wait for
    what the component was given, not for each other)."""
    index, seen, todo = run.by_urn(), set(), list(r.dependencies)
    while todo:
        urn = todo.pop()
        if urn == target_urn:
            return True
        if urn in seen:
            continue
        seen.add(urn)
        cur = index.get(urn)
        if cur is not None:
            todo += cur.dependencies
            # A dependency on a component is a dependency on its children (Pulumi `dependsOn` docs).
            todo += [c.urn for c in run.resources if c.parent == urn]
    return False


@pytest.mark.parametrize("stack", available_stacks())
def test_every_gcp_resource_type_has_its_api_and_deployer_role_stated(stack):
    unknown = sorted({r.type for r in gcp_resources(stack_run(stack))} - set(RESOURCE_TYPES))
    assert not unknown, f"{stack}: add the API and the deployer's role of {unknown} to components/gcp/apis.py"


def test_the_table_covers_only_what_some_stack_creates():
    created = {r.type for s in available_stacks() for r in gcp_resources(stack_run(s))}
    assert set(RESOURCE_TYPES) == created, sorted(set(RESOURCE_TYPES) ^ created)


def test_every_gcp_resource_waits_for_its_api_in_its_project():
    run = stack_run("prod")
    services = {(s.inputs["project"], s.inputs["service"]): s for s in run.by_type(SERVICE)}
    checked = 0
    for r in gcp_resources(run):
        api = RESOURCE_TYPES[r.type].api
        if api in PREREQUISITE_APIS:
            continue
        project = r.inputs.get("project")
        assert project, f"{r.urn}: no explicit project (the provider's default project is not the one whose APIs are enabled)"
        service = services.get((project, api))
        assert service is not None, f"{r.urn}: nothing enables {api} in {project}"
        assert service.inputs["disableOnDestroy"] is False, service.urn
        assert depends_on(run, r, service.urn), f"{r.urn} is created without waiting for {service.urn} ({api})"
        checked += 1
    assert checked >= 10, checked


def test_artifact_registry_is_enabled_by_the_stack_on_a_fresh_project():
    run = stack_run("prod")
    apis = sorted(s.inputs["service"] for s in run.by_type(SERVICE))
    assert "artifactregistry.googleapis.com" in apis and "iam.googleapis.com" in apis, apis
    assert not set(PREREQUISITE_APIS) & set(apis), "the prerequisites cannot be enabled through themselves"


def test_the_deployer_table_in_the_docs_is_the_generated_one():
    text = (ROOT / "docs" / "gcp.md").read_text()
    assert deployer_table() in text, "docs/gcp.md's deployer table is stale: python -m tools.docs_sync"
    assert "roles/artifactregistry.admin" in deployer_table()
