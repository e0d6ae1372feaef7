"""The block-size probe's summary (pdserve_bench/block_probe.py); the engines it starts run only by hand."""

from __future__ import annotations

import pytest

from pdserve_bench.block_probe import main, summarize


def test_medians_over_both_runs_of_a_size_and_ratios_to_the_first_size():
    runs = [(128, {"fresh_s": [6.0, 7.0], "follow_up_s": [2.0, 2.4], "tpot_ms": [80.0, 90.0]}),
            (32, {"fresh_s": [7.5, 7.7], "follow_up_s": [1.8, 1.6], "tpot_ms": [84.0, 86.0]}),
            (128, {"fresh_s": [6.5], "follow_up_s": [2.2], "tpot_ms": [85.0]}),
            (32, {"fresh_s": [7.6], "follow_up_s": [1.7], "tpot_ms": [85.0]})]
    got = summarize(runs)
    assert list(got) == ["128", "32"]
    assert got["128"]["fresh_s"] == 6.5 and got["128"]["fresh_s_ratio"] == 1.0
    assert got["32"]["fresh_s"] == 7.6 and got["32"]["fresh_s_ratio"] == round(7.6 / 6.5, 3)
    assert got["32"]["follow_up_s_ratio"] == round(1.7 / 2.2, 3)
    assert got["32"]["tpot_ms_ratio"] == 1.0


@pytest.mark.parametrize("sizes", ["", "0,32", "-16"])
def test_sizes_must_be_positive(sizes, monkeypatch):
    import pdserve.model.resolve as resolve

    monkeypatch.setattr(resolve, "resolve_model", lambda source: "/nowhere")
    with pytest.raises(SystemExit):
        main(["--sizes", sizes])
