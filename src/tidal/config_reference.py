"""The configuration reference (docs/configuration.md), generated from the config schema.

`render(schema)` is a pure function of a pydantic model class: one section per config block (the
top level, `model`, `model.tiny`, ...), each a table of key, type, default and description. A
description is the field's own `description` when it has one, else the comments beside and directly
above the field's declaration in the class's source; a block's text is its class docstring.

    python -m tidal.config_reference docs/configuration.md          # (re)write it
    python -m tidal.config_reference --check docs/configuration.md  # exit 1 when it is out of date

Imports pydantic and the config module only (no torch): the check runs in a lint-sized environment.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
import unicodedata
from collections.abc import Iterable
from pathlib import Path

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

COMMAND = "python -m tidal.config_reference docs/configuration.md"

INTRO = """\
Every role reads one typed config: a YAML file, validated against the schema in
`src/tidal/config/schema.py` before anything starts. An unknown key or a bad value is an error that names
the key. On the command line, `--set key=value` overrides one key (the value is parsed as YAML), e.g.
`tidal run examples/arithmetic.yaml --set trainer.iterations=20 --set rollout.engine=vllm`; a number
steps into a list the config file gives (`--set reward.functions.1.weight=0.5`).
Relative paths in a config file are relative to the file; in `--set` overrides, to the working
directory. The resolved config is saved as `config.yaml` in the run directory.

Rules that involve several keys (for example `rollout.vllm.weight_sync: nccl` needs
`rollout.engine: vllm` and `mode: periodic`) are checked when the config is loaded, and the error
names the keys involved."""


# What a key does where the schema does not say it itself (no Field description, no comment beside
# the field). The schema's own text wins; tests/test_docs.py fails on an entry whose key no longer exists.
NOTES = {
    "mode": "How groups reach the trainer: `sync` generates and trains in turn in one process; `periodic` streams "
    "groups from rollout workers over NATS, weights change only at iteration boundaries (staleness 0); `bounded` lets "
    "workers run up to `rollout.max_staleness` versions ahead. See [Modes](modes.md).",
    "seed": "Seeds the prompt order of every iteration, sampling, the synthetic data and the tiny model's warm start.",
    "model.dtype": "The dtype the model is loaded and trained in.",
    "model.tiny.arch": "Transformers architecture of the tiny model.",
    "model.tiny.hidden_size": "The tiny model's `hidden_size` (as in a transformers config).",
    "model.tiny.intermediate_size": "The tiny model's MLP width.",
    "model.tiny.num_layers": "The tiny model's decoder layers.",
    "model.tiny.num_heads": "The tiny model's attention heads.",
    "model.tiny.num_kv_heads": "The tiny model's key/value heads (grouped-query attention when fewer than `num_heads`).",
    "model.tiny.max_position_embeddings": "Longest sequence (prompt and response) the tiny model takes.",
    "model.warm_start.enabled": "Warm-start the tiny model with a short SFT on the task (cached under `cache_dir`, reused).",
    "model.warm_start.steps": "SFT steps (the most it runs when `stop_at_accuracy` is set).",
    "model.warm_start.batch_size": "SFT batch size.",
    "model.warm_start.lr": "SFT learning rate.",
    "model.warm_start.examples": "Training problems the SFT draws from.",
    "model.warm_start.probe_every": "Steps between accuracy probes (see `stop_at_accuracy`).",
    "model.warm_start.tool_use": "With `rollout.env: tools` and `calc` or `python` in `rollout.tools` (the first of them named): the share of the synthetic warm-start trajectories that call the tool (the rest answer in the head).",
    "model.warm_start.tool_mistakes": "The share of those tool calls made wrongly (a mistyped operand; an argument `calc` does not take, or a `python` program that never prints), so RL has better and worse calls to tell apart.",
    "model.warm_start.probe_prompts": "Training prompts each probe scores (see `stop_at_accuracy`).",
    "data.task": "`arithmetic`: synthetic problems made from `seed`; `jsonl`: rows from `data.path`.",
    "data.eval_path": "jsonl: held-out rows; unset: the last tenth of the rows read from `data.path` is held out.",
    "data.num_train": "Training problems (arithmetic: generated; jsonl: the most rows read from `data.path`, the rest of a longer file unused).",
    "data.num_eval": "Held-out problems (jsonl: the most rows used of `data.eval_path` or the held-out tenth).",
    "data.max_digits": "arithmetic: digits per operand.",
    "data.operations": "arithmetic: the operators drawn from.",
    "data.chat_template": "Apply the tokenizer's chat template (see `prompt_template`).",
    "data.system_prompt": "A system turn before each question (needs `chat_template`).",
    "reward.functions": "The reward functions, summed with their weights.",
    "reward.overlong_penalty": "The penalty at the length limit; it grows linearly over the last `overlong_buffer` tokens.",
    "reward.functions[].weight": "This function's weight in the summed reward.",
    "reward.functions[].type": "`function`: `name` is a registered reward or `module:function`; `reward_model` or `judge`: "
    "a model behind HTTP (see [Rewards from served models](served-rewards.md)).",
    "rollout.engine": "`hf`: transformers generation in the worker; `vllm`: vLLM's AsyncLLM. See [vLLM](vllm.md).",
    "rollout.group_size": "G: samples per prompt (one group).",
    "rollout.max_new_tokens": "Longest response, in tokens.",
    "rollout.temperature": "Sampling temperature (no top-p or top-k).",
    "rollout.deterministic": "Every group a function of (seed, iteration, prompt id) alone: sync, periodic and bounded with "
    "`max_staleness` 0 then train the same weights.",
    "rollout.vllm.tensor_parallel_size": "Devices per vLLM engine.",
    "rollout.vllm.max_num_seqs": "vLLM's `max_num_seqs`.",
    "rollout.vllm.gpu_memory_utilization": "Share of device memory vLLM may take; lower it where the trainer shares the GPU.",
    "rollout.vllm.max_model_len": "vLLM's `max_model_len`.",
    "rollout.vllm.dtype": "The dtype vLLM serves in; `auto`: on CPU the trainer's `model.dtype`, on a GPU vLLM's own "
    "choice (bfloat16). See [vLLM](vllm.md#the-serving-dtype).",
    "rollout.vllm.enforce_eager": "vLLM's `enforce_eager` (no CUDA graphs).",
    "trainer.iterations": "Iterations the run trains in all; raise it and re-run the same command to train on.",
    "trainer.prompts_per_iteration": "Prompts (groups) per iteration.",
    "trainer.lr": "AdamW learning rate.",
    "trainer.warmup_steps": "Linear learning-rate warm-up, in optimizer steps; constant after.",
    "trainer.weight_decay": "AdamW weight decay.",
    "trainer.betas": "AdamW betas.",
    "trainer.max_grad_norm": "Global gradient-norm clipping.",
    "trainer.clip_eps": "PPO clip range (the upper side too, unless `clip_eps_high`).",
    "trainer.loss_aggregation": "How per-token losses are averaged; each is exact under streaming.",
    "trainer.kl_coef": "KL coefficient against the frozen reference; at 0 no reference is loaded.",
    "trainer.kl_estimator": "KL estimator.",
    "trainer.deepspeed": "A DeepSpeed config passed through (`strategy: deepspeed` only).",
    "trainer.ranks": "Trainer ranks `tidal run` starts on this machine (under torchrun).",
    "trainer.activation_checkpointing": "Recompute activations in the backward pass.",
    "trainer.group_timeout_seconds": "An iteration fails when no group has arrived for this long.",
    "eval.enabled": "Held-out evaluation before and after the run.",
    "eval.max_new_tokens": "Longest held-out response; unset: `rollout.max_new_tokens`.",
    "eval.batch_size": "Held-out prompts per generate call.",
    "tracking.experiment": "MLflow experiment.",
    "tracking.run_name": "MLflow run name; unset: the run directory's name.",
    "transport.max_payload_mb": "Largest message (a group), in MB; also the embedded nats-server's `max_payload`.",
    "transport.max_deliver": "Times JetStream hands out one work item; a work item that reaches it fails the run, naming the item.",
    "transport.stream_max_mb": "Size cap of each of the run's streams, in MB (see `stream_max_age_hours`).",
}


def anchor(title: str) -> str:
    """The anchor MkDocs gives a heading (the toc extension's default slugify); GitHub gives the same one
    unless the heading has runs of spaces or dashes."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comments on its declaration's lines and the comment lines directly above it,
    read from the source of the class and of the classes it inherits fields from (the nearest wins)."""
    found: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if _is_model(c) and c is not BaseModel]):
        found.update(_own_field_comments(base))
    return found


def _own_field_comments(cls: type) -> dict[str, str]:
    """field_comments of the fields declared in `cls` itself ({} when its source cannot be read)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # 1-based line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    found = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        beside = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comments]
        text = " ".join(part for part in above + beside if part and not part.startswith("noqa"))
        if text:
            found[node.target.id] = text
    return found


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


def _blocks(schema: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted path, model class) of every config block, depth first; a list of blocks is `path[]`."""
    out = [(path, schema)]
    for name, field in schema.model_fields.items():
        key = f"{path}.{name}" if path else name
        tp = field.annotation
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            candidates = [a for a in typing.get_args(tp) if _is_model(a)]
            tp = candidates[0] if len(candidates) == 1 else tp
        if _is_model(tp):
            out += _blocks(tp, key)
        elif typing.get_origin(tp) is list and typing.get_args(tp) and _is_model(typing.get_args(tp)[0]):
            out += _blocks(typing.get_args(tp)[0], key + "[]")
    return out


def config_keys(schema: type[BaseModel]) -> set[str]:
    """Every dotted key of `schema`, as the reference names them."""
    return {f"{path}.{name}" if path else name for path, cls in _blocks(schema) for name in cls.model_fields}


def _title(path: str) -> str:
    return f"`{path}`" if path else "Top level"


def render(schema: type[BaseModel], non_training_keys: Iterable[str] = (), notes: dict[str, str] | None = None) -> str:
    """The Markdown reference of `schema` (a pydantic model class). `notes`: dotted key -> description,
    used where the schema has none; `non_training_keys` (dotted keys, a trailing dot for a whole block)
    are listed as the ones a run directory may be resumed with changed."""
    notes = notes or {}
    blocks = _blocks(schema)
    links = {cls: "#" + anchor(_title(path)) for path, cls in blocks}
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the schema in src/tidal/config/schema.py by `{COMMAND}`; do not edit by hand. -->",
        "",
        INTRO,
        "",
        "Blocks: " + ", ".join(f"[{_title(path)}]({links[cls]})" for path, cls in blocks) + ".",
    ]
    for path, cls in blocks:
        out += ["", f"## {_title(path)}", ""]
        doc = cls.__dict__.get("__doc__")
        if doc and cls is not schema:
            out += [" ".join(inspect.cleandoc(doc).split()), ""]
        if path.endswith("[]"):
            out += [f"Each entry of the list `{path[:-2]}` has these keys.", ""]
        comments = field_comments(cls)
        out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for name, field in cls.model_fields.items():
            key = f"{path}.{name}" if path else name
            description = field.description or comments.get(name) or notes.get(key, "")
            out.append(f"| `{key}` | {_cell(type_text(field, links))} | {_cell(default_text(field, links))} | {_cell(description)} |")
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

    return render(TidalConfig, NON_TRAINING_KEYS, NOTES)


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
                f"{args.path} is out of date with src/tidal/config/schema.py; regenerate it: python -m tidal.config_reference {args.path}",
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
