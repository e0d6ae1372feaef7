"""The conversations of ``--scenario multiturn``: seeded, agent-like, sized to the engines' context.

Each conversation has a system prompt of its own (``system_tokens``, about 1,500 tokens), then 8-12 user
turns that read like tool output (20-200 tokens each). The assistant's answers are not part of the
workload: the run appends each real answer to the history before the next turn. Between turns the client
"thinks" (``think_s`` x 0.5-1.5), and conversation ``i`` starts ``i`` x ``think_s`` / conversations after
the first, so the turns do not move in lockstep.

Text is made of whole words that are single tokens of the model's tokenizer (a leading-space word piece,
e.g. ``Ġriver``), so a text of ``n`` words is about ``n`` tokens; without a tokenizer (a dry run, the
tests) a fixed list of made-up words stands in. Token counts here are estimates: the run records the
engines' own ``usage.prompt_tokens``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import ConfigError

#: Tokens a chat template adds around one message (ChatML: ``<|im_start|>role\n`` … ``<|im_end|>\n``), taken
#: generously: the budget must hold, not match.
TEMPLATE_TOKENS = 8
#: Words that open every tool turn (its header), counted in its new tokens.
TOOL_HEADER = "Tool output, step {k}:"
HEADER_TOKENS = 8
#: Room kept free below ``max_model_len`` (estimates drift a little from the tokenizer's counts).
MARGIN = 64
#: The shortest system prompt a conversation may be cut to before the options are refused.
MIN_SYSTEM = 256
_SYLLABLES = ("ka", "lo", "mi", "ser", "tan", "vo", "ru", "pel", "dax", "nor", "qui", "zem", "ba", "fi", "gor")


def fallback_words() -> list[str]:
    """Made-up two-syllable words, for runs without the model's tokenizer (counts are then only nominal)."""
    return sorted({a + b for a in _SYLLABLES for b in _SYLLABLES if a != b})


def tokenizer_words(model_dir: str | None) -> list[str]:
    """Lower-case ASCII words of 3-10 letters that the tokenizer holds as one leading-space piece."""
    if model_dir is None:
        return fallback_words()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    words = {t[1:] for t in tok.get_vocab() if t.startswith(("Ġ", "▁")) and t[1:].isascii()
             and t[1:].isalpha() and t[1:].islower() and 3 <= len(t) - 1 <= 10}
    return sorted(words) or fallback_words()


def span(text: str, default: tuple[int, int]) -> tuple[int, int]:
    """``"10"`` → (10, 10); ``"8-12"`` → (8, 12)."""
    try:
        if not text:
            return default
        lo, _, hi = str(text).partition("-")
        got = (int(lo), int(hi or lo))
    except ValueError:
        raise ConfigError(f"bad range {text!r}: use N or LO-HI") from None
    if got[0] < 1 or got[1] < got[0]:
        raise ConfigError(f"bad range {text!r}: need 1 <= LO <= HI")
    return got


@dataclass
class Turn:
    user: str  # the message (a header and tool-output-like words)
    new_tokens: int  # its estimated tokens: header and words
    think_s: float  # the pause after this turn's answer, before the next turn


@dataclass
class Conversation:
    index: int
    system: str
    system_tokens: int
    start_s: float  # after the first conversation's start
    turns: list[Turn] = field(default_factory=list)

    def budget(self, max_tokens: int) -> int:
        """The most tokens its last prompt plus answer can take: every message, every answer in full."""
        return (self.system_tokens + TEMPLATE_TOKENS + sum(t.new_tokens + TEMPLATE_TOKENS for t in self.turns)
                + len(self.turns) * (max_tokens + TEMPLATE_TOKENS))


@dataclass(frozen=True)
class Shape:
    """What the conversations look like (the scenario's options)."""

    conversations: int = 4
    turns: tuple[int, int] = (8, 12)
    system_tokens: int = 1500
    tool_tokens: tuple[int, int] = (20, 200)
    max_tokens: int = 32
    think_s: float = 1.0
    max_model_len: int = 4096


def _text(rng: random.Random, words: list[str], n: int) -> str:
    """About ``n`` tokens: words, every twelfth ending a sentence (the full stop is a token of its own)."""
    out: list[str] = []
    tokens = 0
    while tokens < n:
        end = len(out) % 12 == 11 and tokens + 2 <= n
        out.append(rng.choice(words) + ("." if end else ""))
        tokens += 2 if end else 1
    return " ".join(out)


def build_conversations(shape: Shape, words: list[str], seed: int = 0) -> list[Conversation]:
    """The same conversations for the same shape, words and seed. A conversation whose longest prompt and
    answer would not fit ``max_model_len`` gets a shorter system prompt (down to :data:`MIN_SYSTEM`; below
    that the shape is refused: fewer turns, shorter tool outputs or a longer context)."""
    if shape.conversations < 1 or shape.max_tokens < 1 or shape.think_s < 0:
        raise ConfigError("multiturn: conversations and max_tokens must be >= 1, think_s >= 0")
    rng = random.Random(seed)
    out = []
    for i in range(shape.conversations):
        turns = []
        for k in range(1, rng.randint(*shape.turns) + 1):
            n = rng.randint(*shape.tool_tokens)
            turns.append(Turn(f"{TOOL_HEADER.format(k=k)} {_text(rng, words, n)}", n + HEADER_TOKENS,
                              round(shape.think_s * rng.uniform(0.5, 1.5), 3)))
        conv = Conversation(i, "", 0, round(i * shape.think_s / shape.conversations, 3), turns)
        room = shape.max_model_len - MARGIN - conv.budget(shape.max_tokens)
        conv.system_tokens = min(shape.system_tokens, room)
        if conv.system_tokens < MIN_SYSTEM:
            raise ConfigError(
                f"multiturn: conversation {i} ({len(turns)} turns) leaves {room} tokens of max_model_len "
                f"{shape.max_model_len} for its system prompt (at least {MIN_SYSTEM}): ask fewer turns, "
                f"shorter tool_tokens or a smaller max_tokens")
        conv.system = (f"You are agent {i}. Use the tools, read their output and answer briefly. Notes: "
                       + _text(rng, words, max(1, conv.system_tokens - 24)))
        out.append(conv)
    return out


def describe(convs: list[Conversation], shape: Shape) -> dict[str, Any]:
    """The workload in numbers, for the plan and the report."""
    turns = [len(c.turns) for c in convs]
    new = [t.new_tokens for c in convs for t in c.turns]
    sys_t = [c.system_tokens for c in convs]
    return {"conversations": len(convs), "turns": sum(turns), "turns_per_conversation": [min(turns), max(turns)],
            "system_tokens": [min(sys_t), max(sys_t)], "new_tokens_per_turn": [min(new), max(new)],
            "max_tokens": shape.max_tokens, "think_s": shape.think_s, "max_model_len": shape.max_model_len,
            "longest_budget_tokens": max(c.budget(shape.max_tokens) for c in convs)}


def probe_prompts(shape: Shape, words: list[str], n: int, seed: int) -> list[list[dict[str, str]]]:
    """``n`` fresh first turns (a system prompt of its full size and one tool output): what an idle engine
    takes for a conversation it has never seen, the basis of the SLO."""
    one = Shape(n, (1, 1), shape.system_tokens, shape.tool_tokens, shape.max_tokens, 0.0, shape.max_model_len)
    return [[{"role": "system", "content": c.system}, {"role": "user", "content": c.turns[0].user}]
            for c in build_conversations(one, words, seed + 10_000)]
