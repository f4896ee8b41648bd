"""Trim an upstream CRD file to what the tests read: one kind, one served version, its openAPIV3Schema
without descriptions. Usage: python trim.py UPSTREAM.yaml KIND VERSION > OUT.json"""

import json
import sys

import yaml


def without_descriptions(schema):
    if isinstance(schema, list):
        return [without_descriptions(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key == "properties":  # here the keys are field names: a field may be called "description"
            kept[key] = {name: without_descriptions(prop) for name, prop in value.items()}
        else:
            kept[key] = without_descriptions(value)
    return kept


def trim(path: str, kind: str, version: str) -> dict:
    (crd,) = [d for d in yaml.safe_load_all(open(path)) if d and d["spec"]["names"]["kind"] == kind]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return {
        "apiVersion": crd["apiVersion"],
        "kind": crd["kind"],
        "metadata": {"name": crd["metadata"]["name"]},
        "spec": {
            "group": crd["spec"]["group"],
            "names": crd["spec"]["names"],
            "scope": crd["spec"]["scope"],
            "versions": [
                {
                    "name": served["name"],
                    "served": served["served"],
                    "storage": served["storage"],
                    "schema": {"openAPIV3Schema": without_descriptions(served["schema"]["openAPIV3Schema"])},
                }
            ],
        },
    }


if __name__ == "__main__":
    json.dump(trim(*sys.argv[1:4]), sys.stdout, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")
