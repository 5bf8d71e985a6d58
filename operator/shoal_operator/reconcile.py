"""One pass for one ModelDeployment: read it and its children back, plan, apply in order."""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import UTC, datetime

from shoal_operator.config import OperatorConfig
from shoal_operator.kube import Kube
from shoal_operator.metrics import OperatorMetrics
from shoal_operator.observed import Observed
from shoal_operator.planner import plan
from shoal_operator.spec import ModelDeployment

logger = logging.getLogger(__name__)


def reconcile(kube: Kube, namespace: str, name: str, config: OperatorConfig,
              metrics: OperatorMetrics) -> float | None:
    """Returns the seconds after which time alone changes the plan (None: only a change does).
    Stops at the first failing action; the next pass reads everything back again. `metrics`
    counts the pass once its actions are all carried out."""
    body = kube.read_model_deployment(namespace, name)
    if body is None:
        return None
    md = ModelDeployment.from_body(body, config.default_image)
    observed = Observed.from_objects(*kube.list_children(namespace, name))
    autoscaled = {r.name for r in md.spec.roles() if r.autoscaling is not None}
    if autoscaled:  # the signals of each ready node-0 pod (the planner counts Ready groups)
        leaders = [p for p in observed.pods if p.role in autoscaled and p.node_rank == 0
                   and p.ready and p.live and p.pod_ip and p.owner_uid == md.uid]
        observed = replace(observed, signals=tuple(sorted(kube.read_signals(leaders).items())))
    result = plan(md, observed, datetime.now(UTC), config)
    for action in result.actions:
        logger.info("%s/%s: %s", namespace, name, action.describe())
        kube.apply(body, action)
    metrics.observe(md, result.actions)
    return result.requeue_after
