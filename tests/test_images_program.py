"""The project's images in the rendered stacks: every workload runs an image the stack built (by the
digest its build reported) or one named by digest; the registries the builds push to; the config
modes (build / prebuilt) and their rules; no code rides in ConfigMaps.

Each stack runs under the mock engine, where pulumi-docker-build's Image reports a digest that is a
function of what it built (tools/mock_outputs.py)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from components.images.specs import SOURCES, context_hash, image_tag
from tools import mock_outputs
from components.serving.config import VLLM_IMAGE
from tests.support import assert_config_error
from tools.offline import PROJECT, ProgramRun, manifest, run_program, stack_config

P = PROJECT + ":"
IMAGE = "docker-build:index:Image"
DIGEST = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
TAG_PINNED_THIRD_PARTY = {VLLM_IMAGE}
"""Images allowed with a tag alone: vLLM's release image, whose digest for the pinned tag could not be
verified from here (no registry is reachable, and no stored public source names one: docs/images.md
lists what was searched); a stack names it by digest with `engine.image`."""
WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job", "CronJob", "Pod"}


def pod_specs(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every pod spec in a rendered object: a workload's template, a CronJob's job template, a Pod, or
    a pod template anywhere in a custom resource."""
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind == "Pod":
        yield spec
    elif kind == "CronJob":
        yield spec["jobTemplate"]["spec"]["template"]["spec"]
    elif kind in WORKLOAD_KINDS:
        yield spec["template"]["spec"]
    else:
        stack = [spec]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if "containers" in node and isinstance(node["containers"], list):
                    yield node
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"], *spec.get("ephemeralContainers", [])]


def built_refs(run: ProgramRun) -> set[str]:
    """`<repository>@<digest>` of every image the stack built and pushed (the mock engine's outputs)."""
    from tools.mock_outputs import resource_outputs

    out = set()
    for r in run.by_type(IMAGE):
        assert r.inputs.get("push") is True, f"{r.urn}: built but not pushed"
        digest = resource_outputs(IMAGE, r.name, r.raw_inputs)["digest"]
        out |= {f"{t.rsplit(':', 1)[0]}@{digest}" for t in r.raw_inputs["tags"]}
    return out


def workload_images(run: ProgramRun) -> list[tuple[str, str, str]]:
    """(object URN, container name, image) for every container of every rendered pod."""
    return [(r.urn, c["name"], c["image"]) for r in run.kubernetes_objects()
            for spec in pod_specs(manifest(r)) for c in containers(spec)]


def test_every_workload_runs_a_built_or_digest_pinned_image(any_run):
    built = built_refs(any_run)
    images = workload_images(any_run)
    assert images, any_run.stack
    for urn, name, image in images:
        if image in TAG_PINNED_THIRD_PARTY:
            continue
        assert image in built or DIGEST.match(image), f"{urn} container {name}: {image} is neither built by the stack nor pinned by digest"
    ours = {image for _, name, image in images if name in ("agent", "spot-drain", "prewarm", "controller")}
    assert ours and ours <= built, f"{any_run.stack}: the project's own containers must run what this stack built: {ours - built}"


def test_the_walk_finds_templates_in_custom_resources_and_cronjobs():
    cr = {"kind": "Thing", "spec": {"runner": {"template": {"spec": {"containers": [{"name": "x", "image": "a:1"}]}}}}}
    cron = {"kind": "CronJob", "spec": {"jobTemplate": {"spec": {"template": {"spec": {"containers": [{"name": "y", "image": "b"}]}}}}}}
    assert [c["image"] for s in pod_specs(cr) for c in containers(s)] == ["a:1"]
    assert [c["image"] for s in pod_specs(cron) for c in containers(s)] == ["b"]


def test_each_cluster_builds_both_images_into_its_registry(prod_run):
    images = prod_run.by_type(IMAGE)
    by_cluster: dict[str, set[str]] = {}
    for r in images:
        tag = r.inputs["tags"][0]
        by_cluster.setdefault(r.name.split("-images-")[0], set()).add(tag.rsplit(":", 1)[0].rsplit("/", 1)[1])
        src = next(s for s in SOURCES if tag.rsplit(":", 1)[0].endswith("/" + s.repository))
        assert r.inputs["context"] == {"location": src.context}, r.urn
        assert r.inputs["dockerfile"] == {"location": f"{src.context}/Dockerfile"}, r.urn
        assert tag.endswith(":" + image_tag(src, r.inputs["platforms"])), r.urn
        assert r.inputs["labels"]["io.gpuinfra.context-sha256"] == context_hash(src), r.urn
        assert r.retain_on_delete, f"{r.urn}: dropping it (its tag is then in the registry) must not delete the pushed image"
        assert r.inputs["registries"][0]["password"] == "[secret]", f"{r.urn}: registry password must stay secret"
    assert by_cluster == {"prod-use1": {"ebpf-agent", "runtime"}, "prod-usc1": {"ebpf-agent", "runtime"}}


def test_ecr_repositories_are_immutable_scanned_and_pruned(dev_run):
    repos = dev_run.by_type("aws:ecr/repository:Repository")
    assert sorted(r.inputs["name"] for r in repos) == ["gpuinfra/dev-use1/ebpf-agent", "gpuinfra/dev-use1/runtime"]
    for r in repos:
        assert r.inputs["imageTagMutability"] == "IMMUTABLE", r.urn
        assert r.inputs["imageScanningConfiguration"] == {"scanOnPush": True}, r.urn
    policies = dev_run.by_type("aws:ecr/lifecyclePolicy:LifecyclePolicy")
    assert len(policies) == 2
    rule = json.loads(policies[0].inputs["policy"])["rules"][0]
    assert rule["selection"]["countType"] == "imageCountMoreThan" and rule["action"] == {"type": "expire"}
    # Both node roles (system nodes, Karpenter's GPU nodes) may pull from the account's repositories.
    attached = {(r.inputs["role"], r.inputs["policyArn"].rsplit("/", 1)[1])
                for r in dev_run.by_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")}
    pull_roles = {role for role, policy in attached if policy == "AmazonEC2ContainerRegistryPullOnly"}
    assert len(pull_roles) >= 2, attached


def test_gke_clusters_push_to_artifact_registry_their_nodes_read(prod_run):
    (repo,) = prod_run.by_type("gcp:artifactregistry/repository:Repository")
    assert repo.inputs["format"] == "DOCKER" and repo.inputs["dockerConfig"] == {"immutableTags": True}
    assert repo.inputs["location"] == "us-central1" and repo.inputs["repositoryId"] == "prod-usc1-images"
    roles = {r.inputs["role"] for r in prod_run.by_type("gcp:projects/iAMMember:IAMMember")}
    assert "roles/artifactregistry.reader" in roles


def test_no_configmap_carries_code(any_run):
    for r in any_run.by_type("kubernetes:core/v1:ConfigMap"):
        data = manifest(r).get("data") or {}
        assert not [k for k in data if k.endswith(".py")], f"{r.urn} ships code: {sorted(data)}"


def _with_images(stack: str, images: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(stack_config(stack))
    cfg[P + "images"] = images
    return cfg


AGENT = "registry.example.com/gpuinfra/ebpf-agent@sha256:" + "1" * 64
RUNTIME = "registry.example.com/gpuinfra/runtime@sha256:" + "2" * 64


def test_prebuilt_images_are_run_by_their_digests_and_nothing_is_built():
    run = run_program("prod", config=_with_images("prod", {"source": "prebuilt", "prebuilt": {"agent": AGENT, "runtime": RUNTIME}}))
    assert not run.by_type(IMAGE) and not run.by_type("aws:ecr/repository:Repository")
    assert not run.by_type("gcp:artifactregistry/repository:Repository")
    images = {(name, image) for _, name, image in workload_images(run)}
    assert ("agent", AGENT) in images and ("spot-drain", RUNTIME) in images and ("controller", RUNTIME) in images


def test_byo_pushes_its_own_repositories_with_credentials_and_no_agent_image():
    """byo shares prod-usc1's Artifact Registry repository: it pushes under its own stack's name
    (prod pushes `<repo>/runtime`), with the deployer's Google token, and builds no agent image
    (its agent is off: prod's runs on those nodes)."""
    run = run_program("byo")
    registry = stack_config("byo")[P + "images"]["registry"]
    (image,) = run.by_type(IMAGE)
    assert image.inputs["tags"][0].rsplit(":", 1)[0] == f"{registry}/byo/runtime", image.urn
    creds = image.inputs["registries"][0]
    assert creds["address"] == "us-central1-docker.pkg.dev" and creds["username"] == "oauth2accesstoken"
    assert creds["password"] == "[secret]", image.urn
    prod = {r.inputs["tags"][0].rsplit(":", 1)[0] for r in run_program("prod").by_type(IMAGE)}
    assert not prod & {t.rsplit(":", 1)[0] for r in run.by_type(IMAGE) for t in r.inputs["tags"]}


def test_a_stack_without_the_agent_builds_no_agent_image():
    cfg = copy.deepcopy(stack_config("dev"))
    cfg[P + "ebpf_agent"] = {"enabled": False}
    run = run_program("dev", config=cfg)
    assert [r.inputs["tags"][0].rsplit(":", 1)[0].rsplit("/", 1)[1] for r in run.by_type(IMAGE)] == ["runtime"]
    assert [r.inputs["name"] for r in run.by_type("aws:ecr/repository:Repository")] == ["gpuinfra/dev-use1/runtime"]


HELD_DIGEST = "sha256:" + "ab" * 32


def _registry_holds(monkeypatch, tags: dict[str, str]) -> None:
    """The registries hold `tags` (repository -> tag), each as HELD_DIGEST: what an earlier push left."""
    def ecr_images(a):
        tag = tags.get(a["repositoryName"])
        return {"imageIds": [{"imageDigest": HELD_DIGEST, "imageTag": tag}] if tag else [], "id": "x"}

    def ar_images(a):
        base = f"{a['location']}-docker.pkg.dev/{a['project']}/{a['repositoryId']}"
        held = [{"selfLink": f"{repo}@{HELD_DIGEST}", "tags": [tag], "name": "n", "imageName": repo.rsplit("/", 1)[1],
                 "buildTime": "", "imageSizeBytes": "1", "mediaType": "m", "updateTime": "", "uploadTime": ""}
                for repo, tag in tags.items() if repo.startswith(base + "/")]
        return {"dockerImages": held, "id": "x"}

    monkeypatch.setitem(mock_outputs.CALL_OUTPUTS, "aws:ecr/getRepositories:getRepositories",
                        lambda a: {"names": sorted(r for r in tags if "/" in r and "." not in r), "id": "x"})
    monkeypatch.setitem(mock_outputs.CALL_OUTPUTS, "aws:ecr/getImages:getImages", ecr_images)
    monkeypatch.setitem(mock_outputs.CALL_OUTPUTS, "gcp:artifactregistry/getRepositories:getRepositories", lambda a: {
        "repositories": [{"repositoryId": r.split("/")[2], "id": r, "createTime": "", "description": "", "format": "DOCKER",
                          "location": a["location"], "name": r, "updateTime": ""} for r in tags if ".pkg.dev/" in r], "id": "x"})
    monkeypatch.setitem(mock_outputs.CALL_OUTPUTS, "gcp:artifactregistry/getDockerImages:getDockerImages", ar_images)


def test_a_tag_the_registry_holds_is_run_by_its_digest_and_not_pushed_again(monkeypatch):
    """An `up` from another clone, after `make test`, or after a revert computes a tag an earlier
    push left in the (immutable) repository: nothing is built, the pods run the registry's digest."""
    first = run_program("prod")
    pushed = {t.rsplit(":", 1)[0]: t.rsplit(":", 1)[1] for r in first.by_type(IMAGE) for t in r.inputs["tags"]}
    ecr = {repo.split("/", 1)[1]: tag for repo, tag in pushed.items() if ".dkr.ecr." in repo}
    _registry_holds(monkeypatch, {**ecr, **{r: t for r, t in pushed.items() if ".pkg.dev/" in r}})
    again = run_program("prod")
    assert not again.by_type(IMAGE), [r.urn for r in again.by_type(IMAGE)]
    ours = {image for _, name, image in workload_images(again) if name in ("agent", "spot-drain", "prewarm", "controller")}
    assert ours == {f"{repo}@{HELD_DIGEST}" for repo in pushed}, ours


def test_only_the_tags_the_registry_lacks_are_built(monkeypatch):
    first = run_program("dev")
    pushed = {t.rsplit(":", 1)[0].split("/", 1)[1]: t.rsplit(":", 1)[1] for r in first.by_type(IMAGE) for t in r.inputs["tags"]}
    runtime = next(r for r in pushed if r.endswith("/runtime"))
    _registry_holds(monkeypatch, {runtime: "src-an-older-build"})
    run = run_program("dev")
    assert sorted(r.inputs["tags"][0].rsplit(":", 1)[0].rsplit("/", 1)[1] for r in run.by_type(IMAGE)) == ["ebpf-agent", "runtime"]
    _registry_holds(monkeypatch, {runtime: pushed[runtime]})
    (agent,) = run_program("dev").by_type(IMAGE)
    assert agent.inputs["tags"][0].rsplit(":", 1)[0].endswith("/ebpf-agent")


def test_an_unreadable_registry_is_named_with_the_permission_it_needs(monkeypatch):
    monkeypatch.setitem(mock_outputs.CALL_OUTPUTS, "aws:ecr/getRepositories:getRepositories",
                        lambda a: ({}, [("", "AccessDeniedException: not authorized")]))
    run = run_program("dev", raise_errors=False)
    for fragment in ("gpuinfra/dev-use1/", "ecr:DescribeRepositories", "AccessDeniedException"):
        assert fragment in str(run.error), f"{fragment!r} not in {run.error}"
    assert not run.by_type(IMAGE)


BAD = [
    ("prebuilt-by-tag", "dev", {"source": "prebuilt", "prebuilt": {"agent": "ghcr.io/a/agent:1.0", "runtime": RUNTIME}},
     ["images.prebuilt.agent", "by digest"]),
    ("prebuilt-missing", "dev", {"source": "prebuilt"}, ["images.prebuilt", "no images are named"]),
    ("prebuilt-with-build", "dev", {"prebuilt": {"agent": AGENT, "runtime": RUNTIME}}, ["images.prebuilt", "source 'build'"]),
    ("registry-on-eks", "dev", {"registry": "ghcr.io/acme/gpuinfra"}, ["images.registry", "EKS or GKE"]),
    ("byo-build-without-registry", "byo", {"source": "build"}, ["images.registry", "existing clusters"]),
    ("bad-platform", "dev", {"platforms": ["windows/amd64"]}, ["images.platforms"]),
]


@pytest.mark.parametrize("case_id,stack,images,fragments", BAD, ids=[b[0] for b in BAD])
def test_bad_image_config_fails_with_its_key(case_id, stack, images, fragments):
    run = run_program(stack, config=_with_images(stack, images), raise_errors=False)
    assert_config_error(run, case_id, fragments)


def test_chart_images_with_a_floating_default_are_pinned_by_version_and_digest(any_run):
    """kube-prometheus-stack's CRD upgrade Job (`crds.upgradeJob`, enabled) defaults to busybox
    `latest` and to kubectl at the cluster's own version (chart values.yaml, vendored excerpt under
    tests/schemas/helm/): the rendered values pin both by exact version and digest."""
    import yaml

    from components.platform.addons_values import KPS_PINNED_IMAGES

    excerpt = yaml.safe_load((Path(__file__).parent / "schemas/helm/kube-prometheus-stack.values-excerpt.yaml").read_text())
    releases = [r for r in any_run.by_type("kubernetes:helm.sh/v3:Release") if r.inputs["chart"] == "kube-prometheus-stack"]
    for r in releases:
        for img in KPS_PINNED_IMAGES:
            default, values = excerpt, r.inputs["values"]
            for key in img.values_path:
                default, values = default[key], values[key]
            assert default["tag"] in ("latest", ""), f"{img.values_path}: the chart pins {default['tag']!r} itself"
            assert f"{default['registry']}/{default['repository']}" == img.image, img.values_path
            tag = values["tag"]
            assert re.fullmatch(r"v?\d+\.\d+\.\d+@sha256:[0-9a-f]{64}", tag), f"{r.urn} {img.values_path}: {tag!r}"
            assert DIGEST.match(f"{img.image}:{tag}"), tag


def test_images_the_registry_holds_are_judged_at_preview(monkeypatch):
    """A preview cannot know the digest of an image it has not built, so the rules that read images
    cannot decide it (tests/test_policies_preview.py); an image the registry already holds is run by
    the digest the registry reports, known when the preview runs, and the rules judge it there."""
    from tools.policy_check import check_run

    def undecided_image_rules(run):
        return {v.policy for v in check_run(run) if v.level == "undecided" and "image" in v.policy}

    first = run_program("byo", preview=True)
    assert undecided_image_rules(first), "without the registry's digests the image rules cannot decide"
    pushed = {t.rsplit(":", 1)[0]: t.rsplit(":", 1)[1] for r in run_program("byo").by_type(IMAGE) for t in r.inputs["tags"]}
    _registry_holds(monkeypatch, pushed)
    again = run_program("byo", preview=True)
    assert not again.by_type(IMAGE)
    assert not undecided_image_rules(again)
    ours = {image for _, name, image in workload_images(again) if name in ("spot-drain", "prewarm", "controller")}
    assert ours == {f"{repo}@{HELD_DIGEST}" for repo in pushed}, ours
