"""The outcome of one doctor check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "skip"]

#: Worst first: the order in which a summary names them.
STATUSES: tuple[Status, ...] = ("fail", "warn", "ok", "skip")


@dataclass
class CheckResult:
    """One row of the report.

    ``fail`` means pdserve will not work (or will silently lose its point, e.g. a KV pull that cannot
    complete); ``warn`` means it works but worse than it could, or differs from what was tested; ``skip``
    means the check does not apply to this host. ``fix`` says what to do, only when there is something to do.
    """

    name: str
    status: Status
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix,
                "data": self.data}
