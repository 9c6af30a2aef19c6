"""How often Ray Train's controller polls a run's workers: for their reports (the health check)
and for nodes being drained (the preemption watcher). The one home of both settings; the driver
hands them to the controller as arguments (controller.run_controller). No Ray import here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm import env

# Ray Train's controller collects reports when it polls the workers (Ray's default: every 2 s)
# and a worker holds one report at a time, so reports more frequent than the poll stall training.
REPORT_POLL_S = 0.5
# How often Ray's watcher asks the cluster which nodes are being drained (Ray's default: 5 s,
# which would eat a fifth of a 25 s spot notice).
PREEMPTION_POLL_S = 1.0


def report_poll_seconds(default: float = REPORT_POLL_S) -> float:
    """How often the controller should collect reports: the user's setting, else `default`."""
    return float(env.health_poll() or default)


def preemption_poll_seconds() -> float:
    """How often the watcher looks: the user's setting, else PREEMPTION_POLL_S."""
    return float(env.preemption_poll() or PREEMPTION_POLL_S)


@dataclass(frozen=True)
class Polls:
    """How often the controller collects the workers' reports and asks which nodes are being
    drained. Ray reads both from environment variables that it hands the controller and every
    worker as a runtime env; an actor with a runtime env of its own cannot take one of the
    processes Ray keeps ready, and a new one is started through Ray's runtime-env set-up (~1.6
    CPU seconds more apiece here, 2.2 s later to the first step: bench/helpers.py). Here they are
    the controller's arguments, and the run's actors have no runtime env unless the user sets
    Ray Train's variables or --worker-env."""

    report_s: float
    preemption_s: float

    @classmethod
    def for_run(cls, report_s: Optional[float] = None) -> Polls:
        """A run's polls: `report_s` (a caller's choice, as lr-find's), else the report setting;
        the preemption setting."""
        return cls(report_s=report_s or report_poll_seconds(), preemption_s=preemption_poll_seconds())
