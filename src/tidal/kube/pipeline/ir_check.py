"""The KFP v2 driver's input-resolution rules, applied to a compiled pipeline spec, offline.

On a cluster, the KFP driver resolves each task's inputs before the task's pod
exists, and only from the task's *immediate* parent DAG:

- ``componentInputParameter: X`` (and ``componentInputArtifact``) must be an input
  the parent DAG declares in its ``inputDefinitions``; otherwise the task fails
  with "parent DAG does not have input parameter X";
- ``taskOutputParameter`` (and ``taskOutputArtifact``) must name a sibling task in
  the same DAG that declares that output;
- placeholders in a task's runtime values (``{{$.inputs.parameters['X']}}``, e.g. a
  CPU request set from a pipeline parameter), a condition's
  ``inputs.parameter_values['X']`` and a loop's ``items.inputParameter`` are read
  from the task's *own* inputs, so X must be one of them.

``kfp.local`` searches outer scopes as well, so a pipeline that breaks these
rules still runs there; :func:`driver_resolution_violations` finds it at compile
time instead.
"""

from __future__ import annotations

import re

_PLACEHOLDER = re.compile(r"\{\{\$\.inputs\.parameters\['([^']+)'\]\}\}")
_CONDITION_INPUT = re.compile(r"inputs\.parameter_values\['([^']+)'\]")


def driver_resolution_violations(pipeline_spec: dict) -> list[str]:
    """Every input a KFP driver could not resolve, as ``"<dag>/<task>: <why>"``; empty when all resolve."""
    components = pipeline_spec.get("components") or {}
    problems: list[str] = []
    dags = [(name, component) for name, component in components.items() if "dag" in component]
    dags.append(("root", pipeline_spec["root"]))
    for dag_name, dag_component in dags:
        declared = dag_component.get("inputDefinitions") or {}
        tasks = dag_component["dag"].get("tasks") or {}
        for task_name, task in tasks.items():
            where = f"{dag_name}/{task_name}"
            problems += _input_problems(where, task, declared, tasks, components)
            problems += _own_input_problems(where, task)
    return problems


def _input_problems(where: str, task: dict, declared: dict, siblings: dict, components: dict) -> list[str]:
    problems = []
    inputs = task.get("inputs") or {}
    for kind, parent_key in (("parameters", "componentInputParameter"), ("artifacts", "componentInputArtifact")):
        parent_inputs = declared.get(kind) or {}
        for input_name, spec in (inputs.get(kind) or {}).items():
            source = spec.get(parent_key)
            if source is not None and source not in parent_inputs:
                problems.append(f"{where}: input {input_name!r} reads {source!r}, which the parent DAG does not declare")
            problems += _producer_problems(where, input_name, spec, kind, siblings, components)
    return problems


def _producer_problems(where: str, input_name: str, spec: dict, kind: str, siblings: dict, components: dict) -> list[str]:
    output = spec.get("taskOutputParameter") if kind == "parameters" else spec.get("taskOutputArtifact")
    if output is None:
        return []
    producer = output.get("producerTask")
    key = output.get("outputParameterKey") if kind == "parameters" else output.get("outputArtifactKey")
    if producer not in siblings:
        return [f"{where}: input {input_name!r} reads an output of {producer!r}, which is not a task of the same DAG"]
    component = components.get(siblings[producer].get("componentRef", {}).get("name"), {})
    outputs = (component.get("outputDefinitions") or {}).get(kind) or {}
    if key not in outputs:
        return [f"{where}: input {input_name!r} reads output {key!r} of {producer!r}, which does not declare it"]
    return []


def _own_input_problems(where: str, task: dict) -> list[str]:
    """Placeholders, conditions and loop items are resolved against the task's own inputs."""
    own = set((task.get("inputs") or {}).get("parameters") or {})
    wanted: list[tuple[str, str]] = []
    for input_name, spec in ((task.get("inputs") or {}).get("parameters") or {}).items():
        constant = (spec.get("runtimeValue") or {}).get("constant")
        if isinstance(constant, str):
            wanted += [(f"input {input_name!r}", name) for name in _PLACEHOLDER.findall(constant)]
    condition = (task.get("triggerPolicy") or {}).get("condition") or ""
    wanted += [("its condition", name) for name in _CONDITION_INPUT.findall(condition)]
    items = ((task.get("parameterIterator") or {}).get("items") or {}).get("inputParameter")
    if items:
        wanted.append(("its loop items", items))
    return [f"{where}: {what} reads {name!r}, which is not an input of the task" for what, name in wanted if name not in own]
