"""Tidal's KFP components (defined in :mod:`tidal.kube.pipeline.components`; see README.md here)."""

from tidal.kube.pipeline.components import (  # noqa: F401
    evaluate,
    finalize,
    open_round,
    prepare,
    register_model,
    rollout_worker,
    train,
    weight_sync,
    worker_pool,
)
