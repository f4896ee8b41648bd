"""What the prepare step stages: the config, with the run form's knobs applied, checked as ``tidal run``
checks it before anything starts, and written into the run directory with its data files found.

Every later step reads the staged ``RUN_DIR/config.yaml``; the config as submitted is kept beside the
steps' other records (``RUN_DIR/kube/submitted-config.yaml``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tidal.kube import cluster
from tidal.kube.cluster import DEFAULT_TERMINATION_GRACE_S
from tidal.kube.steps.records import PipelineStepError, StepRecords
from tidal.rundir import RunDir


def parse_override_lines(text: str) -> list[str]:
    """``key=value`` per line (or separated by ``;``); blank lines and ``#`` comments ignored."""
    items = [part.strip() for line in text.splitlines() for part in line.split(";")]
    overrides = [item for item in items if item and not item.startswith("#")]
    for item in overrides:
        if "=" not in item:
            raise PipelineStepError(f"override {item!r} must look like key=value")
    return overrides


@dataclass(frozen=True)
class PipelineKnobs:
    """The pipeline parameters that become config overrides (0 / "" keep the config's value)."""

    rounds: int
    iterations_per_round: int
    rollout_workers: int
    group_size: int = 0
    prompts_per_iteration: int = 0
    mode: str = ""
    experiment: str = ""
    nats_url: str = ""
    tracking_uri: str = ""
    overrides: str = ""

    def config_overrides(self) -> list[str]:
        if self.rounds < 1 or self.iterations_per_round < 1:
            raise PipelineStepError(f"rounds ({self.rounds}) and iterations_per_round ({self.iterations_per_round}) must both be at least 1")
        result = [f"trainer.iterations={self.rounds * self.iterations_per_round}", f"rollout.workers={self.rollout_workers}"]
        optional = {
            "rollout.group_size": self.group_size,
            "trainer.prompts_per_iteration": self.prompts_per_iteration,
            "mode": self.mode,
            "tracking.experiment": self.experiment,
            "transport.nats_url": self.nats_url,
            "tracking.uri": self.tracking_uri,
        }
        result += [f"{key}={value}" for key, value in optional.items() if value not in (0, "", None)]
        return result + parse_override_lines(self.overrides)


WORKER_POOLS = ("fixed", "elastic")


@dataclass(frozen=True)
class PoolSettings:
    """The run form's settings of an elastic worker pool (:mod:`tidal.kube.pool.elastic`)."""

    min_workers: int = 1
    max_workers: int = 0
    """0: the run's rollout.workers (the ``rollout_workers`` parameter)."""
    lag_threshold: int = 0
    """Pending work items per worker; 0: ceil(prompts_per_iteration / max_workers)."""
    node_selector: str = ""
    """Extra node labels of the pool's pods, ``key=value,...`` (a spot or preemptible GPU pool's)."""
    preferred_nodes: str = ""
    """Node labels the pool's pods prefer, ``key=value,...``, falling back to other nodes (spot first, then on-demand)."""
    toleration_key: str = ""
    """A taint key the pool's pods tolerate (a spot pool's taint), besides the accelerator's."""
    termination_grace_s: int = DEFAULT_TERMINATION_GRACE_S


def stage_config(run: RunDir, config_yaml: str, config_path: str, overrides: list[str]) -> str:
    """Validate the config with the overrides applied and write the resolved one into the run directory.

    Config text (``config_yaml``, what ``tidal submit`` sends) has no folder of its own, so its data
    paths must be absolute: a path in the image or on the data volume (``tidal submit`` rewrites
    the paths of files it can map into the image and refuses the others). A config file in the
    image (``config_path``) may use paths relative to its folder. Either way, the data files must
    exist in this pod, or the step fails here naming the key instead of in a later pod.
    """
    from tidal.config import ConfigError, dump_config, load_config

    record = StepRecords(run).create().submitted_config
    if config_yaml.strip():
        record.write_text(config_yaml)
        relative = relative_data_paths(config_yaml)
        if relative:
            listed = ", ".join(f"{key}: {value!r}" for key, value in relative.items())
            raise PipelineStepError(
                f"config_yaml has relative data paths ({listed}): config text has no folder to resolve them against. "
                f"Give absolute paths in the image or on the data volume ({cluster.DATA_MOUNT_PATH}), or submit with `tidal submit`, "
                "which maps files of the image's examples/ folder"
            )
        source, base_dir = record, None
    elif config_path:
        if not Path(config_path).is_file():
            raise PipelineStepError(f"config_path {config_path!r} does not exist in the component image")
        shutil.copyfile(config_path, record)
        source, base_dir = Path(config_path), None  # relative data paths: the file's folder in the image
    else:
        raise PipelineStepError("give the config as config_yaml (its text) or config_path (a file in the image)")
    try:
        config = load_config(source, overrides, base_dir)
    except ConfigError as err:
        raise PipelineStepError(str(err)) from None
    missing = {key: value for key, value in data_paths(config).items() if not Path(value).is_file()}
    if missing:
        listed = ", ".join(f"{key}={value}" for key, value in missing.items())
        raise PipelineStepError(f"data files not found in the pipeline's pods: {listed} (put them in the image or on the data volume)")
    problem = served_reward_problem(config, pipeline_worker_env())
    if problem:
        raise PipelineStepError(problem)
    from tidal.preflight import check_before_start

    try:  # what `tidal run` checks before it starts anything: reward names, data rows, prompt lengths
        check_before_start(config)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        raise PipelineStepError(str(err)) from None
    run.config.write_text(dump_config(with_key_files(config)))
    return str(run.config)


def with_key_files(config):
    """The staged config names the snapshot keys' files where the pods mount them (cluster.WEIGHTS_*_KEY_FILE), unless
    the config names others; under ``--via kfp-local`` the pods are processes of this machine, with no keys mounted
    (the run directory's key files, where there are any)."""
    from tidal.kube.steps.pod_sandbox import POD_SANDBOX_ENV

    weights = config.weights
    if os.environ.get(POD_SANDBOX_ENV):
        return config
    files = {"public_key_file": weights.public_key_file or cluster.WEIGHTS_PUBLIC_KEY_FILE}
    files["signing_key_file"] = weights.signing_key_file or cluster.WEIGHTS_SIGNING_KEY_FILE
    return config.model_copy(update={"weights": weights.model_copy(update=files)})


def pipeline_worker_env() -> set[str]:
    """The variables a served reward's ``api_key_env`` may name in the pipeline: what the compiled worker pods get from
    Secret tidal-rewards; under ``--via kfp-local`` the workers are processes of this machine, with its environment."""
    from tidal.kube.steps.pod_sandbox import POD_SANDBOX_ENV

    return set(cluster.REWARD_SECRET_ENV.values()) | (set(os.environ) if os.environ.get(POD_SANDBOX_ENV) else set())


def served_reward_problem(config, worker_env: set[str]) -> str | None:
    """A reward entry the pipeline's workers cannot score, in one line: ``serve`` (``tidal run`` starts that server
    beside its processes; the pipeline starts none), or an ``api_key_env`` no worker pod gets."""
    for entry in config.reward.functions:
        where = f"reward.functions[{entry.label}]"
        if entry.type == "function":
            continue
        if entry.type == "reward_model" and entry.serve is not None:
            return (
                f"{where}.serve: the pipeline starts no reward server (`tidal run` does, beside its local processes); "
                f"serve it in the cluster (manifests/components/reward-server) and give url: {cluster.REWARD_SERVER_URL}, "
                f"protocol: vllm_classify, model: {cluster.REWARD_SERVER_MODEL} instead (docs/kubernetes.md, 'A reward server in the cluster')"
            )
        if entry.api_key_env is not None and entry.api_key_env not in worker_env:
            given = ", ".join(f"{name} (key {key})" for key, name in cluster.REWARD_SECRET_ENV.items())
            return (
                f"{where}.api_key_env: the rollout-worker pods have no {entry.api_key_env}; "
                f"they get {given} from Secret {cluster.REWARD_SECRET}: name one of those"
            )
    return None


ELASTIC_NCCL_OFF = (
    "worker_pool=elastic: rollout.vllm.weight_sync 'nccl' set to 'store' "
    "(the NCCL group needs a fixed lane per worker; pool workers load each version from the weight store)"
)


def stage_for_pool(run: RunDir, config_yaml: str, config_path: str, overrides: list[str], worker_pool: str) -> str:
    """:func:`stage_config`; with an elastic pool, the NCCL weight transfer turned off, in one warning line: its
    group is fixed when the run starts (one lane per worker), and a pool's workers come and go."""
    staged = stage_config(run, config_yaml, config_path, overrides)
    if worker_pool == "elastic" and nccl_weight_sync(staged):
        print(f"warning: {ELASTIC_NCCL_OFF}", flush=True)
        staged = stage_config(run, config_yaml, config_path, [*overrides, "rollout.vllm.weight_sync=store"])
    return staged


def nccl_weight_sync(config_path: str) -> bool:
    from tidal.config import load_config

    return load_config(config_path).rollout.vllm.weight_sync == "nccl"


DATA_PATH_KEYS = ("path", "eval_path")


def relative_data_paths(config_yaml: str) -> dict[str, str]:
    """``data.path`` / ``data.eval_path`` values of config text that are relative paths."""
    import yaml

    try:
        data = (yaml.safe_load(config_yaml) or {}).get("data") or {}
    except (yaml.YAMLError, AttributeError):
        return {}  # the config loader reports the problem
    if not isinstance(data, dict):
        return {}
    return {f"data.{key}": data[key] for key in DATA_PATH_KEYS if isinstance(data.get(key), str) and not Path(data[key]).is_absolute()}


def data_paths(config) -> dict[str, str]:
    """The data files a resolved config reads, by dotted key."""
    return {f"data.{key}": getattr(config.data, key) for key in DATA_PATH_KEYS if getattr(config.data, key, None)}
