"""The configuration reference (docs/configuration.md), generated from the config schema.

`render(schema)` is a pure function of a pydantic model class: one section per config block (the
top level, `model`, `model.tiny`, ...; one per kind of a discriminated union's entries), each a table of
key, type, default and description. A description is the field's `Field(description=...)`, followed by
the built-in names of the registry its `json_schema_extra` names (tidal.config.names); a block's text is
its class docstring.

    python -m tidal.config_reference docs/configuration.md          # (re)write it
    python -m tidal.config_reference --check docs/configuration.md  # exit 1 when it is out of date

Imports pydantic and the config module only (no torch): the check runs in a lint-sized environment.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import re
import sys
import types
import typing
import unicodedata
from collections.abc import Iterable
from pathlib import Path

import annotated_types
import yaml
from pydantic import BaseModel, Tag
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

COMMAND = "python -m tidal.config_reference docs/configuration.md"

INTRO = """\
Every role reads one typed config: a YAML file, validated against the schema in
`src/tidal/config/` before anything starts. An unknown key or a bad value is an error that names
the key. On the command line, `--set key=value` overrides one key (the value is parsed as YAML), e.g.
`tidal run examples/arithmetic.yaml --set trainer.iterations=20 --set rollout.engine=vllm`; a number
steps into a list the config file gives (`--set reward.functions.1.weight=0.5`).
Relative paths in a config file are relative to the file; in `--set` overrides, to the working
directory. The resolved config is saved as `config.yaml` in the run directory.

Rules that involve several keys (for example `rollout.vllm.weight_sync: nccl` needs
`rollout.engine: vllm` and `mode: periodic`) are checked when the config is loaded, and the error
names the keys involved. Keys of older configs (the multi-turn keys once flat under `rollout`, now
under `rollout.agent`) are still read, with one warning line naming each old key and its new place."""


def anchor(title: str) -> str:
    """The anchor MkDocs gives a heading (the toc extension's default slugify); GitHub gives the same one
    unless the heading has runs of spaces or dashes."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _is_model(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _constraint_text(metadata: Iterable) -> list[str]:
    out = []
    for m in metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(m, attr, None)
            if isinstance(m, annotated_types.BaseMetadata) and value is not None:
                out.append(f"{sign} {value}")
    return out


def _type_text(tp, links: dict[type, str]) -> tuple[list[str], list[str]]:
    """(alternatives, constraints) of an annotation, each alternative already formatted."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        alternatives, constraints = _type_text(args[0], links)
        return alternatives, constraints + _constraint_text(args[1:])
    if origin in (typing.Union, types.UnionType):
        alternatives, constraints = [], []
        for arg in args:
            a, c = _type_text(arg, links)
            alternatives += a
            constraints += c
        return alternatives, constraints
    if origin is typing.Literal:
        texts = [_value_text(a) for a in args]
        if any(t != a for t, a in zip(texts, args) if isinstance(a, str)):  # one needs quotes: quote them all alike
            texts = [json.dumps(a) for a in args]
        return [f"`{t}`" for t in texts], []
    if tp is type(None):
        return ["`null`"], []
    if origin is list:
        inner, constraints = _type_text(args[0], links) if args else (["any"], [])
        return [f"list of {' or '.join(inner)}"], constraints
    if origin is tuple:
        return ["[" + ", ".join(" or ".join(_type_text(a, links)[0]) for a in args) + "]"], []
    if origin is dict:
        return ["mapping"], []
    if tp is typing.Any:
        return ["any"], []
    if _is_model(tp):
        return [f"[section]({links[tp]})" if tp in links else "section"], []
    if isinstance(tp, type):
        return [tp.__name__], []
    return [str(tp)], []


def type_text(field: FieldInfo, links: dict[type, str]) -> str:
    alternatives, constraints = _type_text(field.annotation, links)
    constraints += _constraint_text(field.metadata)
    seen = list(dict.fromkeys(alternatives))
    text = seen[0] if len(seen) == 1 else ", ".join(seen[:-1]) + " or " + seen[-1]
    return f"{text} ({', '.join(dict.fromkeys(constraints))})" if constraints else text


def _value_text(value) -> str:
    """A value as it is written in a YAML config: a plain scalar where YAML reads it back as itself,
    else JSON (which YAML reads too)."""
    plain = to_jsonable_python(value)
    if plain is None or isinstance(plain, bool):
        return json.dumps(plain)
    if isinstance(plain, str) and not _reads_back(plain):
        return json.dumps(plain)
    return plain if isinstance(plain, str) else json.dumps(plain)


def _reads_back(plain: str) -> bool:
    try:
        return yaml.safe_load(plain) == plain
    except yaml.YAMLError:  # "*" is an alias to YAML
        return False


def default_text(field: FieldInfo, links: dict[type, str]) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return f"[see below]({links[type(value)]})" if type(value) in links else "(a section)"
    return f"`{_value_text(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _models_in(tp) -> list[tuple[str | None, type[BaseModel]]]:
    """(tag, model class) of each model an annotation allows: a union's members, a tagged union's with their tags."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        tags = [m.tag for m in args[1:] if isinstance(m, Tag)]
        return [(tags[0] if tags else tag, cls) for tag, cls in _models_in(args[0])]
    if origin in (typing.Union, types.UnionType):
        return [found for arg in args for found in _models_in(arg)]
    return [(None, tp)] if _is_model(tp) else []


def _blocks(schema: type[BaseModel], path: str = "", kind: str | None = None) -> list[tuple[str, str | None, type[BaseModel]]]:
    """(dotted path, kind, model class) of every config block, depth first; a list of blocks is `path[]`, and each
    kind of a tagged union's entries (`reward.functions[]` of type `judge`) is a block of its own."""
    out = [(path, kind, schema)]
    for name, field in schema.model_fields.items():
        key = f"{path}.{name}" if path else name
        tp = field.annotation
        if typing.get_origin(tp) is list and typing.get_args(tp):
            key, tp = key + "[]", typing.get_args(tp)[0]
        models = _models_in(tp)
        if len(models) == 1:
            out += _blocks(models[0][1], key)
        elif models and all(tag is not None for tag, _ in models):
            for tag, cls in models:
                out += _blocks(cls, key, tag)
    return out


def config_keys(schema: type[BaseModel]) -> set[str]:
    """Every dotted key of `schema`, as the reference names them."""
    return {f"{path}.{name}" if path else name for path, _, cls in _blocks(schema) for name in cls.model_fields}


def _title(path: str, kind: str | None = None) -> str:
    title = f"`{path}`" if path else "Top level"
    return f"{title} of type `{kind}`" if kind else title


def description(field: FieldInfo) -> str:
    """The field's help text, and the built-in names of the registry it names (tidal.config.names)."""
    from tidal.config.names import registered

    text = field.description or ""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "built_in" in extra:
        text += f" Built in: {', '.join(f'`{n}`' for n in registered(extra['built_in']))}."
    return text


def render(schema: type[BaseModel], non_training_keys: Iterable[str] = ()) -> str:
    """The Markdown reference of `schema` (a pydantic model class). `non_training_keys` (dotted keys, a trailing
    dot for a whole block) are listed as the ones a run directory may be resumed with changed."""
    blocks = _blocks(schema)
    links = {cls: "#" + anchor(_title(path, kind)) for path, kind, cls in blocks}
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the schema in src/tidal/config/ by `{COMMAND}`; do not edit by hand. -->",
        "",
        INTRO,
        "",
        "Blocks: " + ", ".join(f"[{_title(path, kind)}]({links[cls]})" for path, kind, cls in blocks) + ".",
    ]
    for path, kind, cls in blocks:
        out += ["", f"## {_title(path, kind)}", ""]
        doc = cls.__dict__.get("__doc__")
        if doc and cls is not schema:
            out += [" ".join(inspect.cleandoc(doc).split()), ""]
        if path.endswith("[]"):
            which = f" with `type: {kind}`" if kind else ""
            out += [f"Each entry of the list `{path[:-2]}`{which} has these keys.", ""]
        out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for name, field in cls.model_fields.items():
            key = f"{path}.{name}" if path else name
            out.append(f"| `{key}` | {_cell(type_text(field, links))} | {_cell(default_text(field, links))} | {_cell(description(field))} |")
    keys = list(non_training_keys)
    if keys:
        out += [
            "",
            "## Keys a resumed run may change",
            "",
            "A run directory keeps the config it started with: re-running it with a config that would change",
            "training is refused, naming the keys that differ (`--force-new-config` goes on with the new values).",
            "These keys do not change what is trained, so they may differ on a resume:",
            "",
            *(f"- every key under `{k[:-1]}`" if k.endswith(".") else f"- `{k}`" for k in keys),
        ]
    return "\n".join(out) + "\n"


def current() -> str:
    """The reference of Tidal's own schema."""
    from tidal.config import NON_TRAINING_KEYS, TidalConfig

    return render(TidalConfig, NON_TRAINING_KEYS)


def stale_diff(path: Path, expected: str, lines: int | None = None) -> str:
    """'' when `path` holds `expected`, else the start of a unified diff (file -> schema)."""
    actual = path.read_text() if path.is_file() else ""
    if actual == expected:
        return ""
    diff = difflib.unified_diff(actual.splitlines(), expected.splitlines(), str(path), "schema", lineterm="", n=1)
    return "\n".join(list(diff)[:lines]) or f"{path} is missing"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidal.config_reference", description="Write or check the configuration reference.")
    parser.add_argument("path", type=Path, help="the Markdown file, e.g. docs/configuration.md")
    parser.add_argument("--check", action="store_true", help="do not write: exit 1 when the file differs from the schema")
    args = parser.parse_args(argv)
    text = current()
    if args.check:
        diff = stale_diff(args.path, text, lines=40)
        if diff:
            print(
                f"{args.path} is out of date with the schema in src/tidal/config/; regenerate it: python -m tidal.config_reference {args.path}",
                file=sys.stderr,
            )
            print(diff, file=sys.stderr)
            return 1
        print(f"{args.path} is up to date")
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
