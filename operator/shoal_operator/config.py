"""What the operator itself was told (flags of `python -m shoal_operator`) that shapes its plans."""

from __future__ import annotations

from dataclasses import dataclass

from shoal import __version__

DEFAULT_IMAGE = f"shoal:{__version__}"


@dataclass(frozen=True)
class OperatorConfig:
    default_image: str = DEFAULT_IMAGE  # for a ModelDeployment without spec.image
    cluster_domain: str = "cluster.local"
    # a ModelDeployment's hostPath model volume mounts a folder of the node into a pod that the
    # operator creates with its own rights: refused unless the operator is told otherwise
    allow_host_path: bool = False
    autoscaling_interval_s: float = 15.0  # how often an autoscaled role's signals are read
