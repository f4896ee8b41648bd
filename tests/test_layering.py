"""The import graph of src/tidal (every import, including ones inside functions) keeps the
layering: the trainer and the rollout package never import each other, environments are the rollout
side's alone (the trainer sees trajectories, never an environment), algo/ is pure tensor math, vLLM
is imported only by the rollout/vllm* modules (every version-specific call in one place), and the demo's
models (tidal.demo) are reached by the runtime through one module, DEMO_DOOR.
The Kubeflow layer's rooms (tidal.kube.*) keep theirs: code of the step pods never imports the
compiler or the client, the core never imports the Kubeflow layer, and the Kubeflow layer reaches the
core only through the modules listed in KUBE_REACHES_CORE."""

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


POD_ROOMS = ("tidal.kube.steps", "tidal.kube.trainer", "tidal.kube.pool")
"""Code that runs inside the pipeline's step and worker pods."""
KUBE_REACHES_CORE = {
    "tidal.config": "load and check a run's config",
    "tidal.rundir": "the run directory's layout",
    "tidal.transport": "the run's NATS streams and KV bucket",
    "tidal.protocol": "the run state and its encoding",
    "tidal.tracking": "MLflow",
    "tidal.weights": "the weight store's snapshots",
    "tidal.run_keys": "the snapshots' public key, read from its file",
    "tidal.export": "register_model's export",
    "tidal.preflight": "prepare's checks, as tidal run makes them",
    "tidal.roles": "prepare's base model (a warm start trains: torch)",
}
"""The core modules the Kubeflow layer imports (everything else goes through the tidal CLI verbs)."""
ONLY_FROM = {"tidal.roles": "tidal.kube.steps.run_start"}


DEMO_DOOR = "tidal.model.base_model"
"""The runtime's one way into tidal.demo: the base model and reward model a config names, the tiny ones built there.
Besides it only the demo itself and the benchmarks (which measure on the tiny model) import the demo."""


def demo_edge(module: str, name: str) -> list[str]:
    if not inside(name, "tidal.demo") or any(inside(module, p) for p in ("tidal.demo", "tidal.bench", DEMO_DOOR)):
        return []
    return [f"{module} -> {name} (the runtime reaches the demo only through {DEMO_DOOR})"]


def kube_edges(module: str, name: str) -> list[str]:
    bad = []
    kube = inside(module, "tidal.kube")
    if any(inside(module, room) for room in POD_ROOMS):
        if inside(name, "tidal.kube.pipeline") or inside(name, "tidal.kube.submit") or name.split(".")[0] == "kfp":
            bad.append(f"{module} -> {name} (pod code does not import the compiler or the client)")
    if inside(module, "tidal.kube.pipeline") and module != "tidal.kube.pipeline.components" and any(inside(name, room) for room in POD_ROOMS):
        bad.append(f"{module} -> {name} (only the components' bodies call into the pods' code)")
    if inside(module, "tidal.kube.trainer") and inside(name, "tidal.kube.pool"):
        bad.append(f"{module} -> {name} (the trainer does not import the worker pools)")
    if inside(module, "tidal.kube.pool") and inside(name, "tidal.kube.trainer") and not inside(name, "tidal.kube.trainer.shared"):
        bad.append(f"{module} -> {name} (the pools share only the trainer's pod parts)")
    if not kube and inside(name, "tidal.kube") and not (module == "tidal.cli" and inside(name, "tidal.kube.submit")):
        bad.append(f"{module} -> {name} (the core does not import the Kubeflow layer; tidal.cli registers its verbs)")
    if kube and inside(name, "tidal") and name != "tidal" and not inside(name, "tidal.kube"):
        core = ".".join(name.split(".")[:2])
        if core not in KUBE_REACHES_CORE:
            bad.append(f"{module} -> {name} (the Kubeflow layer reaches the core only through KUBE_REACHES_CORE)")
        elif core in ONLY_FROM and module != ONLY_FROM[core]:
            bad.append(f"{module} -> {name} ({core} only from {ONLY_FROM[core]})")
    return bad


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
            bad.extend(kube_edges(module, name))
            bad.extend(demo_edge(module, name))
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
        "tidal.algo.losses": {"tidal.trainer.packing", "numpy", "torch", "math"},
        "tidal.trainer.learner": {"tidal.envs.base"},
        "tidal.envs.base": {"tidal.rollout.engine"},
        "tidal.rollout.generator": {"vllm.sampling_params", "tidal.rollout.vllm_adapter"},
        "tidal.rollout.vllm_weights": {"vllm.distributed.weight_transfer.base", "torch"},
        "tidal.rollout.agent": {"tidal.demo.tiny", "tidal.model.templates"},
        "tidal.model.base_model": {"tidal.demo.warm_start"},
        "tidal.bench.rollout": {"tidal.demo.tiny"},
        "tidal.demo.warm_start": {"tidal.demo.tiny"},
    }
    bad = forbidden_edges(graph)
    assert "tidal.rollout.generator -> vllm.sampling_params (only tidal.rollout.vllm* imports vllm)" in bad
    assert not any(b.startswith("tidal.rollout.vllm_weights") or "vllm_adapter" in b for b in bad)
    assert "tidal.rollout.agent -> tidal.demo.tiny (the runtime reaches the demo only through tidal.model.base_model)" in bad
    assert len(bad) == 8 and any("numpy" in b for b in bad) and any("tidal.trainer.packing" in b for b in bad)
    assert "tidal.trainer.learner -> tidal.envs.base (trainer must not import envs)" in bad
    assert any(b.startswith("tidal.envs.base -> tidal.rollout.engine") for b in bad)


def test_the_kube_rooms_check_catches_each_kind_of_forbidden_edge():
    graph = {
        "tidal.kube.steps.rounds": {"tidal.kube.pipeline.definition", "kfp.dsl", "tidal.roles", "tidal.model.loading"},
        "tidal.kube.pipeline.definition": {"tidal.kube.steps.rounds", "tidal.kube.pipeline.components"},
        "tidal.kube.pipeline.components": {"tidal.kube.steps.rounds"},
        "tidal.kube.trainer.launch": {"tidal.kube.pool.fixed"},
        "tidal.kube.pool.elastic": {"tidal.kube.trainer.shared", "tidal.kube.trainer.launch"},
        "tidal.kube.steps.run_start": {"tidal.roles"},
        "tidal.rundir": {"tidal.kube.cluster"},
        "tidal.cli": {"tidal.kube.submit.cli"},
    }
    bad = forbidden_edges(graph)
    assert bad == [
        "tidal.kube.pipeline.definition -> tidal.kube.steps.rounds (only the components' bodies call into the pods' code)",
        "tidal.kube.pool.elastic -> tidal.kube.trainer.launch (the pools share only the trainer's pod parts)",
        "tidal.kube.steps.rounds -> kfp.dsl (pod code does not import the compiler or the client)",
        "tidal.kube.steps.rounds -> tidal.kube.pipeline.definition (pod code does not import the compiler or the client)",
        "tidal.kube.steps.rounds -> tidal.model.loading (the Kubeflow layer reaches the core only through KUBE_REACHES_CORE)",
        "tidal.kube.steps.rounds -> tidal.roles (tidal.roles only from tidal.kube.steps.run_start)",
        "tidal.kube.trainer.launch -> tidal.kube.pool.fixed (the trainer does not import the worker pools)",
        "tidal.rundir -> tidal.kube.cluster (the core does not import the Kubeflow layer; tidal.cli registers its verbs)",
    ]


def test_every_kube_module_is_in_a_room():
    graph = import_graph()
    rooms = {m.split(".")[2] for m in graph if inside(m, "tidal.kube") and m.count(".") >= 3}
    assert rooms == {"pipeline", "steps", "trainer", "pool", "submit"}
    flat = {m for m in graph if inside(m, "tidal.kube") and m.count(".") == 2} - {f"tidal.kube.{room}" for room in rooms}
    assert flat == {"tidal.kube.cluster", "tidal.kube.in_cluster"}  # shared names and the pod's API client; the rest in rooms


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
