"""engine.step_shapes.ScheduleTap: the shape of each scheduled step, read from what vLLM's
scheduler decided (the real engine: tests/integration/test_mixed_steps.py)."""

from __future__ import annotations

from types import SimpleNamespace

from engine.step_shapes import ScheduleTap, StepShape
from protos.wire import PromptChunk


class FakeScheduler:
    """Schedules what the test says and, like vLLM's, advances each request's computed tokens
    before it returns."""

    def __init__(self) -> None:
        self.requests: dict[str, SimpleNamespace] = {}
        self.plan: dict[str, int] = {}
        self.new: list[str] = []

    def add(self, request_id: str, prompt_tokens: int, computed: int = 0) -> None:
        self.requests[request_id] = SimpleNamespace(num_prompt_tokens=prompt_tokens,
                                                    num_computed_tokens=computed)
        self.new.append(request_id)

    def schedule(self):
        new = [SimpleNamespace(req_id=r, num_computed_tokens=self.requests[r].num_computed_tokens)
               for r in self.new if r in self.plan]
        self.new = [r for r in self.new if r not in self.plan]
        for request_id, n in self.plan.items():
            if request_id in self.requests:
                self.requests[request_id].num_computed_tokens += n
        return SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=dict(self.plan))


def test_a_step_decoding_beside_chunks_is_mixed_and_chunks_count_from_the_prefix_hit():
    scheduler = FakeScheduler()
    tap = ScheduleTap(scheduler)
    scheduler.add("a", prompt_tokens=40, computed=0)
    scheduler.plan = {"a": 40}  # a's whole prompt: a prefill-only step
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 40}  # the scheduler's own output, untouched
    assert tap.last == StepShape((), 0, (PromptChunk(0, 40, 0),)) and not tap.last.is_mixed
    scheduler.add("b", prompt_tokens=700, computed=256)  # 256 tokens found cached
    scheduler.plan = {"a": 1, "b": 300}
    scheduler.schedule()
    assert tap.last == StepShape(("a",), 40, (PromptChunk(0, 300, 256),)) and tap.last.is_mixed
    scheduler.plan = {"a": 1, "b": 144}  # b's last chunk: 256 + 300 + 144 = 700
    scheduler.schedule()
    assert tap.last == StepShape(("a",), 41, (PromptChunk(300, 144, 256),))
    assert tap._prompt_starts == {}  # b's prompt is computed: forgotten
    scheduler.plan = {"a": 1, "b": 1}
    scheduler.schedule()
    assert tap.last == StepShape(("a", "b"), 42 + 700, ()) and not tap.last.is_mixed
    assert tap.num_schedules == 4


def test_blocks_the_connector_copies_in_on_the_step_are_counted_those_left_to_run_beside_not():
    from kvstore.connector_meta import BatonConnectorMetadata, LoadSpec

    scheduler = FakeScheduler()
    tap = ScheduleTap(scheduler)
    scheduler.add("a", prompt_tokens=4, computed=4)
    scheduler.add("h", prompt_tokens=1800, computed=1799)  # a hand-off: all but its last token loaded
    scheduler.plan = {"a": 1, "h": 1}
    schedule = scheduler.schedule

    def with_loads():
        output = schedule()
        output.kv_connector_metadata = BatonConnectorMetadata(loads=[
            LoadSpec("h", list(range(112)), list(range(112)), [b"k"] * 112, "/arena", on_step=True),
            LoadSpec("x", list(range(30)), list(range(30)), [b"k"] * 30, "/arena", on_step=False)])
        return output

    scheduler.schedule = with_loads
    tap = ScheduleTap(scheduler)
    scheduler.schedule()
    assert tap.last == StepShape(("a",), 4, (PromptChunk(0, 1, 1799),), loaded_blocks=112)


def test_a_scheduler_output_it_cannot_read_leaves_no_shape():
    scheduler = FakeScheduler()
    tap = ScheduleTap(scheduler)
    scheduler.plan = {"unknown": 1}  # a request the scheduler does not hold (KeyError)
    scheduler.requests["unknown"] = SimpleNamespace(num_prompt_tokens=4, num_computed_tokens=4)
    scheduler.schedule()
    assert tap.last is not None
    del scheduler.requests["unknown"]
    scheduler.schedule()
    assert tap.last is None and tap.num_schedules == 2
