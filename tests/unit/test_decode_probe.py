"""The decode probe counts only the gaps between tokens that came after every prompt was done."""

import pytest

from bench.decode_probe import decode_gaps_ms


def test_only_gaps_after_the_last_first_token_and_the_settling_time_count():
    streams = [[1.0, 1.1, 1.2, 2.0, 2.05, 2.15],   # its prefill was over first
               [1.5, 1.9, 2.1, 2.2]]               # the last first token: at 1.5 s
    # from 1.5 + 0.5 = 2.0 s on (strictly after): stream 1 has 2.05, 2.15; stream 2 2.1, 2.2
    assert decode_gaps_ms(streams, settle_s=0.5) == pytest.approx([100.0, 100.0])
    # from 1.5 s on: stream 1 has 2.0, 2.05, 2.15; stream 2 1.9, 2.1, 2.2
    assert decode_gaps_ms(streams, settle_s=0.0) == pytest.approx([50.0, 100.0, 100.0, 200.0])


def test_a_stream_without_tokens_is_an_error():
    with pytest.raises(ValueError, match="no tokens"):
        decode_gaps_ms([[1.0, 2.0], []])
