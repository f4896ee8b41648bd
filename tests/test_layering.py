"""The import graph of src/tidal (every import, including ones inside functions) keeps the
layering: the trainer and the rollout package never import each other, environments are the rollout
side's alone (the trainer sees trajectories, never an environment), algo/ is pure tensor math, and vLLM
is imported only by the rollout/vllm* modules (every version-specific call in one place)."""

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "tidal"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module that `module` (with this source) imports, relative ones resolved."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from tidal import rollout`
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p.read_text(), module_name(p), p.name == "__init__.py") for p in SRC.rglob("*.py")}


def inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    stdlib = sys.stdlib_module_names
    bad = []
    for module, imported in sorted(graph.items()):
        for name in sorted(imported):
            if inside(module, "tidal.trainer") and inside(name, "tidal.rollout"):
                bad.append(f"{module} -> {name} (trainer must not import rollout)")
            if inside(module, "tidal.rollout") and inside(name, "tidal.trainer"):
                bad.append(f"{module} -> {name} (rollout must not import trainer)")
            if inside(module, "tidal.trainer") and inside(name, "tidal.envs"):
                bad.append(f"{module} -> {name} (trainer must not import envs)")
            if inside(module, "tidal.envs") and (inside(name, "tidal.trainer") or inside(name, "tidal.rollout")):
                bad.append(f"{module} -> {name} (envs are below the roles: no trainer or rollout import)")
            top = name.split(".")[0]
            if top == "vllm" and not module.startswith("tidal.rollout.vllm"):
                bad.append(f"{module} -> {name} (only tidal.rollout.vllm* imports vllm)")
            if inside(module, "tidal.algo") and not (top in stdlib or top == "torch" or inside(name, "tidal.algo") or name == "__future__"):
                bad.append(f"{module} -> {name} (algo may import only torch and the standard library)")
    return bad


def test_the_import_graph_has_no_forbidden_edge():
    graph = import_graph()
    assert len(graph) > 40 and "tidal.trainer.loop" in graph  # the walk saw the tree
    assert forbidden_edges(graph) == []


def test_the_check_catches_each_kind_of_forbidden_edge():
    graph = {
        "tidal.trainer.loop": {"tidal.rollout.worker"},
        "tidal.rollout.worker": {"tidal.trainer", "tidal.envs"},
        "tidal.algo.losses": {"tidal.model.packing", "numpy", "torch", "math"},
        "tidal.trainer.learner": {"tidal.envs.base"},
        "tidal.envs.base": {"tidal.rollout.engine"},
        "tidal.rollout.generator": {"vllm.sampling_params", "tidal.rollout.vllm_adapter"},
        "tidal.rollout.vllm_weights": {"vllm.distributed.weight_transfer.base", "torch"},
    }
    bad = forbidden_edges(graph)
    assert "tidal.rollout.generator -> vllm.sampling_params (only tidal.rollout.vllm* imports vllm)" in bad
    assert not any(b.startswith("tidal.rollout.vllm_weights") or "vllm_adapter" in b for b in bad)
    assert len(bad) == 7 and any("numpy" in b for b in bad) and any("tidal.model.packing" in b for b in bad)
    assert "tidal.trainer.learner -> tidal.envs.base (trainer must not import envs)" in bad
    assert any(b.startswith("tidal.envs.base -> tidal.rollout.engine") for b in bad)


def test_relative_and_function_level_imports_are_seen():
    source = "import torch\n\ndef f():\n    from ..rollout import worker\n    from . import learner\n"
    found = imports_of(source, "tidal.trainer.probe")
    assert {"tidal.rollout.worker", "tidal.trainer.learner", "torch"} <= found
    assert forbidden_edges({"tidal.trainer.probe": found}) == [
        "tidal.trainer.probe -> tidal.rollout (trainer must not import rollout)",
        "tidal.trainer.probe -> tidal.rollout.worker (trainer must not import rollout)",
    ]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules of the tree that import each other, directly or through others (an
    import names its longest enclosing module in the tree; a package's own __init__ counts as one)."""
    modules = set(graph)

    def in_tree(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: sorted({t for n in names if (t := in_tree(n)) and t != m}) for m, names in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_inside_the_tree():
    graph = import_graph()
    assert "tidal.config" in graph and "tidal.plan.model" in graph
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_direct_and_indirect_cycles_and_function_level_imports():
    graph = {
        "tidal.config": {"tidal.trainer.deepspeed_config.check"},  # a name inside a module
        "tidal.trainer.deepspeed_config": {"tidal.model.loading"},
        "tidal.model.loading": {"tidal.config", "torch"},
        "tidal.plan": {"tidal.plan.devices"},
        "tidal.plan.devices": {"tidal.plan"},
        "tidal.data": {"tidal.config"},
    }
    assert sorted(import_cycles(graph)) == [
        ["tidal.config", "tidal.model.loading", "tidal.trainer.deepspeed_config"],
        ["tidal.plan", "tidal.plan.devices"],
    ]
    source = "def f():\n    from tidal.plan import devices\n"
    assert import_cycles({"tidal.plan.devices": {"tidal.plan"}, "tidal.plan": imports_of(source, "tidal.plan", True)})
