"""Per-phase autoscaling with real engines: a load ramp that only prefill feels scales prefill (and not
decode) up; then one that only decode feels scales decode up while prefill goes back down (and not up
again); then decode goes back down. Streams run through both scale-downs: none may end in an error or short
of its tokens (a stopping replica lets its requests finish, engine/drain.py; a stream it cannot wait for
moves, router/migrate.py).

Replica counts are read from ``/pdserve/status``: an engine replica is listed once its vLLM server is up
and is removed when Ray Serve stops the replica.

The load is sized from the engines' prompt speed as the router measured it, not from constants: one-core
engines differ by 4x and more between hosts (bf16 with AMX vs float32 on AVX2). Clients behave as
clients of an admission-controlled endpoint do: a 429 is retried after its Retry-After.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests import sse
from tests.integration.conftest import ROOT, ServeProcess, SystemSlot, stop_mid_request

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
QUIET_TIMEOUT_S = 180
#: Seconds of prefill (at the measured speed) each prompt of the prefill ramp is sized to.
PROMPT_SECONDS = 1.5
#: Fewest tokens per prompt: more than half of vLLM's CPU batch budget (max_num_batched_tokens 2048), so
#: that one engine step takes one prompt and the others wait where the scaling signal (running + waiting,
#: sampled between steps) sees them. With ~650-token prompts three fit one step, every step cleared the
#: queue, the gauges read 0 and prefill never scaled.
MIN_PROMPT_TOKENS = 1100
#: Tokens of each stream run through a scale-down (a few seconds of decode; greedy, no early stop).
STREAM_TOKENS = 96


@pytest.fixture(scope="module")
def scaled(system_slot: SystemSlot):
    sp = system_slot.own(ROOT / "tests" / "integration" / "autoscale.yaml", engines=4,
                         what="the autoscaling system (up to 2 prefill + 2 decode engines)")
    sp.wait_ready()
    yield sp
    sp.stop()


def readme_example() -> dict:
    """The body of the README's first ``curl`` (the request a newcomer sends first)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("/v1/chat/completions -H 'Content-Type: application/json' -d '")
    body = text[start:].split("-d '", 1)[1].split("'", 1)[0]
    return json.loads(body)


def test_the_readme_example_answers_correctly_in_the_dtype_auto_picks(scaled: ServeProcess):
    """autoscale.yaml leaves the dtype to ``cpu.dtype: auto``, as the embedded default does: on a host where
    bf16 is fast (AVX-512 BF16, AMX) it must still not be chosen for a model it answers wrongly in."""
    body = readme_example()
    assert body["messages"][0]["content"] == "What is the capital of France?"
    r = httpx.post(scaled.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    dtype_line = next((ln for ln in scaled.lines if "CPU engines compute in" in ln), "")
    assert "Paris" in r.json()["choices"][0]["message"]["content"], (r.json(), dtype_line)


def replicas(sp: ServeProcess) -> Counter:
    engines = sp.status()["engines"]
    return Counter(e["role"] for e in engines if e.get("healthy", True))


def watch(sp: ServeProcess, until: Callable[[Counter], bool], timeout_s: float,
          body: Callable[[random.Random], dict] | None = None, concurrency: int = 0, streams: int = 0,
          streamed: list[int] | None = None) -> list[Counter]:
    """Sample the replica counts every second (under load from ``concurrency`` clients sending ``body``, and
    ``streams`` clients streaming one answer after another, each checked whole; their count is appended to
    ``streamed``) until ``until(counts)`` holds; return the samples."""
    stop = threading.Event()
    errors: list[str] = []
    whole: list[int] = []

    @contextmanager
    def answer(c: httpx.Client, req: dict, what: str) -> Iterator[httpx.Response | None]:
        """One streamed completion, open while the block reads it; None when it was refused (a 429 waited
        out as its Retry-After says, any other status counted an error)."""
        with c.stream("POST", sp.url + "/v1/completions", json=req) as r:
            if r.status_code == 429:
                stop.wait(float(r.headers["retry-after"]))
                yield None
            elif r.status_code != 200:
                errors.append(f"{what} {r.status_code}: {r.read()[:200]!r}")
                yield None
            else:
                yield r

    def streamer(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                req = {"model": MODEL, "prompt": [rng.randrange(200, 40000) for _ in range(16)],
                       "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}
                with answer(c, req, "stream") as r:
                    if r is None:
                        continue
                    got = sse.read(r.iter_lines())
                    done, usage, bad = got.done, got.usage, got.error
                    if bad or not done or not usage or usage["completion_tokens"] != STREAM_TOKENS:
                        errors.append(f"stream cut: error {bad}, [DONE] {done}, usage {usage}")
                    else:
                        whole.append(1)

    def client(seed: int) -> None:
        # Streamed, so that a client goes away mid-answer when the phase ends (the router cancels its
        # request): the next phase starts from the load it asks for, not from ten long answers finishing.
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                req = {**body(rng), "stream": True}  # type: ignore[misc]
                with answer(c, req, "request") as r:
                    if r is None:
                        continue
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"error":' in line:
                            errors.append(line[:200])
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    threads += [threading.Thread(target=streamer, args=(100 + i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    samples: list[Counter] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            samples.append(replicas(sp))
            if until(samples[-1]):
                return samples
            if time.monotonic() >= deadline:
                st = sp.status()
                seen = {k: st.get(k) for k in ("decisions", "local_prefill_below_tokens")}
                seen["engines"] = [{k: e.get(k) for k in ("role", "healthy", "streams", "queued_prompts", "tpot_s",
                                                           "prompt_tokens_per_s")} for e in st.get("engines", [])]
                text = httpx.get(sp.url + "/metrics?engines=0", timeout=10).text
                seen["refused"] = [ln for ln in text.splitlines()
                                   if ln.startswith("pdserve_admission_refused_total{") and not ln.endswith(" 0.0")]
                raise AssertionError(f"no change within {timeout_s}s; last counts {samples[-1]}; router: {seen}")
            time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
        if streamed is not None:
            streamed.append(len(whole))
        assert not errors, f"requests failed during the ramp: {errors[:3]}"


def prompt_speed(sp: ServeProcess) -> float:
    """The prefill engine's prompt tokens/s as the router measured it (``pdserve serve`` is ready only
    once it has): from real prompts when there were some, else its calibration prompt (status shows
    admission's derated figure until then)."""
    from pdserve.router.load import CALIBRATION_DERATE

    for e in sp.status()["engines"]:
        if e["role"] == "prefill" and e.get("prompt_tokens_per_s"):
            return float(e.get("measured_prompt_tokens_per_s") or e["prompt_tokens_per_s"] / CALIBRATION_DERATE)
    raise AssertionError("the router has not measured the prefill engine")


def decode_heavy(rng: random.Random) -> dict:
    # Short prompts, long answers: many sequences running on decode, prefill nearly idle.
    return {"model": MODEL, "prompt": [rng.randrange(200, 40000) for _ in range(8)], "max_tokens": 256,
            "ignore_eos": True}


def test_each_role_scales_up_and_down_on_its_own(scaled: ServeProcess):
    assert replicas(scaled) == Counter(prefill=1, decode=1)
    # Prompts of about PROMPT_SECONDS each on this host's prefill engine (within max_model_len 2048); six
    # clients keep several queued (running + waiting well above the target of 1 per replica).
    rate = prompt_speed(scaled)
    n_tokens = int(min(1800, max(MIN_PROMPT_TOKENS, rate * PROMPT_SECONDS)))
    # Scaling up needs upscale_delay_s of sustained queue plus a replica start (~30-60 s of engine start
    # on one core); the same ramp on a slower host has the same queue in prompts, so the bound is about
    # engine start, not prompt speed.
    ramp_timeout_s = 300

    def prefill_heavy(rng: random.Random) -> dict:
        # Long prompts, two new tokens: the work (and the queue) is on prefill.
        return {"model": MODEL, "prompt": [rng.randrange(200, 40000) for _ in range(n_tokens)], "max_tokens": 2}

    up = watch(scaled, lambda c: c["prefill"] == 2, ramp_timeout_s, prefill_heavy, concurrency=6)
    assert max(c["decode"] for c in up) == 1, "decode scaled up under a prefill-only load"

    # Then a load only decode feels, at once: prefill, no longer loaded, scales down while decode scales up
    # (one wait for both transitions instead of two; each is a replica start or a downscale delay).
    prefill_down = []

    def prefill_down_then_decode_up(c: Counter) -> bool:
        if c["prefill"] == 1:
            prefill_down.append(True)
        return bool(prefill_down) and c["decode"] == 2

    streamed: list[int] = []
    both = watch(scaled, prefill_down_then_decode_up, QUIET_TIMEOUT_S + ramp_timeout_s, decode_heavy,
                 concurrency=10, streams=1, streamed=streamed)
    back = next(i for i, c in enumerate(both) if c["prefill"] == 1)
    assert all(c["prefill"] == 1 for c in both[back:]), "prefill scaled up again under a decode-only load"
    # Decode 2 -> 1 with a stream running all along (below decode's target of 4 per replica).
    down = watch(scaled, lambda c: c["decode"] == 1, QUIET_TIMEOUT_S, streams=1, streamed=streamed)
    assert max(c["prefill"] for c in down) == 1
    assert all(streamed), f"streams completed whole in each scale-down: {streamed}"


def test_zz_sigint_mid_request_stops_everything(scaled: ServeProcess):
    """Last in this module: Ctrl-C while an engine is busy stops the app as SIGTERM does (test_pd_real)."""
    stop_mid_request(scaled, signal.SIGINT, MODEL)
