"""Extract the served versions' `openAPIV3Schema` from an upstream CRD YAML into tests/schemas/.

    python tests/schemas/extract_crd_schema.py path/to/crd.yaml [more.yaml ...]

A CRD shipped as a Helm template (the KEDA chart's `templates/crds/*.yaml`) is read after dropping
its template-only lines (`{{- if ... }}`, `{{- end }}`, `{{- include ... }}`) and replacing inline
`{{ ... }}` expressions (metadata labels only) with a placeholder; the schema has no template code.

It writes `<group>_<version>_<Kind>.json` for every served version, byte-for-byte the parsed schema
(no edits: descriptions, CEL rules and defaults are kept), with sorted keys and 1-space indent so a
re-extraction diffs cleanly. See README.md in this folder for where each input came from.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def untemplate(text: str) -> str:
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("{{")]
    return "\n".join(re.sub(r"\{\{.*?\}\}", "helm-template-value", ln) for ln in lines) + "\n"


def extract(crd_path: Path) -> list[Path]:
    written = []
    for doc in yaml.safe_load_all(untemplate(crd_path.read_text())):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        for version in spec["versions"]:
            if not version.get("served"):
                continue
            out = HERE / f"{spec['group']}_{version['name']}_{spec['names']['kind']}.json"
            out.write_text(json.dumps(version["schema"]["openAPIV3Schema"], indent=1, sort_keys=True) + "\n")
            written.append(out)
    return written


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for p in extract(Path(arg)):
            print(p.name)
