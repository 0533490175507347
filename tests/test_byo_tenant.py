"""`byo` is a second tenant on prod's GKE cluster (`Pulumi.byo.yaml` reads prod-usc1's kubeconfig):
rendered side by side, the two stacks never create the same object.

Kubernetes names are unique per (kind, namespace) and cluster-scoped kinds per name, so a second
create fails with AlreadyExists (kubernetes.io/docs/concepts/overview/working-with-objects/names);
Helm 3 keeps a release's records in its namespace, and `helm install` of a name in use there fails
("cannot re-use a name that is still in use", helm pkg/action/install.go). A stack that took over
the other's object would also delete it on its own `pulumi destroy`.
"""

from __future__ import annotations

from tests.conftest import stack_run
from tools.offline import ProgramRun

RELEASE = "kubernetes:helm.sh/v3:Release"


def on_cluster(run: ProgramRun, provider_name: str) -> dict[tuple[str, str, str], str]:
    """(kind, namespace, name) -> URN of every object and Helm release created through the provider."""
    (provider,) = [p for p in run.by_type("pulumi:providers:kubernetes") if p.name == provider_name]
    out: dict[tuple[str, str, str], str] = {}
    for r in run.resources:
        if run.provider_of(r) is not provider:
            continue
        if r.type == RELEASE:
            key = ("helm-release", r.inputs.get("namespace", "default"), r.inputs["name"])
        elif r.is_kubernetes_object:
            meta = r.inputs.get("metadata", {})
            key = (r.type.rsplit(":", 1)[-1], meta.get("namespace", ""), meta["name"])
        else:
            continue
        assert key not in out, f"{run.stack} creates {key} twice: {out[key]} and {r.urn}"
        out[key] = r.urn
    return out


def test_byo_and_prod_create_nothing_twice_on_prods_gke_cluster():
    prod = on_cluster(stack_run("prod"), "prod-usc1-k8s")
    byo = on_cluster(stack_run("byo"), "team-gke-k8s")
    assert prod and byo
    both = sorted(set(prod) & set(byo))
    assert not both, "created by both stacks:\n" + "\n".join(f"{k}: {prod[k]} / {byo[k]}" for k in both)


def test_byo_reuses_prods_addons_and_agent():
    """byo installs neither KEDA nor kube-prometheus-stack nor the eBPF agent: it uses prod's."""
    byo = on_cluster(stack_run("byo"), "team-gke-k8s")
    kinds = {k[0] for k in byo}
    assert "helm-release" not in kinds and "DaemonSet" not in kinds, sorted(byo)
    # Its models still register with prod's Prometheus (release label) and scale through prod's KEDA.
    assert "ServiceMonitor" in kinds and "ScaledObject" in kinds, sorted(kinds)
