"""Seeded synthetic prompts built from the model's own tokenizer, with exact token lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pdserve.errors import ConfigError


@dataclass(frozen=True)
class Lengths:
    """A length distribution: ``128`` (fixed), ``uniform:64-512`` or ``normal:256,64``."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        try:
            if text.isdigit():
                return cls("fixed", int(text))
            kind, rest = text.split(":", 1)
            if kind == "uniform":
                lo, hi = rest.split("-")
                return cls("uniform", int(lo), int(hi))
            if kind == "normal":
                mu, sd = rest.split(",")
                return cls("normal", float(mu), float(sd))
        except ValueError:
            pass
        raise ConfigError(f"bad length distribution {text!r}: use N, uniform:LO-HI or normal:MEAN,SD")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, int(rng.gauss(self.a, self.b)))


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


class PromptFactory:
    """Builds prompts from ordinary word-piece tokens of the model's vocabulary (no special tokens)."""

    def __init__(self, model_dir: str | None, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab_ids = self._vocab(model_dir)

    def _vocab(self, model_dir: str | None) -> list[int]:
        if model_dir is None:
            return list(range(1000, 30000))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        special = set(tok.all_special_ids)
        ids = [i for t, i in tok.get_vocab().items() if i not in special and t.isascii() and t.strip("Ġ▁").isalpha()]
        return sorted(ids)

    def ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab_ids) for _ in range(n)]


def build_requests(
    factory: PromptFactory, n: int, prompt_len: Lengths, output_len: Lengths, shared_prefix: int = 0
) -> list[BenchRequest]:
    prefix = factory.ids(shared_prefix) if shared_prefix else []
    out = []
    for _ in range(n):
        plen = max(1, prompt_len.sample(factory.rng) - len(prefix))
        out.append(BenchRequest(prefix + factory.ids(plen), max(1, output_len.sample(factory.rng))))
    return out


def request_body(model: str, req: BenchRequest, *, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
