"""What any client may ask for again and again is computed once for all who ask at the same time
(router/metrics.py ``shared``): ``/metrics`` and ``/pdserve/status`` read every engine on each call."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.metrics import scrape_engines, shared


class _Endpoint:
    def __init__(self, url: str, role: str) -> None:
        self.url, self.role, self.replica_id = url, role, None


class _Session:
    """An aiohttp-like session whose engines answer after a while; counts the requests it was sent."""

    def __init__(self) -> None:
        self.gets: list[str] = []

    def get(self, url: str, timeout=None):
        session = self

        class _Answer:
            status = 200

            async def __aenter__(self):
                session.gets.append(url)
                await asyncio.sleep(0.05)
                return self

            async def __aexit__(self, *exc):
                return False

            async def text(self):
                return "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"

        return _Answer()


def test_many_clients_at_once_cost_each_engine_one_scrape_and_all_get_its_answer():
    session = _Session()
    eps = [_Endpoint("http://p:1", "prefill"), _Endpoint("http://d:2", "decode")]

    async def main():
        got = await asyncio.gather(*(scrape_engines(session, eps) for _ in range(20)))
        again = await scrape_engines(session, eps)  # a later call scrapes afresh: nothing is kept stale
        return got, again

    got, again = asyncio.run(main())
    assert len(set(got)) == 1 and b'pdserve_role="decode"' in got[0] and again == got[0]
    assert sorted(session.gets) == ["http://d:2/metrics"] * 2 + ["http://p:1/metrics"] * 2


def test_a_caller_going_away_does_not_cancel_the_work_for_the_others_and_errors_reach_every_caller():
    runs: list[int] = []

    async def work() -> int:
        runs.append(1)
        await asyncio.sleep(0.05)
        return 7

    async def fails() -> int:
        await asyncio.sleep(0.01)
        raise RuntimeError("engine gone")

    async def main():
        first = asyncio.ensure_future(shared(("k",), work))
        second = asyncio.ensure_future(shared(("k",), work))
        await asyncio.sleep(0.01)
        first.cancel()
        assert await second == 7
        with pytest.raises(RuntimeError):
            await asyncio.gather(shared(("e",), fails), shared(("e",), fails))

    asyncio.run(main())
    assert runs == [1]
