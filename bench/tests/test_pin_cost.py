"""The pin-cost probe's summary: each mode's medians and bidirectional's over plain's."""

from pdserve_bench.pin_cost import percentile, summary


def _run(mode: str, wall: float, kv: float) -> dict:
    return {"mode": mode, "wall_s": wall, "ttft_p50_ms": 1000.0, "e2e_p50_ms": 2000.0, "decode_kv_peak": kv}


def test_the_summary_gives_each_modes_medians_and_their_ratio():
    runs = [_run("plain", 100.0, 0.1), _run("bidirectional", 102.0, 0.5), _run("plain", 104.0, 0.1),
            _run("bidirectional", 106.0, 0.4)]
    got = summary(runs)
    assert got["plain"]["wall_s"] == 102.0 and got["bidirectional"]["wall_s"] == 104.0
    assert got["bidirectional"]["decode_kv_peak"] == 0.45
    assert got["bidirectional_over_plain"]["wall_s"] == round(104 / 102, 3)
    assert got["bidirectional_over_plain"]["decode_kv_peak"] == 4.5
    assert "bidirectional_over_plain" not in summary(runs[:1])


def test_percentiles_are_of_the_sorted_values():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([3.0, 1.0, 2.0], 0.9) == 3.0
