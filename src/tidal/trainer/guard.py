"""The non-finite guard of the optimizer step: a NaN or inf loss or gradient norm must never reach
the weights (one such step turns every weight into NaN). The step is skipped, counted, logged, and
past `trainer.max_skipped_steps` the run fails."""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)


class SkippedStepsError(RuntimeError):
    """More optimizer steps were skipped for non-finite values than trainer.max_skipped_steps allows; one line."""


def step_is_finite(loss: float, grad_norm: float | None = None) -> bool:
    return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))


def record_skip(version: int, loss: float, grad_norm: float, skipped_total: int, limit: int) -> None:
    """Logs one skipped step (`skipped_total` counts it); raises once the total is over `limit`."""
    log.warning(
        "iteration %d: non-finite loss %s or gradient norm %s: optimizer step skipped, gradients dropped, weights unchanged "
        "(%d skipped in this run, trainer.max_skipped_steps %d)",
        version,
        loss,
        grad_norm,
        skipped_total,
        limit,
    )
    if skipped_total > limit:
        raise SkippedStepsError(
            f"trainer.max_skipped_steps ({limit}) exceeded: {skipped_total} optimizer steps skipped for a non-finite loss or gradient norm "
            f"(last: iteration {version}, loss {loss}, grad_norm {grad_norm}); check the reward functions, the advantage estimator and the lr, "
            "or raise trainer.max_skipped_steps"
        )
