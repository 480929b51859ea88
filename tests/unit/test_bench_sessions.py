"""``baton bench sessions``' pure parts: the workload and the ceiling it is judged against."""

from __future__ import annotations

from bench.sessions import BLOCK_TOKENS, Step, ceiling_tokens, make_workload, working_set_tokens


def test_the_workload_is_a_function_of_its_seed():
    a = make_workload(3, sessions=4, steps=5, trunk_tokens=256, think_s=2.0, max_tokens=16)
    b = make_workload(3, sessions=4, steps=5, trunk_tokens=256, think_s=2.0, max_tokens=16)
    c = make_workload(4, sessions=4, steps=5, trunk_tokens=256, think_s=2.0, max_tokens=16)
    assert a == b and a != c
    assert len(a.trunk) == 256 and len(a.tools) == 4 and all(len(t) == 5 for t in a.tools)
    assert all(len(t) == 4 for t in a.thinks)
    assert all(0 < x <= 30.0 for t in a.thinks for x in t)
    assert working_set_tokens(a) == 256 + sum(len(x) + 16 for t in a.tools for x in t)


def step(session, index, prompt, started, finished, ttft_ms=0.0):
    return Step(session, index, len(prompt), 0, 0, ttft_ms, started, finished, 0)


def test_the_ceiling_reuses_only_blocks_computed_before():
    b = BLOCK_TOKENS
    trunk = list(range(2 * b))  # two blocks every prompt shares
    p00 = trunk + [7] * b + [8] * 10        # session 0, step 0: 3 full blocks and a tail
    r00 = [9] * (b - 10)                    # its reply completes the 4th block
    p01 = p00 + r00 + [5] * (b + 3)         # step 1: 5 full blocks
    p10 = trunk + [6] * b                   # its prefill was done before (0, 0)'s was
    p20 = trunk + [4] * b                   # its prefill was done after (0, 0)'s was
    steps = [step(0, 0, p00, 0.0, 1.0, ttft_ms=800.0), step(0, 1, p01, 2.0, 3.0),
             step(1, 0, p10, 0.5, 1.5, ttft_ms=100.0), step(2, 0, p20, 0.6, 1.6, ttft_ms=400.0)]
    prompts = {(0, 0): p00, (0, 1): p01, (1, 0): p10, (2, 0): p20}
    replies = {(0, 0): r00, (0, 1): [1] * 4, (1, 0): [2] * 4, (2, 0): [3] * 4}
    ceiling_tokens(steps, prompts, replies)
    by_key = {(s.session, s.index): s.ceiling_cached_tokens for s in steps}
    # (1, 0) and (2, 0) arrived while (0, 0) prefilled the trunk: (2, 0) could wait for it,
    # (1, 0) was done first; (0, 0) began before anyone had computed anything. Step (0, 1)
    # reuses its session's last prompt and the block that step's reply completed: 4 blocks,
    # not the 5th (computed by no one before).
    assert by_key == {(0, 0): 0, (1, 0): 0, (2, 0): 2 * b, (0, 1): 4 * b}


def test_the_ceiling_leaves_the_last_token_to_compute():
    b = BLOCK_TOKENS
    prompt = list(range(2 * b))
    steps = [step(0, 0, prompt, 0.0, 1.0), step(1, 0, prompt, 2.0, 3.0)]
    ceiling_tokens(steps, {(0, 0): prompt, (1, 0): prompt}, {(0, 0): [], (1, 0): []})
    assert steps[1].ceiling_cached_tokens == b  # a full hit still computes the last token


def test_the_ceiling_counts_in_the_configured_block():
    """A run on engines configured with another block size (``engine.block_size_tokens``) is
    held to a ceiling in those blocks: 100 shared tokens are 3 blocks of 32, none of 128."""
    prompt = list(range(100))
    again = prompt + [7]
    for block, expected in ((32, 96), (128, 0)):
        steps = [step(0, 0, prompt, 0.0, 1.0), step(1, 0, again, 2.0, 3.0)]
        ceiling_tokens(steps, {(0, 0): prompt, (1, 0): again}, {(0, 0): [], (1, 0): []}, block)
        assert steps[1].ceiling_cached_tokens == expected
