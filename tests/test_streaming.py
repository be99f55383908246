"""The official streaming schedule (cosyvoice_triton.streaming), shared by the pipeline and the served streams."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.streaming import stream_chunk_ends, stream_chunks


@pytest.mark.parametrize(("n", "prompt", "ends"), [
    (27, 25, []),                       # 25 + 3 look-ahead tokens not there yet: one final chunk
    (28, 0, [25]),
    (60, 13, [37]),                     # first hop padded by 12 so that prompt + chunk = 50
    (300, 49, [26, 76, 176, 276]),      # hops 25 (+1), 50, 100, 100
    (1000, 1, [49, 99, 199, 299, 399, 499, 599, 699, 799, 899]),
])
def test_chunk_ends_follow_the_official_hops(n, prompt, ends):
    assert stream_chunk_ends(n, prompt, lookahead=3) == ends


def test_chunks_carry_the_lookahead_and_end_with_every_token():
    chunks = list(stream_chunks(iter(range(300)), 49, lookahead=3))  # tokens arriving one by one
    assert [c.offset for c in chunks] == [0, 26, 76, 176, 276]
    assert [len(c.tokens) for c in chunks] == [29, 79, 179, 279, 300]
    assert [c.final for c in chunks] == [False] * 4 + [True]
    np.testing.assert_array_equal(chunks[-1].tokens, np.arange(300, dtype=np.int32))
    assert chunks[0].tokens.dtype == np.int32


def test_no_tokens_is_an_error():
    with pytest.raises(CosyVoiceError, match="no speech tokens"):
        list(stream_chunks([], 10, lookahead=3))
    assert stream_chunk_ends(0, 10, lookahead=3) == []
