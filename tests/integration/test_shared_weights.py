"""``cpu.share_weights: mapped`` with real engines: the prefill and decode engines of one host map one copy
of the model's weights from the weight cache, and answer as before.

On test_handback.py's system (handback.yaml: 1 prefill + 1 decode, float32, every prompt P/D, with
``cpu.share_weights: mapped``), which runs on for this module. Each engine core maps
the same weight files (the linear layers, transposed, and the embedding), whose pages the two share
(each counts half of them); the engines' own heap holds no copy; P/D answers equal the prefill engine's
alone, one at a time and several at once (decode batches); the README's question is answered correctly.
The default, ``packed``, is checked on test_handback_bound.py's system (:func:`shared_anonymous`).
"""

from __future__ import annotations

import concurrent.futures
import random
from pathlib import Path

import psutil
import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.engine.weight_share import directory_for
from pdserve.model.cache import cache_root
from pdserve.model.resolve import resolve_model
from tests.integration.conftest import ServeProcess, SystemSlot, engine_processes
from tests.integration.test_handback import chat, handback_system, one_engine
from tests.integration.test_pd_real import complete

pytestmark = pytest.mark.integration

#: The packaged model in float32: its linear layers and embedding (SmolLM2-135M: 0.50 GiB), and a margin.
WEIGHT_BYTES = 0.45 * (1 << 30)


@pytest.fixture(scope="module")
def served(system_slot: SystemSlot) -> ServeProcess:
    return handback_system(system_slot)


def weight_files() -> list[str]:
    """The packaged model's float32 linear-layer files in the weight cache (what ``packed`` packs; a host's
    first float32 start writes them)."""
    args = PDServeArgs()
    model = resolve_model(args.prefill_config.model_loading_config.model_source, cache_dir=args.cache_dir)
    d = Path(directory_for(str(cache_root(args.cache_dir)), str(model)))
    return sorted(p.name for p in d.glob("*.T.float32.*.bin")) if d.is_dir() else []


def shared_anonymous(pid: int) -> int:
    """Bytes of ``pid``'s anonymous memory (the heap included) resident and shared with another process: an
    engine core's packed weights under ``packed``, inherited from the engines' forkserver."""
    out, anon = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            anon = len(head) == 5 or head[5] == "[heap]"
        elif anon and head[0] in ("Shared_Clean:", "Shared_Dirty:"):
            out += int(head[1]) * 1024
    return out


def engine_cores(served: ServeProcess) -> list[int]:
    """The engine core of each engine this system started (the process that holds the model)."""
    cores = []
    for pid in set(engine_processes()) - served.preexisting:
        try:
            cores += [c.pid for c in psutil.Process(pid).children(recursive=True)
                      if "EngineCore" in " ".join(c.cmdline())]
        except psutil.Error:
            continue
    return cores


def weight_mappings(pid: int) -> dict[str, tuple[int, int, int]]:
    """The shared-weights files ``pid`` maps: path -> (size, Rss, Pss) in bytes."""
    out: dict[str, list[int]] = {}
    path = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            path = head[5] if len(head) > 5 and "/shared-weights/" in head[5] else None
            if path is not None:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                out.setdefault(path, [0, 0, 0])[0] += hi - lo
        elif path is not None and head[0] in ("Rss:", "Pss:"):
            out[path][1 if head[0] == "Rss:" else 2] += int(head[1]) * 1024
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def test_both_engines_map_one_copy_of_the_weights(served: ServeProcess):
    cores = engine_cores(served)
    assert len(cores) == 2, f"engine cores of this system: {cores}"
    complete(served.url, [random.Random(1).randrange(200, 40000) for _ in range(300)])  # every layer read once
    maps = [weight_mappings(pid) for pid in cores]
    assert maps[0] and set(maps[0]) == set(maps[1]), "the two engines do not map the same weight files"
    size = sum(v[0] for v in maps[0].values())
    assert size >= WEIGHT_BYTES, f"{size / (1 << 20):.0f} MiB of weights mapped, expected the model's"
    assert any("lm_head" in p or "embed_tokens" in p for p in maps[0]), sorted(maps[0])[:5]
    for m in maps:
        rss, pss = sum(v[1] for v in m.values()), sum(v[2] for v in m.values())
        assert rss >= 0.9 * size, (rss, size)  # resident: the weights were read
        assert pss <= 0.6 * rss, (pss, rss)  # and counted half to each: the same pages


def test_pd_answers_equal_one_engine_one_at_a_time_and_in_batches(served: ServeProcess):
    prefill = served.engine_url("prefill")
    rng = random.Random(31)
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randrange(50, 600))] for _ in range(6)]
    refs = [complete(prefill, p)["choices"][0]["token_ids"] for p in prompts]
    alone = [complete(served.url, p)["choices"][0]["token_ids"] for p in prompts[:2]]
    assert alone == refs[:2], "P/D differs from one engine"
    with concurrent.futures.ThreadPoolExecutor(6) as ex:  # decode computes them in batches
        together = list(ex.map(lambda p: complete(served.url, p)["choices"][0]["token_ids"], prompts))
    wrong = [i for i, (a, b) in enumerate(zip(refs, together)) if a != b]
    assert not wrong, f"answers in batches differ from one engine's for prompts {wrong}"


def test_the_readme_question_is_answered_correctly(served: ServeProcess):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = chat(served.url, messages)
    assert "Paris" in answer, answer
    assert answer == one_engine(served, messages)
