"""The pipeline's parameters, declared once: the run form's (name, type, default) and which of them the
training loop and each round take as well.

KFP reads a pipeline's parameters from its function's signature, and a nested pipeline (the loop, a
round) must declare every parameter its tasks read (the KFP driver resolves a task's inputs from its
immediate parent only). :func:`pipeline_function` makes those signatures from this one list.
"""

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from types import SimpleNamespace

from tidal.kube import cluster
from tidal.kube.cluster import DEFAULT_TERMINATION_GRACE_S

DEFAULT_CONFIG_PATH = "/opt/tidal/examples/arithmetic.yaml"
REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Parameter:
    name: str
    type: object
    default: object = REQUIRED
    per_round: bool = False
    """Also a parameter of the training loop and of every round (what the round's tasks read)."""


RUN_PARAMETERS = (
    Parameter("config_yaml", str, ""),
    Parameter("config_path", str, DEFAULT_CONFIG_PATH),
    Parameter("run_dir", str, ""),
    Parameter("rounds", int, 4),
    Parameter("iterations_per_round", int, 10, per_round=True),
    Parameter("rollout_workers", int, 2),
    Parameter("group_size", int, 0),
    Parameter("prompts_per_iteration", int, 0),
    Parameter("mode", str, ""),
    Parameter("overrides", str, ""),
    Parameter("experiment", str, "tidal"),
    Parameter("nats_url", str, cluster.NATS_URL),
    Parameter("tracking_uri", str, ""),
    Parameter("trainer_backend", str, "trainjob", per_round=True),
    Parameter("trainer_nodes", int, 1, per_round=True),
    Parameter("trainer_accelerators_per_node", int, 1, per_round=True),
    Parameter("worker_accelerators", int, 1, per_round=True),
    Parameter("worker_cpu", str, "8", per_round=True),
    Parameter("worker_memory", str, "32Gi", per_round=True),
    Parameter("trainer_image", str, "", per_round=True),  # default: the steps' image (compile option)
    Parameter("trainer_cpu", str, "8", per_round=True),
    Parameter("trainer_memory", str, "64Gi", per_round=True),
    Parameter("trainer_deadline_s", int, 24 * 3600, per_round=True),
    Parameter("trainer_start_timeout_s", int, 3600, per_round=True),
    Parameter("namespace", str, "", per_round=True),
    Parameter("registered_model_name", str, "tidal-policy"),
    Parameter("kfp_ui_url", str, ""),
    Parameter("mlflow_ui_url", str, ""),
    Parameter("worker_pool", str, "fixed"),
    Parameter("pool_min_workers", int, 1),
    Parameter("pool_max_workers", int, 0),
    Parameter("pool_lag_threshold", int, 0),
    Parameter("pool_node_selector", str, ""),
    Parameter("pool_preferred_nodes", str, ""),
    Parameter("pool_toleration_key", str, ""),
    Parameter("pool_termination_grace_s", int, DEFAULT_TERMINATION_GRACE_S),
)
"""The run form: every parameter a user sets per run, with its default."""

PREPARED = (Parameter("run_dir", str), Parameter("config_path", str), Parameter("lanes", list[str]))
"""What prepare hands the loop and every round (its outputs, not the run form's values)."""

PER_ROUND = tuple(replace(p, default=REQUIRED) for p in RUN_PARAMETERS if p.per_round)
LOOP_PARAMETERS = (*PREPARED, Parameter("rounds", list[int]), *PER_ROUND)
ROUND_PARAMETERS = (*PREPARED, Parameter("round_index", int), *PER_ROUND)


def run_parameters(trainer_image: str) -> tuple[Parameter, ...]:
    """The run form, with ``trainer_image``'s default set to the steps' image."""
    return tuple(replace(p, default=trainer_image) if p.name == "trainer_image" else p for p in RUN_PARAMETERS)


def per_round_values(values: SimpleNamespace) -> dict:
    """The per-round parameters' values out of a pipeline's parameters, to pass to the loop or a round."""
    return {p.name: getattr(values, p.name) for p in PER_ROUND}


def pipeline_function(parameters: Iterable[Parameter]) -> Callable[[Callable[[SimpleNamespace], None]], Callable]:
    """Decorator: ``body(p)`` becomes a function whose signature is ``parameters`` (what ``dsl.pipeline`` reads);
    the body gets them as attributes of ``p``."""
    signature = inspect.Signature(
        [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default, annotation=p.type) for p in parameters]
    )

    def wrap(body: Callable[[SimpleNamespace], None]) -> Callable:
        @functools.wraps(body)
        def pipeline(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return body(SimpleNamespace(**bound.arguments))

        pipeline.__signature__ = signature
        return pipeline

    return wrap
