"""Validate an object against an upstream CRD's openAPIV3Schema as the API server does with strict field
validation: a field the schema does not describe is an error, unless that object sets
``x-kubernetes-preserve-unknown-fields``. The CRDs are the trimmed upstream files in tests/data/crds/."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

CRD_DIR = Path(__file__).parent / "data" / "crds"
EMBEDDED_RESOURCE_FIELDS = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}


def load_crd(filename: str) -> dict:
    return json.loads((CRD_DIR / filename).read_text())


def open_api_schema(crd: dict) -> dict:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def strict_json_schema(schema: dict) -> dict:
    """The openAPIV3Schema as JSON Schema, unknown fields refused. The API server takes ``apiVersion``, ``kind``
    and ``metadata`` at the top of every object whether the schema names them or not, and checks ``metadata``
    (ObjectMeta) itself, so they are left open here."""
    converted = _convert(schema)
    converted["properties"] = {**converted.get("properties", {}), **EMBEDDED_RESOURCE_FIELDS}
    return converted


def _convert(schema: dict) -> dict:
    out = {key: value for key, value in schema.items() if not key.startswith("x-kubernetes-") and key != "nullable"}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema and not schema.get("x-kubernetes-int-or-string"):
            out[key] = [_convert(s) for s in schema[key]]
    if "not" in schema:
        out["not"] = _convert(schema["not"])
    if "items" in schema:
        out["items"] = _convert(schema["items"])
    properties = {name: _convert(prop) for name, prop in schema.get("properties", {}).items()}
    if schema.get("x-kubernetes-embedded-resource"):
        properties = {**EMBEDDED_RESOURCE_FIELDS, **properties}
    if properties:
        out["properties"] = properties
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _convert(schema["additionalProperties"])
    elif schema.get("type") == "object" and not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def schema_errors(obj: dict, crd: dict) -> list[str]:
    """One line per problem, naming the field: ``spec.runtimePatches: unknown field``."""
    validator = jsonschema.Draft7Validator(strict_json_schema(open_api_schema(crd)))
    problems = []
    for error in validator.iter_errors(obj):
        path = _path(error.absolute_path)
        if error.validator == "additionalProperties":
            known = set(error.schema.get("properties", {}))
            problems += [f"{_path([*error.absolute_path, key])}: unknown field" for key in sorted(set(error.instance) - known)]
        else:
            problems.append(f"{path or '<root>'}: {error.message}")
    return sorted(problems)


def _path(parts) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
