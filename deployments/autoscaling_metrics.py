"""The custom autoscaling metrics of an LLM replica: what `LLMServer.record_autoscaling_stats` reports
and the policy (deployments.autoscaling) and the fleet simulator (cluster.fleet_sim) read, as
`ctx.aggregated_metrics[name][replica_id]`. The names are defined here once."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional

RUNNING = "running"  # sequences in the engine's batch
WAITING = "waiting"  # requests queued in the engine
KV_USAGE = "kv_usage"  # share of KV blocks in use (0..1)
KV_BLOCKS_FREE = "kv_blocks_free"
FINISHED = "finished"  # a counter (completed + aborted requests): the policy reads its rate
PREEMPTIONS = "preemptions"  # a counter too
CAPACITY = "capacity"  # req/s the replica would complete with every slot busy (router.cost_model.StepMeter)


@dataclass(frozen=True)
class AutoscalingReport:
    """One replica's report. `capacity` is None until the replica has measured its steps: Serve averages
    each metric over the points it has, so a zero would pull the first real ones down."""

    running: float
    waiting: float
    kv_usage: float
    kv_blocks_free: float
    finished: float
    preemptions: float
    capacity: Optional[float] = None

    def as_metrics(self) -> Dict[str, float]:
        """The dict Serve takes from record_autoscaling_stats (capacity left out while unknown)."""
        return {k: float(v) for k, v in asdict(self).items() if v is not None}


METRIC_NAMES = (RUNNING, WAITING, KV_USAGE, KV_BLOCKS_FREE, FINISHED, PREEMPTIONS, CAPACITY)
