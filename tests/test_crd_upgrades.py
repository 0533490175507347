"""kube-prometheus-stack's CRDs are upgraded with the chart, the way the chart documents it.

Helm installs a chart's `crds/` directory on the first install only and never upgrades it
(helm.sh/docs/chart_best_practices/custom_resource_definitions: "There is no support at this time
for upgrading or deleting CRDs using Helm"). kube-prometheus-stack 92.2.0 ships the Prometheus
Operator CRDs there and offers a hook Job for upgrades: values.yaml `crds.upgradeJob` ("The CRD
upgrade job mitigates the limitation of helm not being able to upgrade CRDs. The job will apply the
CRDs to the cluster before the operator is deployed, using helm hooks"; off by default), whose
`kubectl apply --server-side` gets `--force-conflicts` from `forceConflicts`
(prometheus-community/helm-charts charts/kube-prometheus-stack/values.yaml @001f3a6d and
charts/crds/templates/upgrade/job.yaml @f27b47f2, hooks `pre-install,pre-upgrade,pre-rollback`).
Both keys are in the vendored values excerpt, which tests/test_helm_values_schemas.py checks.
"""

from __future__ import annotations

import yaml

from tests.conftest import stack_run
from tests.test_helm_values_schemas import HELM

RELEASE = "kubernetes:helm.sh/v3:Release"


def kps_releases(stack: str):
    return [r for r in stack_run(stack).by_type(RELEASE) if r.inputs.get("chart") == "kube-prometheus-stack"]


def test_kps_upgrades_its_crds_with_the_chart_upgrade_job():
    found = kps_releases("dev") + kps_releases("prod")
    assert len(found) == 3, [r.urn for r in found]  # dev-use1, prod-use1, prod-usc1
    for r in found:
        crds = r.inputs["values"]["crds"]
        job = {k: v for k, v in crds["upgradeJob"].items() if k != "image"}  # images: test_images_program
        assert crds["enabled"] is True and job == {"enabled": True, "forceConflicts": True}, r.urn


def test_upgrade_job_keys_are_the_pinned_charts():
    excerpt = yaml.safe_load((HELM / "kube-prometheus-stack.values-excerpt.yaml").read_text())
    assert set(excerpt["crds"]["upgradeJob"]) >= {"enabled", "forceConflicts"}
    assert excerpt["crds"]["upgradeJob"]["enabled"] is False  # the chart's default: off
