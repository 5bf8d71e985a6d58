"""shoal's Kubernetes operator: ModelDeployment groups of engine pods that recreate themselves.

    spec.py, observed.py   typed views of what is read back from the API (pure)
    planner.py             (ModelDeployment, observed pods and services, now) -> actions (pure)
    failures.py            why a pod ended -> restart, Failed, or wait (pure)
    rollout.py             which outdated groups may go now (pure)
    conditions.py          phase and conditions of the status (pure)
    builders.py            the objects the operator creates (pure)
    actions.py             what the planner asks for
    kube.py                the only module that talks to the Kubernetes API
    reconcile.py           read back, plan, apply: one pass
    handlers.py            the kopf handlers: a daemon per ModelDeployment, poked by pod events

docs/kubernetes.md describes the resource and the restart rules.
"""
