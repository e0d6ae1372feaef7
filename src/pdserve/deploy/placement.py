"""How engine replicas map onto Ray worker pods, and those onto GPU nodes.

Each role has its own worker group; its pods advertise a custom Ray resource (``pdserve_prefill`` or
``pdserve_decode``) and the role's replicas ask for one unit of it, so a prefill engine never lands on a
decode pod and the other way round. A pod holds as many engines as its GPUs allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pdserve.config.resources import gpus_per_engine
from pdserve.errors import ConfigError

if TYPE_CHECKING:
    from pdserve.config.schema import LLMConfig, PDServeArgs

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


def role_resource(role: Role) -> str:
    """The custom Ray resource that pins one role's replicas to its worker group."""
    return f"pdserve_{role}"


@dataclass(frozen=True)
class GroupSize:
    """Worker pods of one role: at start, fewest and most (min < max when the role autoscales)."""

    replicas: int
    min_replicas: int
    max_replicas: int
    engines_per_pod: int

    @property
    def autoscales(self) -> bool:
        return self.min_replicas != self.max_replicas


def group_size(role: Role, args: PDServeArgs) -> GroupSize:
    cfg: LLMConfig = args.prefill_config if role == "prefill" else args.decode_config
    gpus = (args.kubernetes.prefill if role == "prefill" else args.kubernetes.decode).gpus
    need = gpus_per_engine(cfg)
    if gpus < need:
        raise ConfigError(
            f"kubernetes.{role}.gpus is {gpus}, but one {role} engine needs {need} "
            "(tensor_parallel_size x pipeline_parallel_size)"
        )
    per_pod = gpus // need
    dc = cfg.deployment_config
    if dc.num_replicas == "auto":
        raise ConfigError(
            f"{role}_config.deployment_config.num_replicas: 'auto' has no upper bound to size the {role} "
            "worker group; set autoscaling_config with min_replicas and max_replicas"
        )
    if dc.autoscaling_config is not None:
        a = dc.autoscaling_config
        start = a.initial_replicas if a.initial_replicas is not None else a.min_replicas
        lo, hi = a.min_replicas, a.max_replicas
    else:
        start = lo = hi = dc.num_replicas if isinstance(dc.num_replicas, int) else 1

    def pods(n: int) -> int:
        return math.ceil(n / per_pod)

    return GroupSize(replicas=pods(start), min_replicas=pods(lo), max_replicas=pods(hi), engines_per_pod=per_pod)
