"""A worker whose engine cannot start is reported by the reason its constructor raised, as Ray
quotes it, not by Ray's whole message."""

from __future__ import annotations

from ray.exceptions import ActorDiedError

from cluster.local import engine_error

RAY_SAYS = """The actor died because of an error raised in its creation task, \
ray::clitest-decode-0:DecodeWorker.__init__() (pid=15980, ip=192.0.2.2, actor_id=1cab, \
repr=<decode_worker.worker.DecodeWorker object at 0x7f>)
  File "/work/main/worker/base.py", line 91, in __init__
    self.runner = EngineRunner(args)
  File "/work/main/.venv/lib/python3.11/site-packages/vllm/v1/core/kv_cache_utils.py", line 700, in check_enough_kv_cache_memory
    raise ValueError(
ValueError: To serve at least one request with the model's max seq len (8192), (0.35 GiB KV \
cache is needed, which is larger than the available KV cache memory (0.35 GiB).
"""


class _Died(ActorDiedError):
    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text


def test_the_constructor_s_own_error_line_is_the_reason():
    assert engine_error(_Died(RAY_SAYS)) == (
        "ValueError: To serve at least one request with the model's max seq len (8192), (0.35 GiB "
        "KV cache is needed, which is larger than the available KV cache memory (0.35 GiB).")


def test_without_an_error_line_ray_s_last_line_is_kept():
    assert engine_error(_Died("The actor died unexpectedly.\n  node lost\n")) == "node lost"
    assert engine_error(_Died("")) == "_Died"
