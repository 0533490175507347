"""What the docs say about images, the CRD upgrade Job, prod's API endpoints and teardown, checked
against what the program renders (issue 36: each of these sentences once contradicted the code)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

from tools.offline import PROJECT, ROOT, run_program, stack_config

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] + sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def _text(path: Path) -> str:
    return re.sub(r"\s+", " ", path.read_text())


def _nowhere(pattern: str) -> None:
    hits = [p.relative_to(ROOT).as_posix() for p in DOCS if re.search(pattern, _text(p))]
    assert not hits, f"{pattern!r} contradicts the code in {hits}"


def test_a_preview_builds_no_image(dev_run):
    images = dev_run.by_type("docker-build:index:Image")
    assert images and all(r.inputs["buildOnPreview"] is False for r in images)
    _nowhere(r"during (a )?preview too|builds them during a preview|buildOnPreview` defaulting to true|preview (also )?builds the images")


def test_the_crd_upgrade_job_is_on(dev_run):
    (kps,) = [r for r in dev_run.by_type("kubernetes:helm.sh/v3:Release") if r.inputs["chart"] == "kube-prometheus-stack"]
    assert kps.inputs["values"]["crds"]["upgradeJob"]["enabled"] is True
    _nowhere(r"off by default; the program does not set it")


def test_prods_eks_endpoint_is_public_and_limited_to_its_cidrs(prod_run):
    (eks,) = prod_run.by_type("eks:index:Cluster")
    assert eks.inputs["endpointPublicAccess"] is True and eks.inputs["endpointPrivateAccess"] is True
    assert eks.inputs["publicAccessCidrs"] and "0.0.0.0/0" not in eks.inputs["publicAccessCidrs"]
    _nowhere(r"EKS endpoint has no public access|run Pulumi from inside the VPC|private endpoints \(run Pulumi")


def test_the_teardown_runbook_lifts_gke_deletion_protection(prod_run):
    (gke,) = prod_run.by_type("gcp:container/cluster:Cluster")
    assert gke.inputs["deletionProtection"] is True, "prod's default is kept"
    cfg = copy.deepcopy(stack_config("prod"))
    next(c for c in cfg[f"{PROJECT}:clusters"] if c["cloud"] == "gcp")["deletion_protection"] = False
    (lifted,) = run_program("prod", config=cfg).by_type("gcp:container/cluster:Cluster")
    assert lifted.inputs["deletionProtection"] is False, "the key the runbook names lifts it"
    teardown = (ROOT / "docs" / "operations.md").read_text().split("## Teardown", 1)[1].split("\n## ", 1)[0]
    assert "`deletion_protection: false`" in teardown and "pulumi up" in teardown
