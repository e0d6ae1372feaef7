"""Measuring a new engine before admission relies on it: its prompt speed, and a decode engine's time per
output token with one stream.

The health probe (:meth:`Calibrator.check`) starts a calibration the first time an engine answers; admission
goes on without the engine's speed (one prompt at a time per engine) until it is known, and real prompts
keep teaching it afterwards (router/load.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from pdserve.config.schema import RouterConfig
from pdserve.errors import UpstreamError, UpstreamTimeout
from pdserve.router.endpoint import Endpoint
from pdserve.router.engine_client import EngineClient, usage

log = logging.getLogger(__name__)

#: Prompt tokens of the calibration request a new engine gets (fewer where its context is shorter), and how
#: often it is tried; a prompt the engine refuses (400: e.g. a model whose own context is shorter than the
#: router knows) is halved for the next try, which is not counted, down to :data:`CALIBRATION_MIN_TOKENS`.
CALIBRATION_TOKENS = 512
CALIBRATION_MIN_TOKENS = 32
CALIBRATION_TRIES = 3
CALIBRATION_OUTPUT_TOKENS = 33


class Calibrator:
    def __init__(self, client: EngineClient, cfg: RouterConfig, model_id: str | None = None,
                 on_calibrated: Callable[[Endpoint, float], None] | None = None,
                 max_model_len: int | None = None) -> None:
        """``max_model_len``: the engines' context where the router knows it: the calibration prompt and its
        one output token fit in it."""
        self.client = client
        self.cfg = cfg
        self.model_id = model_id
        self.on_calibrated = on_calibrated
        self.tokens = CALIBRATION_TOKENS
        if max_model_len:
            self.tokens = max(CALIBRATION_MIN_TOKENS, min(CALIBRATION_TOKENS, max_model_len - 1))
        self._running: dict[str, asyncio.Task[None]] = {}
        self._tokens: dict[str, int] = {}  # an engine's prompt size after a refused try

    async def check(self, ep: Endpoint) -> bool:
        """Health probe; a healthy engine whose speed is not known yet is also calibrated (in the background)."""
        ok = await self.client.healthy(ep)
        if (ok and ep.load.calibrated_rate is None and ep.key not in self._running
                and ep.load.calibration_failures < CALIBRATION_TRIES):
            task = asyncio.get_running_loop().create_task(self.calibrate(ep))
            self._running[ep.key] = task
            task.add_done_callback(lambda _t, k=ep.key: self._running.pop(k, None))
        return ok

    async def calibrate(self, ep: Endpoint, tokens: int | None = None) -> float | None:
        """Measure a new engine's prompt speed with one prompt of ``tokens`` random token ids (random, so no
        prefix cache answers it) and one output token, before admission relies on it. A first prompt of
        the same length warms the engine and is not timed: an engine's first prompts pay one-time costs
        (kernels built for new shapes, allocator growth), and a first measurement that included them read
        6 tokens/s where the engine computed ~1,000, and admission refused long prompts until real ones
        had measured it again. Returns prompt tokens/s, or None when the engine did not answer."""
        tokens = tokens or self._tokens.get(ep.key, self.tokens)
        prompt = [random.randrange(100, 1000) for _ in range(tokens)]
        try:
            status, raw, took = await self._probe(ep, [random.randrange(1000, 2000) for _ in range(tokens)], 1,
                                                  self.cfg.prefill_timeout_s)
            if status == 200:  # (a refused warm-up is the try's answer)
                status, raw, took = await self._probe(ep, prompt, 1, self.cfg.prefill_timeout_s)
        except (UpstreamError, UpstreamTimeout) as e:
            ep.load.calibration_failed()
            log.warning("calibrating %s engine at %s failed: %s", ep.role, ep.url, e)
            return None
        if status != 200:
            # E.g. a context shorter than the prompt: the next try is shorter; after a few, admission goes on
            # without a speed (one prompt at a time per engine) until real prompts have measured it.
            if status == 400 and tokens > CALIBRATION_MIN_TOKENS:
                self._tokens[ep.key] = max(CALIBRATION_MIN_TOKENS, tokens // 2)  # (not counted as a try)
            else:
                ep.load.calibration_failed()
            log.warning("calibrating %s engine at %s: it answered %d: %s", ep.role, ep.url, status, raw[:200])
            return None
        n = usage(raw).get("prompt_tokens") or tokens
        rate = n / max(took, 1e-6)
        tpot = await self._tpot(ep) if ep.role == "decode" and ep.load.tpot_single is None else None
        ep.load.calibrated(rate, tpot)
        log.info("%s engine at %s computes %.0f prompt tokens/s (%d tokens in %.2fs)", ep.role, ep.url, rate,
                 n, took)
        if self.on_calibrated is not None:
            self.on_calibrated(ep, rate)
        return rate

    async def _tpot(self, ep: Endpoint, out: int = CALIBRATION_OUTPUT_TOKENS) -> float | None:
        """A decode engine's time per output token with one stream: the idle figure admission compares a
        crowded engine with. Two requests, 1 and ``out`` tokens, so the prompt's cost cancels."""
        prompt = [random.randrange(100, 1000) for _ in range(16)]
        took: list[float] = []
        for n in (1, out):
            try:
                status, _, secs = await self._probe(ep, prompt, n, self.cfg.decode_timeout_s)
            except (UpstreamError, UpstreamTimeout):
                return None
            if status != 200:
                return None
            took.append(secs)
        return max(took[1] - took[0], 1e-4) / (out - 1)

    async def _probe(self, ep: Endpoint, prompt: list[int], max_tokens: int, timeout_s: float
                     ) -> tuple[int, bytes, float]:
        """One calibration request straight to an engine: (status, body, seconds it took)."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        if self.model_id:
            body["model"] = self.model_id
        t = time.perf_counter()
        status, raw, _ = await self.client.post(ep, "completions", body, f"pdserve-calibrate-{ep.engine_id}",
                                                timeout_s)
        return status, raw, time.perf_counter() - t
