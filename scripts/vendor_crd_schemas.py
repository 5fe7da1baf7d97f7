"""Turn upstream CustomResourceDefinitions into the JSON schemas the chart's tests validate against.

    python scripts/vendor_crd_schemas.py SOURCE:VERSION:CRD.yaml ...

Each CRD's served versions become ``tests/deploy/crd_schemas/<group>_<kind>_<apiVersion>.json``: its
``openAPIV3Schema`` as a JSON Schema (draft 7) with ``apiVersion`` and ``kind`` pinned, where an
object that lists its properties allows no others (the API server prunes unknown fields; a chart that
renders one has a typo), ``nullable`` becomes a null type, ``x-kubernetes-int-or-string`` allows both,
and descriptions are dropped (most of a CRD's bytes). ``SOURCE`` and ``VERSION`` (the upstream
repository and release the CRD came from) are recorded in the schema's ``$comment``; the tests read
them from there, so the versions validated against are named in one place.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parents[1] / "tests" / "deploy" / "crd_schemas"


def convert(node: Any) -> Any:
    if isinstance(node, list):
        return [convert(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("description", "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys"):
            continue
        if key in ("x-kubernetes-map-type", "x-kubernetes-embedded-resource", "x-kubernetes-preserve-unknown-fields"):
            continue
        if key == "nullable":
            continue
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: convert(sub) for name, sub in value.items()}
        else:
            out[key] = convert(value)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("x-kubernetes-int-or-string", None)
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def main(argv: list[str]) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for arg in argv:
        source, version, path = arg.split(":", 2)
        crd = yaml.safe_load(Path(path).read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for served in crd["spec"]["versions"]:
            if not served.get("served", True):
                continue
            api_version = f"{group}/{served['name']}"
            schema = convert(served["schema"]["openAPIV3Schema"])
            schema["properties"]["apiVersion"] = {"const": api_version}
            schema["properties"]["kind"] = {"const": kind}
            schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
            schema["$schema"] = "http://json-schema.org/draft-07/schema#"
            schema["$comment"] = f"{kind} {api_version} from {source} {version} ({Path(path).name})"
            name = f"{group}_{kind}_{served['name']}.json"
            (OUT / name).write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
            sys.stdout.write(f"{OUT / name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
