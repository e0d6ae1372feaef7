"""The footprint scenario's cache fill (how many prompts fill every engine's KV cache) and its reading of a
process's CPU time."""

from __future__ import annotations

from pdserve_bench.footprint import CACHE_INFO, fill_count


def _info(role: str, replica: str, blocks: str, block_size: str = "16") -> tuple:
    labels = {"pdserve_role": role, "pdserve_replica": replica, "num_gpu_blocks": blocks, "block_size": block_size}
    return (CACHE_INFO, tuple(sorted(labels.items())))


def test_prompts_enough_for_the_larger_role_across_its_replicas():
    # The embedded default: 1,024 blocks of 16 tokens an engine (16,384 tokens): 11 prompts of 1,500 + 1.
    one_each = {_info("prefill", "p0", "1024"): 1.0, _info("decode", "d0", "1024"): 1.0}
    assert fill_count(one_each, 1500) == 12
    # Two decode replicas share the prompts: twice as many fill them both.
    two_decode = {**one_each, _info("decode", "d1", "1024"): 1.0}
    assert fill_count(two_decode, 1500) == 23
    # Other series, a size an engine does not give, nothing at all: not counted.
    assert fill_count({("vllm:num_requests_running", ()): 0.0, _info("decode", "d0", "?"): 1.0}, 1500) is None
    assert fill_count({}, 1500) is None and fill_count(one_each, 0) is None


def test_cpu_ticks_reads_user_and_system_time_past_a_command_name_with_spaces_and_parentheses():
    from pdserve_bench.reference_timer import cpu_ticks

    rest = " ".join(["S", "1", "1", "1", "0", "-1", "4194560", "10", "0", "0", "0", "37", "5", "0", "0"])
    assert cpu_ticks(f"4242 (ray::Serve (x) y) {rest}") == 42



def test_the_ray_floor_has_as_many_replicas_as_the_app_and_reads_its_childs_result_line(monkeypatch):
    import subprocess

    import pytest

    from pdserve_bench import ray_floor

    app = {"router replica": 1, "prefill replica": 2, "decode replica": 1, "Serve controller": 1, "Ray GCS": 1,
           "engine core": 3}
    assert ray_floor.replicas_of(app) == 4 and ray_floor.replicas_of({"Ray GCS": 1}) == 0

    seen: list[list[str]] = []

    def run(argv, **_):
        seen.append(argv)
        out = "Ray noise\n" + ray_floor.RESULT_PREFIX + '{"replicas": 4, "core_share": 0.05}\n'
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")

    monkeypatch.setattr(ray_floor.subprocess, "run", run)
    assert ray_floor.measure_floor(4, 60, "0.0.0.0") == {"replicas": 4, "core_share": 0.05}
    assert seen[0][-4:] == ["pdserve_bench.ray_floor", "4", "60", "0.0.0.0"]
    monkeypatch.setattr(ray_floor.subprocess, "run",
                        lambda argv, **_: subprocess.CompletedProcess(argv, 1, stdout="", stderr="ray.init failed"))
    with pytest.raises(RuntimeError, match="ray.init failed"):
        ray_floor.measure_floor(4, 60)
