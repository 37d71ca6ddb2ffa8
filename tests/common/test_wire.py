"""Token ids on the wire: packed little-endian uint32, the same bytes whatever container the ids
come in (lists take a faster path than arrays), and ids outside uint32 refused as InvalidArgument."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from services.common.errors import InvalidArgument
from services.common.wire import pack_tokens, tokens_from_proto, tokens_to_proto

U32 = st.integers(min_value=0, max_value=0xFFFFFFFF)


@given(st.lists(U32, max_size=600))
def test_lists_tuples_and_arrays_pack_to_the_same_little_endian_bytes(ids):
    expected = b"".join(i.to_bytes(4, "little") for i in ids)
    assert pack_tokens(ids) == expected
    assert pack_tokens(tuple(ids)) == expected
    assert pack_tokens(np.array(ids, dtype=np.uint64)) == expected
    assert tokens_from_proto(tokens_to_proto(ids)).tolist() == ids


@pytest.mark.parametrize("bad", [[-1], [0, 0x100000000], [5, 2**70], [1.5], ["7"]])
def test_ids_outside_uint32_are_refused(bad):
    with pytest.raises(InvalidArgument):
        pack_tokens(bad)
    with pytest.raises(InvalidArgument):
        pack_tokens(tuple(bad))


@pytest.mark.parametrize("bad", [np.array([-1]), np.array([0, 0x100000000])])
def test_arrays_outside_uint32_are_refused(bad):
    with pytest.raises(InvalidArgument):
        pack_tokens(bad)
