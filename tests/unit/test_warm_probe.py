"""``bench.warm_probe``'s prompts: every stack gets the same text, and each warm step extends the
agent's previous prompt (so its prefix is cached where the stack kept it)."""

from __future__ import annotations

from bench.warm_probe import COLD_WORDS, STEP_WORDS, agent_prompts


def test_each_warm_step_extends_the_previous_prompt_by_its_words():
    prompts = agent_prompts(0, 3)
    assert len(prompts) == 4
    assert len(prompts[0].split()) == COLD_WORDS
    for before, after in zip(prompts, prompts[1:]):
        assert after.startswith(before + " ")
        assert len(after.split()) == len(before.split()) + STEP_WORDS


def test_the_prompts_are_the_agents_seeded_text_and_agents_differ():
    assert agent_prompts(1, 2) == agent_prompts(1, 2)
    assert agent_prompts(0, 2)[0] != agent_prompts(1, 2)[0]
    assert agent_prompts(0, 2)[1].split()[COLD_WORDS:] != agent_prompts(1, 2)[1].split()[COLD_WORDS:]
