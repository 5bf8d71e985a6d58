"""One pass for one ModelDeployment: read it and its children back, plan, apply in order."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime

from kubernetes.client import ApiException

from shoal_operator.actions import MAKES
from shoal_operator.config import OperatorConfig
from shoal_operator.kube import Kube
from shoal_operator.metrics import OperatorMetrics
from shoal_operator.observed import Observed
from shoal_operator.planner import plan
from shoal_operator.spec import ModelDeployment

logger = logging.getLogger(__name__)

# what the API answers an object it will not take: 400 malformed, 403 forbidden (admission such
# as Pod Security, a ResourceQuota), 422 invalid (e.g. a limit below its request)
REFUSED_STATUSES = frozenset({400, 403, 422})
MESSAGE_CHARS = 900


class CreateRefused(Exception):
    """The API refused an object the pass creates or changes; str() says which and why."""


def reconcile(kube: Kube, namespace: str, name: str, config: OperatorConfig,
              metrics: OperatorMetrics, create_refused: str = "") -> float | None:
    """Returns the seconds after which time alone changes the plan (None: only a change does).
    Stops at the first failing action; the next pass reads everything back again. `metrics`
    counts the pass once its actions are all carried out. `create_refused`: the CreateRefused
    of the pass before, if it ended on one (the status and an Event say it while it lasts)."""
    body = kube.read_model_deployment(namespace, name)
    if body is None:
        return None
    md = ModelDeployment.from_body(body, config.default_image)
    observed = replace(Observed.from_objects(*kube.list_children(namespace, name)),
                       create_refused=create_refused)
    autoscaled = {r.name for r in md.spec.roles() if r.autoscaling is not None}
    if autoscaled:  # the signals of each ready node-0 pod (the planner counts Ready groups)
        leaders = [p for p in observed.pods if p.role in autoscaled and p.node_rank == 0
                   and p.ready and p.live and p.pod_ip and p.owner_uid == md.uid]
        observed = replace(observed, signals=tuple(sorted(kube.read_signals(leaders).items())))
    result = plan(md, observed, datetime.now(UTC), config)
    for action in result.actions:
        logger.info("%s/%s: %s", namespace, name, action.describe())
        try:
            kube.apply(body, action)
        except ApiException as exc:
            if exc.status in REFUSED_STATUSES and isinstance(action, MAKES):
                raise CreateRefused(f"{action.describe()}: the API refused it ({exc.status}): "
                                    f"{_api_message(exc)}"[:MESSAGE_CHARS]) from exc
            raise
    metrics.observe(md, result.actions)
    return result.requeue_after


def _api_message(exc: ApiException) -> str:
    """The message of the Status the API answered with, else its reason."""
    try:
        message = json.loads(exc.body or "")["message"]
    except (ValueError, KeyError, TypeError):
        return str(exc.reason)
    return str(message)
