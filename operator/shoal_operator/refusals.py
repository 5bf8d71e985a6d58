"""What the operator refuses to create for a spec, given its own flags. Pure.

The operator creates pods with its own rights, so a field that would let whoever may create a
ModelDeployment reach further than that is refused here, naming the field: nothing of the
resource is created or changed while a refusal stands (docs/kubernetes.md, "Threat model").

| field                         | refused unless the operator runs with                       |
|-------------------------------|-------------------------------------------------------------|
| `spec.model.volume.hostPath`  | `--allow-host-path` (chart value `operator.allowHostPath`)  |
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal_operator.config import OperatorConfig
from shoal_operator.spec import Spec

HOST_PATH_FIELD = "spec.model.volume.hostPath"


@dataclass(frozen=True)
class Refusal:
    field: str
    reason: str  # the Degraded condition's reason
    message: str


def refusals(spec: Spec, config: OperatorConfig) -> tuple[Refusal, ...]:
    found = []
    if spec.model.volume and "hostPath" in spec.model.volume and not config.allow_host_path:
        found.append(Refusal(
            HOST_PATH_FIELD, "HostPathNotAllowed",
            f"{HOST_PATH_FIELD} is refused: it would mount a folder of the node into the engine "
            "pods, and this operator runs without --allow-host-path (chart value "
            "operator.allowHostPath); use a persistentVolumeClaim"))
    return tuple(found)
