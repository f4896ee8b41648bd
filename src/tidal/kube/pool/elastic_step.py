"""The ``worker_pool`` step: with ``worker_pool=elastic`` it creates the run's rollout-worker Deployment and its KEDA
ScaledObject (:mod:`tidal.kube.pool.elastic`); with ``fixed`` it does nothing."""

from __future__ import annotations

from pathlib import Path

from tidal.kube import cluster
from tidal.kube.steps import run_state
from tidal.kube.steps.pod_sandbox import as_separate_pod
from tidal.kube.steps.records import PipelineStepError
from tidal.kube.steps.staging import WORKER_POOLS, PoolSettings
from tidal.rundir import RunDir


@as_separate_pod("worker-pool")
def start_worker_pool(
    worker_pool: str,
    run_dir: str,
    config_path: str,
    namespace: str,
    accelerator: str,
    image: str,
    accelerators: int,
    cpu: str,
    memory: str,
    settings: PoolSettings,
    queue_name: str = "",
    api_client=None,
) -> list[str]:
    """``worker_pool=elastic``: check KEDA is installed, then create the run's rollout-worker Deployment and its
    ScaledObject (recorded first: finalize deletes them), owned by the run's owner object. ``fixed``: nothing."""
    if worker_pool not in WORKER_POOLS:
        raise PipelineStepError(f"worker_pool must be one of {', '.join(WORKER_POOLS)}, got {worker_pool!r}")
    if worker_pool == "fixed":
        print("worker_pool=fixed: each round runs its own rollout-worker tasks; no pool to create", flush=True)
        return []
    from kubernetes import client as k8s

    from tidal.config import load_config
    from tidal.kube.in_cluster import current_namespace
    from tidal.kube.pool import elastic as pool
    from tidal.transport.streams import stream_names

    if settings.termination_grace_s < 0:
        raise PipelineStepError(f"pool_termination_grace_s must be 0 or more seconds, got {settings.termination_grace_s}")
    run = RunDir(Path(run_dir))
    config = load_config(config_path)
    minimum, maximum, lag = pool.pool_sizes(
        settings.min_workers,
        settings.max_workers,
        settings.lag_threshold,
        pool.most_workers(config.rollout.workers),
        config.trainer.prompts_per_iteration,
    )
    if api_client is None:
        from tidal.kube.in_cluster import cluster_api_client

        api_client = cluster_api_client()
    pool.check_keda_installed(k8s.ApiextensionsV1Api(api_client))
    namespace = namespace or current_namespace()
    spec = pool.PoolSpec(
        name=pool.pool_name(run.root.name),
        namespace=namespace,
        run_label=cluster.label_value(run.root.name),
        config_path=config_path,
        run_dir=str(run.root),
        stream=stream_names(run_state.run_id_of(run))["work_stream"],
        profile=cluster.accelerator_profile(accelerator),
        image=image or cluster.accelerator_profile(accelerator).image,
        min_workers=minimum,
        max_workers=maximum,
        lag_threshold=lag,
        accelerators=accelerators,
        cpu=cpu,
        memory=memory,
        node_selector=pool.parse_node_selector(settings.node_selector),
        preferred_nodes=pool.parse_node_selector(settings.preferred_nodes, "pool_preferred_nodes"),
        tolerations=(cluster.Toleration(key=settings.toleration_key),) if settings.toleration_key else (),
        termination_grace_s=settings.termination_grace_s,
        queue_name=queue_name,
        owner=pool.run_owner(k8s.CoreV1Api(api_client), pool.step_pod_name(), namespace),
    )
    if spec.owner is None:
        print("no owner object found for this step's pod: the pool is deleted by finalize only", flush=True)
    pool.record_pool(run, spec.namespace, spec.name)
    done = pool.create_pool(spec, api_client)
    done.append(f"pool of {minimum} to {maximum} rollout workers, one more per {lag} pending work items of {spec.stream}")
    for line in done:
        print(line, flush=True)
    return done
