"""A small reader of the KFP protos in tests/data/kfp_protos/ (per KFP backend release: its executor-config and
pipeline-spec protos, and how it parses them, releases.json) and the check of a compiled pipeline against them:
which fields a release does not know.

Only what these protos use is read: messages (nested too), scalar, message, ``repeated`` and ``map<>`` fields,
``oneof`` groups (their fields are the message's), enums (their values are not checked). A type from another
file (``ml_pipelines.*``, ``google.protobuf.*``) is opaque: the check does not look inside it."""

import json
import re
from pathlib import Path

PROTOS = Path(__file__).resolve().parent / "data" / "kfp_protos"
SCALARS = {"string", "bool", "int32", "int64", "uint32", "uint64", "double", "float", "bytes", "sint32", "sint64"}
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[A-Za-z_][\w.]*|\d+|[{}<>;=,\[\]()]')


def releases() -> dict[str, dict]:
    """``{tag: {"proto", "driver", "compiler", "healthz_tag_name", "pipeline_store"}}`` (releases.json)."""
    return {tag: rule for tag, rule in json.loads((PROTOS / "releases.json").read_text()).items() if not tag.startswith("_")}


def tags() -> list[str]:
    return sorted(releases(), key=version)


def version(tag: str) -> tuple[int, ...]:
    return tuple(int(part) for part in tag.split("."))


def json_name(field: str) -> str:
    head, *rest = field.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def parse(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """``{message: {json field name: (kind, type)}}``, kind ``scalar``, ``message``, ``map`` (type: its values'
    message, or empty) or ``opaque``; nested messages are named ``Outer.Inner``; each message's field types are
    resolved to these names."""
    text = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))
    tokens = TOKEN.findall(text)
    messages: dict[str, dict[str, str]] = {}
    enums: set[str] = set()
    scope: list[tuple[str, str]] = []  # (kind, name) of the blocks we are in
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t in ("message", "enum") and i + 2 < len(tokens) and tokens[i + 2] == "{":
            name = ".".join([n for k, n in scope if k == "message"] + [tokens[i + 1]])
            (messages.setdefault(name, {}) if t == "message" else enums.add(name))
            scope.append((t, name.rsplit(".", 1)[-1]))
            i += 3
        elif t in ("oneof", "service", "extend") and i + 2 < len(tokens) and tokens[i + 2] == "{":
            scope.append((t, tokens[i + 1]))
            i += 3
        elif t == "{":
            scope.append(("block", ""))
            i += 1
        elif t == "}":
            scope.pop()
            i += 1
        elif scope and scope[-1][0] in ("message", "oneof") and t not in ("option", "reserved", "extensions", ";"):
            end = tokens.index(";", i)
            statement = tokens[i:end]
            i = end + 1
            if statement[0] in ("optional", "repeated", "required"):
                statement = statement[1:]
            if statement[0] == "map":  # map < k , v > name = n
                ftype, fname = f"map<{statement[4]}>", statement[6]
            else:
                ftype, fname = statement[0], statement[1]
            owner = ".".join(n for k, n in scope if k == "message")
            messages[owner][json_name(fname)] = ftype
        else:
            end = tokens.index(";", i) if ";" in tokens[i:] and scope and scope[-1][0] != "enum" else i
            i = end + 1
    return {name: {f: resolve(name, t, messages, enums) for f, t in fields.items()} for name, fields in messages.items()}


def resolve(owner: str, ftype: str, messages: dict, enums: set[str]) -> tuple[str, str]:
    if ftype.startswith("map<"):
        kind, target = resolve(owner, ftype[4:-1], messages, enums)
        return "map", target if kind == "message" else ""
    if ftype in SCALARS:
        return "scalar", ftype
    parts = owner.split(".")
    for depth in range(len(parts), -1, -1):  # innermost scope first, as protoc resolves names
        candidate = ".".join(parts[:depth] + [ftype])
        if candidate in messages:
            return "message", candidate
        if candidate in enums:
            return "scalar", "enum"
    return "opaque", ftype


def load(tag: str) -> dict[str, dict[str, tuple[str, str]]]:
    """The executor-config proto release ``tag`` is built with."""
    return parse((PROTOS / f"kubernetes_executor_config-{releases()[tag]['proto']}.proto").read_text())


def load_pipeline_spec(tag: str) -> dict[str, dict[str, tuple[str, str]]]:
    """The pipeline-spec proto release ``tag`` is built with."""
    return parse((PROTOS / f"pipeline_spec-{releases()[tag]['proto']}.proto").read_text())


def unknown_fields(value, schema: dict, message: str = "KubernetesExecutorConfig", path: str = "") -> list[str]:
    """Field paths of ``value`` (an executor config as compiled, JSON names) that ``message`` does not declare."""
    found = []
    for name, child in value.items():
        where = f"{path}.{name}" if path else name
        if name not in schema[message]:
            found.append(where)
            continue
        kind, target = schema[message][name]
        if kind == "map" and target:
            for key, item in child.items():
                found += unknown_fields(item, schema, target, f"{where}[{key}]")
        if kind != "message":
            continue
        for item in child if isinstance(child, list) else [child]:
            found += unknown_fields(item, schema, target, where + ("[]" if isinstance(child, list) else ""))
    return sorted(set(found))
