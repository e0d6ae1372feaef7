"""Is P/D in effect? The share of recent requests whose prompt was computed on prefill and pulled by decode.

A P/D deployment can quietly run colocated: prefill down or busy, short prompts under the conditional
threshold, prefill answers without usable KV params, leases lost. Each such request still succeeds, so
nothing fails loudly; this window of the router's last decisions says how much of the traffic really went
P/D, and why the rest did not. The decode engines' own counters (prompt tokens by source) confirm the pull:
``external_kv_transfer`` tokens are KV that crossed NIXL, ``local_compute`` tokens were computed on decode.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

#: Decisions the share is taken over.
WINDOW = 200
#: Below this share of P/D among recent requests (with enough of them), status warns.
WARN_BELOW = 0.5
WARN_MIN_REQUESTS = 20


class PdEffect:
    def __init__(self, window: int = WINDOW) -> None:
        self._recent: deque[tuple[str, str]] = deque(maxlen=window)

    def record(self, decision: str, reason: str) -> None:
        self._recent.append((decision, reason))

    def share(self) -> float | None:
        if not self._recent:
            return None
        return sum(1 for d, _ in self._recent if d == "pd") / len(self._recent)

    def summary(self, pulled_tokens: float | None = None, local_tokens: float | None = None) -> dict[str, Any]:
        """The window's figures, with the decode engines' prompt-token counters when given."""
        local = Counter(reason for d, reason in self._recent if d != "pd")
        share = self.share()
        out: dict[str, Any] = {"recent_requests": len(self._recent), "pd_share": share,
                               "local_reasons": dict(local.most_common())}
        if pulled_tokens is not None and local_tokens is not None and pulled_tokens + local_tokens > 0:
            out["decode_prompt_tokens_pulled_share"] = pulled_tokens / (pulled_tokens + local_tokens)
        if share is not None and len(self._recent) >= WARN_MIN_REQUESTS and share < WARN_BELOW:
            why = ", ".join(f"{r} ({n})" for r, n in local.most_common())
            out["warning"] = (f"only {share:.0%} of the last {len(self._recent)} requests ran P/D; the rest ran on "
                              f"decode alone: {why}")
        return out


def decode_token_sources(text: str) -> tuple[float, float]:
    """(pulled, computed) prompt tokens of decode engines, from a merged engine exposition with
    ``pdserve_role`` labels (``vllm:prompt_tokens_by_source_total``)."""
    from prometheus_client.parser import text_string_to_metric_families

    pulled = local = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name != "vllm:prompt_tokens_by_source_total" or s.labels.get("pdserve_role") != "decode":
                continue
            if s.labels.get("source") == "external_kv_transfer":
                pulled += s.value
            elif s.labels.get("source") == "local_compute":
                local += s.value
    return pulled, local
