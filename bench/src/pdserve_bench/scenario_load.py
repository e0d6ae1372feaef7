"""What the scenarios that compare pdserve with plain engines share: the prompts their options ask for, one
measured run summarized with its requests, and the warm-up before it."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.plan import Plan
from pdserve_bench.runner import Load, run_load
from pdserve_bench.stats import summarize
from pdserve_bench.workload import Lengths, PromptFactory, build_requests

ONE = Load("concurrency", 1)
#: Requests sent before a system's measured phase: the first ones pay one-time costs.
WARMUP = 3


def prompt_factory(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> PromptFactory:
    """Prompts from the model's tokenizer (:meth:`~pdserve_bench.plan.Plan.tokenizer`: a dry run without the
    prepared model takes a fixed range of token ids), seeded by ``opts["seed"]``."""
    return PromptFactory(plan.tokenizer(args), seed=int(opts.get("seed", 0)))


def build_prompts(args: PDServeArgs, opts: dict[str, Any], plan: Plan, n: int, prompt: int, out: int) -> list[Any]:
    """``n`` requests of ``prompt`` tokens and ``out`` new tokens unless ``--prompt-len`` / ``--output-len``
    (``opts``) say otherwise."""
    return build_requests(prompt_factory(args, opts, plan), n, Lengths.parse(str(opts.get("prompt_len", prompt))),
                          Lengths.parse(str(opts.get("output_len", out))))


def measure(url: str, model: str, reqs: list[Any], load: Load, prefill_url: str | None = None) -> dict[str, Any]:
    """``reqs`` at ``load`` (through ``prefill_url`` first: the bare handoff), summarized with every request's
    row."""
    results, wall = asyncio.run(run_load(url, model, reqs, load, prefill_url=prefill_url))
    s = summarize(results, wall)
    s["results"] = [r.as_dict() for r in results]
    return s


def warm_up(url: str, model: str, reqs: list[Any], prefill_url: str | None = None) -> None:
    # First requests pay one-time costs (NIXL handshake, allocator warm-up); not part of the figure.
    measure(url, model, reqs[:WARMUP], ONE, prefill_url)
