"""Personal/shared split of a model's arrays (FedPer)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quorumfl.aggregation.personal import merge_arrays, personal_names, split_arrays
from quorumfl.errors import ConfigError

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "10.weight", "10.bias"]


def test_head_is_the_last_layer_and_prefixes_match_whole_layer_names() -> None:
    assert personal_names(NAMES, "head") == {"10.weight", "10.bias"}
    assert personal_names(NAMES, "2") == {"2.weight", "2.bias"}  # not 2x: "1" must not match "10.*"
    with pytest.raises(ConfigError, match="'1' names no layer"):
        personal_names(NAMES, "1")
    assert personal_names(NAMES, "") == frozenset()


def test_making_every_layer_personal_is_refused() -> None:
    with pytest.raises(ConfigError, match="nothing would be federated"):
        personal_names(NAMES, "0,2,head")


@given(st.sets(st.sampled_from(["0", "2", "10"]), min_size=1, max_size=2))
def test_split_then_merge_gives_back_the_model(layers: set[str]) -> None:
    arrays = {n: np.full(3, i, dtype=np.float32) for i, n in enumerate(NAMES)}
    personal = personal_names(NAMES, ",".join(sorted(layers)))
    shared, mine = split_arrays(arrays, personal)
    assert set(mine) == personal and not set(shared) & personal
    merged = merge_arrays(shared, mine)
    assert set(merged) == set(arrays) and all(np.array_equal(merged[k], arrays[k]) for k in arrays)
    with pytest.raises(ConfigError, match="both shared and personal"):
        merge_arrays(arrays, mine)
