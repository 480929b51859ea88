"""The conductor's load refresh looks each instance's actor up once, not every 0.5 s, and looks
it up again when the cached handle stops answering (a replaced actor), but not on a timeout."""

from __future__ import annotations

import asyncio

import pytest

import conductor.conductor as conductor_module
from conductor.conductor import Conductor
from conductor.config import ConductorConfig
from conductor.policy_config import PolicyConfig


class _Method:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls = 0

    def remote(self):
        self.calls += 1

        async def call():
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer
        return call()


class _Handle:
    def __init__(self, answer) -> None:
        self.stats = _Method(answer)


@pytest.fixture
def conductor():
    c = Conductor(ConductorConfig(stats_interval_s=3600), "handles", PolicyConfig())
    yield c
    for task in c._tasks:
        task.cancel()
    c._ctx.destroy(linger=0)


def test_one_lookup_per_instance_and_another_after_its_actor_is_replaced(conductor, monkeypatch):
    lookups: list[tuple[str, str]] = []
    actors = {"d0": _Handle("stats of d0"), "d1": _Handle("stats of d1")}

    def get_actor(name, namespace):
        lookups.append((name, namespace))
        return actors[name]

    monkeypatch.setattr(conductor_module.ray, "get_actor", get_actor)

    async def scenario():
        for _ in range(3):
            assert await conductor._instance_stats("d0") == "stats of d0"
            assert await conductor._instance_stats("d1") == "stats of d1"
        assert lookups == [("d0", "handles"), ("d1", "handles")]
        # d0's actor dies and a new one takes its name: the cached handle fails, the new one answers
        dead = actors["d0"]
        dead.stats.answer = RuntimeError("actor died")
        actors["d0"] = _Handle("stats of the new d0")
        assert await conductor._instance_stats("d0") == "stats of the new d0"
        assert dead.stats.calls == 4
        assert lookups[2:] == [("d0", "handles")]
        assert await conductor._instance_stats("d0") == "stats of the new d0"
        assert len(lookups) == 3
        # a slow instance is not asked twice: the timeout reaches the refresh, no new lookup
        actors["d1"].stats.answer = asyncio.TimeoutError()
        with pytest.raises(asyncio.TimeoutError):
            await conductor._instance_stats("d1")
        assert actors["d1"].stats.calls == 4 and len(lookups) == 3

    asyncio.run(scenario())
