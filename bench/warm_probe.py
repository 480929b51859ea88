"""Warm agent steps on an idle stack: the time to a step's first token when its prefix is cached.

``python -m bench.warm_probe STACK [--agents N] [--rounds R] [--json FILE]`` starts ``STACK`` (a
``bench.peers_stacks`` name: ``smg-cache_aware``, ``baton-0p2d``, ...) as ``baton bench peers``
does, then, one request at a time, sends each agent's cold prompt (``COLD_WORDS`` common words,
the same words to every stack, from the agent's seed) and then ``R`` warm steps per agent, each
the agent's previous prompt plus ``STEP_WORDS`` more words (no reply fed back, as the peers
workloads do). Every request streams ``MAX_TOKENS`` tokens with ``ignore_eos``, temperature 0,
over the stack's OpenAI front. It prints each warm step's TTFT and cached tokens and their mean:
with nothing else running, what a stack adds to a warm prefill is all there is to see. Run it
for each stack one after the other on an otherwise idle box, alternating the stacks (the peers
benchmark's lock: ``flock /tmp/baton-heavy.lock``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from bench.decode_probe import WORDS

COLD_WORDS = 1400
STEP_WORDS = 90
MAX_TOKENS = 16


def words(seed: int, count: int) -> str:
    """``count`` common words drawn from ``seed``: the same text for every stack."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def agent_prompts(agent: int, rounds: int) -> list[str]:
    """Agent ``agent``'s cold prompt, then its ``rounds`` warm steps (each the previous prompt
    plus ``STEP_WORDS`` words)."""
    prompts = [words(1000 + agent, COLD_WORDS)]
    for step in range(rounds):
        prompts.append(prompts[-1] + " " + words(5000 + 100 * step + agent, STEP_WORDS))
    return prompts


async def _first_token(client, url: str, model: str, prompt: str) -> tuple[float, dict]:
    """(ms to the first streamed text, the usage the stream ended with)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, usage = time.perf_counter(), None, {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url} answered {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices")
            if first is None and choices and choices[0].get("text") is not None:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{url} streamed no text")
    return (first - sent) * 1000.0, usage


async def probe(url: str, model: str, agents: int, rounds: int) -> list[dict]:
    """Every agent's cold prompt, then the warm steps round by round; one record per warm step."""
    import httpx

    prompts = {agent: agent_prompts(agent, rounds) for agent in range(agents)}
    records = []
    async with httpx.AsyncClient() as client:
        for agent in range(agents):
            await _first_token(client, url, model, prompts[agent][0])
        for step in range(1, rounds + 1):
            for agent in range(agents):
                ttft_ms, usage = await _first_token(client, url, model, prompts[agent][step])
                details = usage.get("prompt_tokens_details") or {}
                records.append({"agent": agent, "step": step, "ttft_ms": round(ttft_ms, 1),
                                "prompt_tokens": usage.get("prompt_tokens"),
                                "cached_tokens": details.get("cached_tokens")})
                print(f"agent {agent} step {step}: {ttft_ms:.0f} ms, prompt "
                      f"{usage.get('prompt_tokens')} cached {details.get('cached_tokens')}",
                      flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    from bench.peers_stacks import ABLATION_STACKS, DEFAULT_STACKS, Stack
    from engine.models import prepare_model

    stacks = {s.name: s for s in DEFAULT_STACKS + ABLATION_STACKS}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stack", choices=sorted(stacks))
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="warm steps per agent")
    parser.add_argument("--json", type=Path, help="also write the warm steps here")
    parser.add_argument("--logs", type=Path, default=Path("bench-out/warm-probe-logs"))
    args = parser.parse_args(argv)
    model = prepare_model("smollm2")
    with Stack(stacks[args.stack], model, args.logs) as stack:
        records = asyncio.run(probe(stack.base_url, model.name, args.agents, args.rounds))
    mean = statistics.fmean(r["ttft_ms"] for r in records)
    print(f"{args.stack}: warm TTFT mean {mean:.0f} ms over {len(records)} steps", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"stack": args.stack, "warm_ttft_mean_ms": round(mean, 1),
                                         "steps": records}, indent=1))


if __name__ == "__main__":
    main()
