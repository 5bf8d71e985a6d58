"""The kopf handlers, kept thin: one daemon per ModelDeployment runs reconcile passes (each reads
everything back, so a pass is the same whenever and however often it runs); events about its pods
and about itself only wake the daemon early. With leader election (`memo.leadership`), every
replica runs the daemons, and only the leader's make passes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import urllib3
from kubernetes.client import ApiException

from shoal_operator import names
from shoal_operator.election import RETRY_PERIOD_S
from shoal_operator.leadership import Leadership
from shoal_operator.reconcile import CreateRefused, reconcile

RESYNC_S = 10.0  # a pass at least this often, events or not
RETRY_S = 2.0  # after the API refused or failed an action
REFUSED_RETRY_S = 10.0  # after it refused an object the pass creates (CreateRefused)
CONFLICT_RETRY_S = 0.2  # the ModelDeployment changed under the pass: plan again at once
MIN_PASS_INTERVAL_S = 0.1
STANDBY_POLL_S = 0.5  # a standby's daemons look this often whether their replica leads now
FINALIZER = "shoal.dev/operator"  # kopf's, so it can stop a daemon before its resource goes

logger = logging.getLogger(__name__)


def next_pass_in(requeue_after: float | None) -> float:
    """Seconds to the next pass: the plan's deadline, but at least every RESYNC_S."""
    if requeue_after is None:
        return RESYNC_S
    return min(max(requeue_after, MIN_PASS_INTERVAL_S), RESYNC_S)


class Wakeups:
    """One asyncio.Event per ModelDeployment: set by events, awaited by its daemon."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def _event(self, namespace: str, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def poke(self, namespace: str, name: str) -> None:
        self._event(namespace, name).set()

    async def sleep(self, namespace: str, name: str, seconds: float,
                    stopped: kopf.DaemonStopped) -> None:
        """Until `seconds` pass, something pokes this ModelDeployment, or its daemon is asked
        to stop."""
        event = self._event(namespace, name)
        waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stopped.wait())}
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        event.clear()

    def forget(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING
    # No watch on CRDs and namespaces (the CRD comes with the chart, the namespaces are given):
    # the chart's RBAC then needs no cluster-scoped permission and kopf logs no 403s.
    settings.scanning.disabled = True
    if memo.leadership is not None:
        memo.election = asyncio.create_task(_keep_leadership(memo.leadership))


async def _keep_leadership(leadership: Leadership) -> None:
    while True:
        try:
            await asyncio.to_thread(leadership.try_once)
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            logger.warning("leader election: %s", exc)
        await asyncio.sleep(RETRY_PERIOD_S)


@kopf.on.cleanup()
async def stop_leading(memo: kopf.Memo, **_: Any) -> None:
    if memo.leadership is not None:
        memo.election.cancel()
        await asyncio.to_thread(memo.leadership.release)


@kopf.daemon(names.GROUP, names.VERSION, names.PLURAL, cancellation_timeout=10.0,
             backoff=RETRY_S)
async def keep_model_deployment(namespace: str | None, name: str, memo: kopf.Memo,
                                stopped: kopf.DaemonStopped, **_: Any) -> None:
    assert namespace is not None  # a namespaced resource
    refused = ""  # the CreateRefused of the last pass, for the next one to report
    try:
        while not stopped:
            if memo.leadership is not None and not memo.leadership.leading:
                await memo.wakeups.sleep(namespace, name, STANDBY_POLL_S, stopped)
                continue
            try:
                delay = await asyncio.to_thread(reconcile, memo.kube, namespace, name,
                                                memo.config, memo.metrics, refused)
                refused = ""
            except CreateRefused as exc:
                logger.warning("%s/%s: %s; retrying", namespace, name, exc)
                refused, delay = str(exc), REFUSED_RETRY_S
            except ApiException as exc:
                logger.info("%s/%s: pass stopped by the API (%s %s); retrying", namespace, name,
                            exc.status, exc.reason)
                delay = CONFLICT_RETRY_S if exc.status == 409 else RETRY_S
            except urllib3.exceptions.HTTPError as exc:
                logger.warning("%s/%s: API unreachable (%s); retrying", namespace, name, exc)
                delay = RETRY_S
            await memo.wakeups.sleep(namespace, name, next_pass_in(delay), stopped)
    finally:
        memo.wakeups.forget(namespace, name)


@kopf.on.event("", "v1", "pods", labels={names.MANAGED_BY: names.OPERATOR})
async def pod_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo,
                      **_: Any) -> None:
    owner = labels.get(names.INSTANCE)
    if owner and namespace:
        memo.wakeups.poke(namespace, owner)


@kopf.on.event(names.GROUP, names.VERSION, names.PLURAL)
async def model_deployment_changed(namespace: str | None, name: str, memo: kopf.Memo,
                                   **_: Any) -> None:
    if namespace:
        memo.wakeups.poke(namespace, name)
