"""An agent session over the HTTP front on a real cluster (tiny model, 1 prefill + 1 decode): two
steps of one session with a ``cache_control`` breakpoint, Anthropic's usage split holding on real
cache hits, the conductor's session table fed from the front's scoped id, and
``DELETE /v1/sessions/{id}`` closing it (then 404)."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio

from gateway.sessions import scoped_session_id
from tests.integration.engines import running_server

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

BLOCK_TOKENS = 128
SYSTEM = " ".join(f"Rule {i}: read the whole file before you change a line of it." for i in range(30))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model):
    async with running_server({"name": "sessions-http", "engine.model": "tiny",
                               "gateway.enabled": False,
                               "kvstore.host_capacity_bytes": 256 << 20}) as srv:
        yield srv


def split(usage: dict) -> int:
    return (usage["input_tokens"] + usage["cache_read_input_tokens"]
            + usage["cache_creation_input_tokens"])


async def test_two_steps_of_a_session_then_close_it(server):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first_turn = [{"role": "user", "content": "Fix the failing test."}]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}",
                                 timeout=120) as http:
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "system": system}
        first = await http.post("/v1/messages", json={**body, "messages": first_turn},
                                headers={"X-Session-Id": "agent-1"})
        assert first.status_code == 200, first.text
        history = first_turn + [{"role": "assistant", "content": "Reading the test."},
                                {"role": "user", "content": "The tool says: 3 passed."}]
        count = await http.post("/v1/messages/count_tokens", json={
            "model": "tiny", "system": system, "messages": history})
        second = await http.post("/v1/messages", json={
            **body, "messages": history, "session_id": "agent-1", "expected_next_step_s": 5})
        assert second.status_code == 200, second.text
        scoped = scoped_session_id("", "", "agent-1")
        view = await server.cluster.conductor.session.remote(scoped)
        closed = await http.delete("/v1/sessions/agent-1")
        again = await http.delete("/v1/sessions/agent-1")

    one, two = first.json()["usage"], second.json()["usage"]
    # a session step leases its whole prompt: what it did not read, it wrote
    assert one["input_tokens"] == two["input_tokens"] == 0
    assert split(two) == count.json()["input_tokens"]
    assert two["cache_read_input_tokens"] >= split(one) // BLOCK_TOKENS * BLOCK_TOKENS > 0
    assert two["cache_creation_input_tokens"] == split(two) - two["cache_read_input_tokens"]
    assert view is not None and view.num_steps == 2
    assert closed.status_code == 200, closed.text
    assert closed.json()["num_steps"] == 2
    assert (closed.json()["id"], closed.json()["object"], closed.json()["deleted"]) == (
        "agent-1", "session.deleted", True)
    assert again.status_code == 404
