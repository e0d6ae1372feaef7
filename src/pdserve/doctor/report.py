"""Run every check, print a table (or JSON), return the exit code: 0 without a ``fail`` row, else 1."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable
from typing import IO, Any

from pdserve.doctor.checks import HOST_CHECKS, LATE_CHECKS, Check, DoctorContext
from pdserve.doctor.result import STATUSES, CheckResult
from pdserve.doctor.transport import check_nixl
from pdserve.errors import ConfigError

ALL_CHECKS: tuple[Check, ...] = (*HOST_CHECKS, check_nixl, *LATE_CHECKS)


def load_context(file: str | None, *, run_transfer: bool = True) -> tuple[DoctorContext, CheckResult]:
    """The context for ``file`` and the config row; a broken file is a ``fail`` and the defaults apply."""
    from pdserve.config.loader import load_config

    try:
        loaded = load_config(file)
    except ConfigError as e:
        return DoctorContext(config_source=file, run_transfer=run_transfer), CheckResult(
            "config", "fail", str(e).replace("\n", "; "), f"pdserve validate {file}  (the checks below use the defaults)")
    ctx = DoctorContext(args=loaded.args, config_source=file, run_transfer=run_transfer)
    a = loaded.args
    what = (f"{loaded.source}: valid (model {a.model_id}, {a.prefill_config.num_replicas()} prefill + "
            f"{a.decode_config.num_replicas()} decode, nixl {a.nixl.backend})")
    return ctx, CheckResult("config", "ok", what if file else "none given: the embedded default")


def run_checks(ctx: DoctorContext, checks: Iterable[Check] = ALL_CHECKS) -> list[CheckResult]:
    rows: list[CheckResult] = []
    for check in checks:
        try:
            rows.extend(check(ctx))
        except Exception as e:  # noqa: BLE001 - a broken check is reported, the others still run
            name = check.__name__.removeprefix("check_")
            rows.append(CheckResult(name, "fail", f"the check itself failed: {type(e).__name__}: {e}",
                                    "a pdserve doctor bug: please report it with this output"))
    return rows


def exit_code(rows: list[CheckResult]) -> int:
    return 1 if any(r.status == "fail" for r in rows) else 0


def summary(rows: list[CheckResult]) -> dict[str, int]:
    counts = Counter(r.status for r in rows)
    return {s: counts.get(s, 0) for s in STATUSES}


def to_json(rows: list[CheckResult], ctx: DoctorContext) -> dict[str, Any]:
    from pdserve import __version__

    return {"pdserve": __version__, "config": ctx.config_source, "exit_code": exit_code(rows),
            "summary": summary(rows), "checks": [r.to_dict() for r in rows]}


def render_table(rows: list[CheckResult]) -> str:
    width = max(len("CHECK"), *(len(r.name) for r in rows))
    lines = [f"{'CHECK':{width}}  STATUS  DETAIL"]
    for r in rows:
        shown = r.status.upper() if r.status in ("fail", "warn") else r.status
        lines.append(f"{r.name:{width}}  {shown:6}  {r.detail}")
        if r.fix and r.status in ("fail", "warn"):
            lines.append(f"{'':{width}}  {'':6}  fix: {r.fix}")
    counts = summary(rows)
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + f"  -> exit {exit_code(rows)}")
    return "\n".join(lines)


def run_doctor(file: str | None = None, *, as_json: bool = False, run_transfer: bool = True,
               out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    ctx, config_row = load_context(file, run_transfer=run_transfer)
    if not as_json and sys.stderr.isatty():
        print("pdserve doctor: checking this host (the NIXL transfer takes a few seconds)...", file=sys.stderr)
    rows = [config_row, *run_checks(ctx)]
    if as_json:
        print(json.dumps(to_json(rows, ctx), indent=2, default=str), file=out)
    else:
        print(render_table(rows), file=out)
    return exit_code(rows)
