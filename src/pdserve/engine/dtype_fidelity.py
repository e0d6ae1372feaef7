"""Is bfloat16 faithful to the model? Measured once per host, torch build and model, cached.

bf16 is fast on CPUs with AVX-512 BF16 or AMX (:mod:`pdserve.engine.cpu_host` times it), but speed says
nothing about the answers. Small models are sensitive: the packaged SmolLM2-135M in bf16 answers "What is
the capital of France?" with "L'Étoile, la Marseillaise, …" on an AMX host where float32 says Paris, and
16 short greedy chat answers of 32 tokens agreed in only 10 of 16. So ``cpu.dtype: auto`` takes bf16 only
where it is faster **and** faithful: this probe runs the model over a fixed text (prose, code, numbers,
a chat turn; a few hundred tokens) once in float32 and once in bfloat16 and counts the positions where
both predict the same next token (top-1 agreement).

The threshold, :data:`MIN_AGREEMENT` = 99 %: a next token flipped once in a hundred leaves a 32-token
greedy answer unchanged about 72 % of the time (0.99^32) and one flip changes everything after it.
The packaged model measures about 98 % (7 flips in 360 tokens), so it runs in float32 on every host.

The probe loads the model twice in a subprocess (``python -m pdserve.engine.dtype_fidelity DIR``), so
the caller never imports torch. Models whose weights exceed :data:`MAX_WEIGHT_BYTES` are not probed
(two copies would not fit a laptop); nor are models that are not on this host (a hub id that the engines
download). Then the choice falls back to speed alone and says so.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.engine.cpu_host import (
    CpuProbeError,
    host_dir,
    probe_key,
    read_json,
    run_probe_process,
    write_json,
)

#: Top-1 next-token agreement of bf16 with float32 at or above which bf16 counts as faithful.
MIN_AGREEMENT = 0.99
#: Tokens of :data:`TEXT` the probe runs (the text is a little longer for every tokenizer).
MAX_TOKENS = 360
#: Weights (safetensors on disk) above which the probe is skipped.
MAX_WEIGHT_BYTES = 3 * 1024**3
PROBE_TIMEOUT_S = 300
FIDELITY_FILE = "dtype-fidelity.json"

#: Varied text with a chat turn in the model's own template markers where it has them (the tokenizer's
#: chat template renders the first part).
CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."}]
TEXT = """\
The river Nile flows north through eleven countries before it reaches the Mediterranean Sea. For \
thousands of years its yearly flood carried silt onto the fields of Egypt, and the calendar of the \
farmers followed the water.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
In 1969, Apollo 11 landed on the Moon; Neil Armstrong and Buzz Aldrin walked on the surface while \
Michael Collins stayed in orbit. The mission lasted eight days, three hours and eighteen minutes.
To bake bread, mix 500 g of flour, 350 ml of water, 10 g of salt and 5 g of yeast. Knead for ten \
minutes, let it rise for an hour, shape the loaf, and bake at 230 degrees Celsius for thirty-five minutes.
Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide and water and \
release oxygen, storing the energy in sugars such as glucose.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. \
Water boils at 100 degrees Celsius at sea level, and freezes at 0.
Question: How many legs does a spider have? Answer: A spider has eight legs. Question: What is 12 \
times 12? Answer: 144. Question: Who wrote Romeo and Juliet? Answer: William Shakespeare.
"""


@dataclass
class FidelityProbe:
    """bf16's top-1 next-token agreement with float32 over the probe text, for one model."""

    model: str
    tokens: int
    disagreements: int
    agreement: float = 0.0
    torch_version: str = ""
    measured_at: str = ""

    def __post_init__(self) -> None:
        self.agreement = round(1 - self.disagreements / self.tokens, 4) if self.tokens > 0 else 0.0

    @property
    def faithful(self) -> bool:
        return self.agreement >= MIN_AGREEMENT

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FidelityProbe:
        names = {"model", "tokens", "disagreements", "torch_version", "measured_at"}
        p = cls(**{k: v for k, v in d.items() if k in names})
        if p.tokens <= 0 or not 0 <= p.disagreements <= p.tokens:
            raise ValueError(f"impossible counts: {d}")
        return p


def sentence(p: FidelityProbe) -> str:
    """``bf16 agrees with float32 on 98.1 % of next tokens of this model (7 of 362 differ; needs 99 %)``."""
    return (f"bf16 agrees with float32 on {100 * p.agreement:.1f} % of next tokens of this model "
            f"({p.disagreements} of {p.tokens} differ; bf16 needs {100 * MIN_AGREEMENT:.0f} %)")


def weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def model_key(model_dir: Path) -> str:
    """The model a cached probe is valid for: its directory and its weight files' sizes and times."""
    files = sorted(model_dir.glob("*.safetensors"))
    return str(model_dir) + "|" + ",".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files)


def local_model_dir(source: str | None, cache_dir: str | None) -> Path | None:
    """The model's directory on this host when it is there already (never prepares or downloads)."""
    from pdserve.config.schema import EMBEDDED_MODEL_SOURCE
    from pdserve.model.embedded import embedded_model_dir, is_prepared

    if not source or source == EMBEDDED_MODEL_SOURCE:
        d = embedded_model_dir(cache_dir)
        return d if is_prepared(d) else None
    p = Path(source).expanduser()
    return p.resolve() if (p / "config.json").exists() else _hub_snapshot(source, cache_dir)


def _hub_snapshot(repo_id: str, cache_dir: str | None) -> Path | None:
    """A hub model's snapshot directory in the engines' hub cache, once it was fetched there (``pdserve
    serve`` on one host fetches it before it decides the dtype); None when it is not (no network asked)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        from pdserve.model.cache import hub_cache

        got = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache(cache_dir))
    except Exception:  # noqa: BLE001 - not a hub id (a path that is not there), or no hub client
        return None
    return Path(got).parent if isinstance(got, str) else None


def probe_fidelity(model_dir: Path, cache_dir: str | os.PathLike[str] | None = None, *,
                   refresh: bool = False) -> FidelityProbe:
    """This model's fidelity probe on this host: from the cache when one matches, else measured now.

    Raises :class:`CpuProbeError` when it cannot be measured (too big, no weights, the probe failed)."""
    if not any(model_dir.glob("*.safetensors")):
        raise CpuProbeError(f"no safetensors weights in {model_dir}")
    if (size := weight_bytes(model_dir)) > MAX_WEIGHT_BYTES:
        raise CpuProbeError(f"the model's weights ({size / 1024**3:.1f} GiB) are over the probe's "
                            f"{MAX_WEIGHT_BYTES / 1024**3:.0f} GiB")
    key = probe_key() + "|" + model_key(model_dir)
    path = host_dir(cache_dir) / FIDELITY_FILE
    entries = read_json(path).get("probes", {}) if path.exists() else {}
    entries = entries if isinstance(entries, dict) else {}
    if not refresh and key in entries:
        try:
            return FidelityProbe.from_dict(entries[key])
        except (TypeError, ValueError):
            pass
    probe = _run(model_dir)
    entries[key] = asdict(probe)
    write_json(path, {"format": 1, "probes": entries})
    return probe


def _run(model_dir: Path) -> FidelityProbe:
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    return run_probe_process(["pdserve.engine.dtype_fidelity", str(model_dir)], "bf16 fidelity probe",
                             FidelityProbe.from_dict, env=env, timeout_s=PROBE_TIMEOUT_S)


def probe_ids(tokenizer: Any) -> list[int]:
    """The probe's token ids: the chat turn in the model's template (when it has one), then :data:`TEXT`."""
    ids: list[int] = []
    if getattr(tokenizer, "chat_template", None):
        try:
            chat = tokenizer.apply_chat_template(CHAT, tokenize=False)
            ids = list(tokenizer(chat, add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001 - a template that wants other roles: the text alone still measures
            ids = []
    ids += tokenizer(TEXT, add_special_tokens=not ids)["input_ids"]
    return ids[:MAX_TOKENS]


def measure(model_dir: str) -> FidelityProbe:
    """Run the model over the probe text in float32 and bf16 here (imports torch: the subprocess's side)."""
    from datetime import datetime, timezone

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([probe_ids(tok)])
    top: dict[torch.dtype, torch.Tensor] = {}
    with torch.inference_mode():
        for dt in (torch.float32, torch.bfloat16):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
            top[dt] = model(ids).logits[0].float().argmax(-1)
            del model
    differ = int((top[torch.float32] != top[torch.bfloat16]).sum())
    return FidelityProbe(model=model_dir, tokens=int(ids.shape[1]), disagreements=differ,
                         torch_version=str(torch.__version__),
                         measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


if __name__ == "__main__":
    print(json.dumps(asdict(measure(sys.argv[1]))), flush=True)
