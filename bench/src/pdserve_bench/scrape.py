"""The router's Prometheus exposition as numbers a scenario can subtract: what changed during a phase.

``scrape(url)`` reads ``/metrics`` once (the router's series and, with ``engines=True``, the engines'
``vllm:*`` series relabelled by ``pdserve_role``); :func:`delta` is how much each labelled series grew
between two scrapes; :func:`mean_ms` turns a histogram's ``_sum``/``_count`` growth into a mean per label.
"""

from __future__ import annotations

import urllib.request

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, *, engines: bool = False, timeout_s: float = 10.0) -> Samples:
    """Every sample of ``url``'s ``/metrics``, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + ("/metrics" if engines else "/metrics?engines=0"), timeout=timeout_s) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """How much series ``name`` grew from ``before`` to ``after``, summed by the value of ``label``
    (``"decision,reason"``: both, joined by a colon). Series that did not move are left out."""
    got: dict[str, float] = {}
    for (n, labels), v in after.items():
        if n != name:
            continue
        d = dict(labels)
        key = f"{d.get('decision')}:{d.get('reason')}" if label == "decision,reason" else d.get(label, "")
        diff = v - before.get((n, labels), 0.0)
        if diff:
            got[key] = got.get(key, 0.0) + diff
    return got


def add(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """``total`` with ``more`` added label by label (for deltas gathered over several stretches)."""
    for k, v in more.items():
        total[k] = total.get(k, 0.0) + v
    return total


def mean_ms(sums: dict[str, float], counts: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per label, the mean of a histogram in milliseconds and how many observations it is of."""
    return {k: {"mean_ms": round(1000.0 * sums.get(k, 0.0) / n, 1), "n": int(n)}
            for k, n in sorted(counts.items()) if n > 0}


def values(samples: Samples, name: str, label: str) -> dict[str, float]:
    """The current value of series ``name`` by ``label``."""
    return {dict(labels).get(label, ""): v for (n, labels), v in samples.items() if n == name}
