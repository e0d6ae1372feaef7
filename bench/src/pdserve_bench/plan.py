"""What a scenario is about to do, recorded while it builds it: ``pdserve bench --scenario NAME --dry-run``.

A scenario builds its workload (the requests, from the model's tokenizer), the systems it compares (the
engine command lines, the ``pdserve serve`` configs, the helper processes) and its phases (which load on
which system), records each in its :class:`Plan`, and only then starts the first system. In a dry run it
returns :meth:`Plan.as_dict` at that point instead: everything has been imported, built and checked,
nothing has been started, and the model is neither prepared nor downloaded (prompts then come from a fixed
range of token ids, which the plan says).
"""

from __future__ import annotations

import importlib.util
import shutil
from typing import Any, TypeVar

T = TypeVar("T")


def describe_requests(reqs: list[Any]) -> dict[str, Any]:
    """Count and length ranges of a list of :class:`~pdserve_bench.workload.BenchRequest`."""
    if not reqs:
        return {"requests": 0}
    plens = [len(r.prompt_ids) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    return {"requests": len(reqs),
            "prompt_tokens": {"min": min(plens), "mean": round(sum(plens) / len(plens), 1),
                              "max": max(plens)},
            "max_tokens": {"min": min(outs), "max": max(outs)}}


def _label(load: Any) -> Any:
    label = getattr(load, "label", None)
    return label() if callable(label) else load


class Plan:
    """The record of one scenario's workload, systems and phases, in the order they will be used."""

    def __init__(self, scenario: str, *, dry_run: bool = False) -> None:
        self.scenario = scenario
        self.dry_run = dry_run
        self.settings: dict[str, Any] = {}
        self.workloads: dict[str, dict[str, Any]] = {}
        self.systems: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.requires: dict[str, bool] = {}

    def set(self, **settings: Any) -> None:
        """The scenario's settings after defaults and ``--opt`` values."""
        self.settings.update(settings)

    def workload(self, name: str, reqs: list[Any] | None = None, **shape: Any) -> Any:
        """Records a workload (summarised, not every token id) and returns ``reqs`` for the run to use."""
        entry = dict(describe_requests(reqs)) if reqs is not None else {}
        entry.update(shape)
        self.workloads[name] = entry
        return reqs

    def system(self, name: str, system: T, **detail: Any) -> T:
        """Records a system that will be started (anything with ``spec()``, or a dict describing it) and
        returns it unchanged."""
        spec = system if isinstance(system, dict) else system.spec()  # type: ignore[attr-defined]
        self.systems.append({"name": name, **spec, **detail})
        return system

    def phase(self, name: str, *, system: str | None, load: Any = None, workload: str | None = None,
              **detail: Any) -> None:
        if system is not None and system not in {s["name"] for s in self.systems}:
            raise ValueError(f"phase {name!r} names system {system!r}, which the plan does not have")
        if workload is not None and workload not in self.workloads:
            raise ValueError(f"phase {name!r} names workload {workload!r}, which the plan does not have")
        entry: dict[str, Any] = {"name": name, "system": system}
        if load is not None:
            entry["load"] = _label(load)
        if workload is not None:
            entry["workload"] = workload
        entry.update(detail)
        self.phases.append(entry)

    def require(self, *modules: str, executables: tuple[str, ...] = ()) -> dict[str, bool]:
        """Whether modules used in other processes (engines, ``vllm bench``, NIXL) and executables are
        installed: found, not imported (importing vLLM takes seconds)."""
        got = {m: importlib.util.find_spec(m) is not None for m in modules}
        got.update({e: shutil.which(e) is not None for e in executables})
        self.requires.update(got)
        return got

    def tokenizer(self, args: Any) -> str | None:
        """The model directory prompts are built from. A real run prepares the model (the packaged one is
        converted on first use); a dry run takes it only when it is already there."""
        from pdserve_bench.systems import model_path, model_ready

        if not self.dry_run:
            from pdserve.model.resolve import resolve_model

            source = args.prefill_config.model_loading_config.model_source
            return resolve_model(source, cache_dir=args.cache_dir)
        path, ready = model_path(args), model_ready(args)
        self.settings["prompts_from"] = (f"the tokenizer in {path}" if ready
                                         else f"a fixed range of token ids ({path} is not prepared yet)")
        return path if ready else None

    def as_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "settings": dict(self.settings), "workloads": dict(self.workloads),
                "systems": list(self.systems), "phases": list(self.phases), "requires": dict(self.requires)}
