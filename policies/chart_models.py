"""What the pinned charts render, as far as Pod Security and image tags go: a per-chart model of which
values become which pod fields, restated from each chart's `values.yaml` and templates.

The pack cannot render the charts: Helm's engine is not a Python package, and no chart repository is
reachable offline (only PyPI, Debian and npm are), so the chart archives the stack pins cannot be had
here. Each model below names the source it restates; only the fields Pod Security checks and the
image references are modelled. A chart without a model is checked by the values alone
(`floating_tags`); its pods are not rendered.

- `keda` (chart 2.21.0; kedacore/charts keda/values.yaml @9f7393a98910a06686c5094c9471d2031829c6a2 and
  templates/{manager,metrics-server,webhooks}/deployment.yaml @1444d00d90d7668cf7f53f270777d039371d90d0):
  three Deployments; `podSecurityContext.<c>` -> the pod's securityContext, `securityContext.<c>` ->
  the container's, `<component>.useHostNetwork` -> hostNetwork, `volumes.<v>.extraVolumes` and
  `operator.extraContainers`/`extraInitContainers` copied into the pod, image
  `image.<i>.repository` : `image.<i>.tag` (empty: the chart's appVersion); `metricsServer.enabled`
  and `webhooks.enabled` gate their Deployments.
- `kube-prometheus-stack`'s `prometheus-node-exporter` subchart (values under `prometheus-node-exporter`,
  gated by `nodeExporter.enabled`; prometheus-community/helm-charts charts/prometheus-node-exporter/
  values.yaml @019319902ead75961fe5f71213777f1500725a6e and templates/daemonset.yaml): `hostNetwork`,
  `hostPID`, `hostIPC`, `securityContext` (pod), `containerSecurityContext`, hostPath mounts of /proc
  and /sys and, with `hostRootFsMount.enabled`, of /; image `image.repository` : `image.tag`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from pulumi_policy.proxy import UnknownValueError

from policies.common import as_list, as_map, dig, is_seq
from policies.workloads import image_problem

Path = tuple[str, ...]


@dataclass(frozen=True)
class ContainerModel:
    name: str
    security_context: Path
    repository: Path
    tag: Path


@dataclass(frozen=True)
class PodModel:
    name: str
    prefix: Path
    """Where the chart's values sit in the release's values (a subchart's name)."""
    gate: Optional[Path]
    """A top-level values key that turns the pod off when false (default true)."""
    containers: tuple[ContainerModel, ...]
    pod_security_context: Path
    host_network: Path
    host_pid: Optional[Path] = None
    host_ipc: Optional[Path] = None
    host_paths: tuple[tuple[str, Optional[Path]], ...] = ()
    """(node path, the values key that turns the mount on, None: always)."""
    extra_volumes: Optional[Path] = None
    extra_containers: tuple[Path, ...] = ()


@dataclass(frozen=True)
class ChartModel:
    chart: str
    defaults: Mapping[str, Any]
    pods: tuple[PodModel, ...] = field(default_factory=tuple)


_KEDA_SC = {"capabilities": {"drop": ["ALL"]}, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"}}
_KEDA_PODS = (
    ("keda-operator", "operator", "operator", "keda", "keda"),
    ("keda-operator-metrics-apiserver", "metricsServer", "metricServer", "metricsApiServer", "metricsApiServer"),
    ("keda-admission-webhooks", "webhooks", "webhooks", "webhooks", "webhooks"),
)
KEDA = ChartModel(
    chart="keda",
    defaults={
        "image": {k: {"repository": f"kedacore/{r}", "tag": ""} for k, r in (
            ("keda", "keda"), ("metricsApiServer", "keda-metrics-apiserver"), ("webhooks", "keda-admission-webhooks"))},
        "operator": {"useHostNetwork": False, "extraContainers": [], "extraInitContainers": []},
        "metricsServer": {"enabled": True, "useHostNetwork": False},
        "webhooks": {"enabled": True, "useHostNetwork": False},
        "securityContext": {c: dict(_KEDA_SC) for c in ("operator", "metricServer", "webhooks")},
        "podSecurityContext": {c: {"runAsNonRoot": True} for c in ("operator", "metricServer", "webhooks")},
        "volumes": {v: {"extraVolumes": []} for v in ("keda", "metricsApiServer", "webhooks")},
    },
    pods=tuple(
        PodModel(
            name=name, prefix=(), gate=None if comp == "operator" else (comp, "enabled"),
            containers=(ContainerModel(name, ("securityContext", sc), ("image", img, "repository"), ("image", img, "tag")),),
            pod_security_context=("podSecurityContext", sc), host_network=(comp, "useHostNetwork"),
            extra_volumes=("volumes", vol, "extraVolumes"),
            extra_containers=(("operator", "extraContainers"), ("operator", "extraInitContainers")) if comp == "operator" else (),
        )
        for name, comp, sc, img, vol in _KEDA_PODS
    ),
)

NODE_EXPORTER = ("prometheus-node-exporter",)
KUBE_PROMETHEUS_STACK = ChartModel(
    chart="kube-prometheus-stack",
    defaults={
        "nodeExporter": {"enabled": True},
        "prometheus-node-exporter": {
            "image": {"repository": "prometheus/node-exporter", "tag": ""},
            "hostNetwork": True, "hostPID": True, "hostIPC": False,
            "securityContext": {"fsGroup": 65534, "runAsGroup": 65534, "runAsNonRoot": True, "runAsUser": 65534},
            "containerSecurityContext": {"readOnlyRootFilesystem": True},
            "hostRootFsMount": {"enabled": True},
        },
    },
    pods=(PodModel(
        name="node-exporter", prefix=NODE_EXPORTER, gate=("nodeExporter", "enabled"),
        containers=(ContainerModel("node-exporter", NODE_EXPORTER + ("containerSecurityContext",),
                                   NODE_EXPORTER + ("image", "repository"), NODE_EXPORTER + ("image", "tag")),),
        pod_security_context=NODE_EXPORTER + ("securityContext",), host_network=NODE_EXPORTER + ("hostNetwork",),
        host_pid=NODE_EXPORTER + ("hostPID",), host_ipc=NODE_EXPORTER + ("hostIPC",),
        host_paths=(("/proc", None), ("/sys", None), ("/", NODE_EXPORTER + ("hostRootFsMount", "enabled"))),
    ),),
)

MODELS = {m.chart: m for m in (KEDA, KUBE_PROMETHEUS_STACK)}


def merged(defaults: Any, values: Any) -> Any:
    """Helm's coalescing of user values over the chart's: maps merge key by key, anything else replaces."""
    if isinstance(defaults, Mapping) and isinstance(values, Mapping):
        out = {k: copy.deepcopy(v) for k, v in defaults.items()}
        for k in values:
            out[k] = merged(out.get(k), values[k]) if k in out else values[k]
        return out
    return values if values is not None else copy.deepcopy(defaults)


def _get(values: Mapping[str, Any], path: Optional[Path]) -> Any:
    return None if path is None else dig(values, *path)


def render_pods(model: ChartModel, values: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(pod name, pod spec with the modelled fields, image references) for every pod the values turn on."""
    v = merged(model.defaults, as_map(values))
    out = []
    for p in model.pods:
        if p.gate is not None and _get(v, p.gate) is False:
            continue
        spec: dict[str, Any] = {"securityContext": copy.deepcopy(as_map(_get(v, p.pod_security_context)))}
        for key, path in (("hostNetwork", p.host_network), ("hostPID", p.host_pid), ("hostIPC", p.host_ipc)):
            if path is not None and _get(v, path) is not None:
                spec[key] = _get(v, path)
        containers, images = [], []
        for c in p.containers:
            tag = _get(v, c.tag)
            images.append(f"{_get(v, c.repository)}:{tag}" if tag else "")
            containers.append({"name": c.name, "securityContext": copy.deepcopy(as_map(_get(v, c.security_context)))})
        for path in p.extra_containers:
            containers += [dict(as_map(x)) for x in as_list(_get(v, path))]
        spec["containers"] = containers
        vols = [{"name": f"host{i}", "hostPath": {"path": hp}} for i, (hp, gate) in enumerate(p.host_paths)
                if gate is None or _get(v, gate) is not False]
        vols += [dict(as_map(x)) for x in as_list(_get(v, p.extra_volumes))]
        spec["volumes"] = vols
        out.append((p.name, spec, images))
    return out


def floating_tags(values: Any, path: str = "values") -> list[tuple[str, str]]:
    """(path, why) for every image reference in any chart's values that may move under a re-pull: a
    `tag` next to a `repository` (or under an `image` key), or an `image: <ref>` string. An empty tag
    means the chart's own appVersion, fixed by the pinned chart version."""
    out: list[tuple[str, str]] = []
    if isinstance(values, Mapping):
        keys = list(values)
        for k in keys:
            sub = f"{path}.{k}"
            try:
                val = values[k]
            except UnknownValueError:  # computed during preview: not a literal tag
                continue
            imageish = "repository" in keys or "image" in path.lower()
            if k == "tag" and imageish and isinstance(val, str) and val:
                why = image_problem(f"{values.get('repository') or 'image'}:{val}")
                if why:
                    out.append((sub, why))
            elif k.lower() == "image" and isinstance(val, str) and val and not val.strip().count(" "):
                why = image_problem(val)
                if why:
                    out.append((sub, why))
            else:
                out += floating_tags(val, sub)
    elif is_seq(values):
        for i, item in enumerate(values):
            out += floating_tags(item, f"{path}[{i}]")
    return out
