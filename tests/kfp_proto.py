"""A small reader of the KFP executor-config protos in tests/data/kfp_protos/ (one per KFP backend tag) and the
check of a compiled task's executor config against one: which fields that release's driver reads, and which it
does not know (2.4.x: refused, its driver parses strictly; 2.5.0 on: dropped).

Only what these protos use is read: messages (nested too), scalar, message, ``repeated`` and ``map<>`` fields,
``oneof`` groups (their fields are the message's), enums (their values are not checked). A type from another
file (``ml_pipelines.*``, ``google.protobuf.*``) is opaque: the check does not look inside it."""

import re
from pathlib import Path

PROTOS = Path(__file__).resolve().parent / "data" / "kfp_protos"
SCALARS = {"string", "bool", "int32", "int64", "uint32", "uint64", "double", "float", "bytes", "sint32", "sint64"}
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[A-Za-z_][\w.]*|\d+|[{}<>;=,\[\]()]')


def tags() -> list[str]:
    return sorted((p.stem.split("-", 1)[1] for p in PROTOS.glob("kubernetes_executor_config-*.proto")), key=version)


def version(tag: str) -> tuple[int, ...]:
    return tuple(int(part) for part in tag.split("."))


def json_name(field: str) -> str:
    head, *rest = field.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def parse(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """``{message: {json field name: (kind, type)}}``, kind ``scalar``, ``message``, ``map`` or ``opaque``; nested
    messages are named ``Outer.Inner``; each message's field types are resolved to these names."""
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
                ftype, fname = "map", statement[6]
            else:
                ftype, fname = statement[0], statement[1]
            owner = ".".join(n for k, n in scope if k == "message")
            messages[owner][json_name(fname)] = ftype
        else:
            end = tokens.index(";", i) if ";" in tokens[i:] and scope and scope[-1][0] != "enum" else i
            i = end + 1
    return {name: {f: resolve(name, t, messages, enums) for f, t in fields.items()} for name, fields in messages.items()}


def resolve(owner: str, ftype: str, messages: dict, enums: set[str]) -> tuple[str, str]:
    if ftype == "map":
        return "map", ""
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
    return parse((PROTOS / f"kubernetes_executor_config-{tag}.proto").read_text())


def unknown_fields(value, schema: dict, message: str = "KubernetesExecutorConfig", path: str = "") -> list[str]:
    """Field paths of ``value`` (an executor config as compiled, JSON names) that ``message`` does not declare."""
    found = []
    for name, child in value.items():
        where = f"{path}.{name}" if path else name
        if name not in schema[message]:
            found.append(where)
            continue
        kind, target = schema[message][name]
        if kind != "message":
            continue
        for item in child if isinstance(child, list) else [child]:
            found += unknown_fields(item, schema, target, where + ("[]" if isinstance(child, list) else ""))
    return sorted(set(found))
