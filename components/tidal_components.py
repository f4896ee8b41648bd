"""Tidal's KFP components (defined in :mod:`tidal.kube.components`; see README.md here)."""

from tidal.kube.components import (  # noqa: F401
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
