"""The masking protocol against a plain numpy sum, with dropouts at every stage; its secrecy properties."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from quorumfl.aggregation.secagg import (
    CoordinatorEpoch,
    FixedPoint,
    MaskingParams,
    NodeEpoch,
    UnmaskReply,
    neighbour_graph,
    resolve_threshold,
)
from quorumfl.aggregation.secagg.graph import exposure_probability, neighbours_of, sparse_parameters
from quorumfl.aggregation.secagg.shamir import (
    PRIME,
    SMALL_X,
    _evaluate,
    _small_reconstruct,
    _weights,
    interpolate_at,
    reconstruct_secret,
    split_secret,
)
from quorumfl.aggregation.secagg.streams import add_keystream
from quorumfl.errors import ConfigError, QuorumNotMetError, SecureAggregationError

from .secagg_harness import Dropouts, Federation

SLOW = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ids(n: int) -> list[int]:
    # Flower ids are uint64; use large ones so nothing assumes small or dense ids.
    return [(2**63 + 977 * i) % 2**64 for i in range(n)]


@st.composite
def _federation_case(draw: st.DrawFn) -> tuple[int, int, Dropouts, int]:
    n = draw(st.integers(3, 50))
    t = draw(st.integers(n // 2 + 1, n))
    nodes = _ids(n)
    dropped = draw(st.lists(st.sampled_from(nodes), unique=True, max_size=n - t))
    stages = draw(st.lists(st.sampled_from(["advertise", "share", "mask", "unmask"]),
                           min_size=len(dropped), max_size=len(dropped)))
    drop = Dropouts()
    for node, stage in zip(dropped, stages, strict=True):
        getattr(drop, stage).add(node)
    return n, t, drop, draw(st.integers(0, 2**32 - 1))


@SLOW
@given(_federation_case())
def test_unmasked_sum_equals_numpy_sum_under_any_tolerated_dropouts(case: tuple[int, int, Dropouts, int]) -> None:
    n, t, drop, seed = case
    nodes = _ids(n)
    rng = np.random.default_rng(seed)
    values = {u: rng.uniform(-3.0, 3.0, size=24) for u in nodes}
    setup_drop = Dropouts(advertise=drop.advertise, share=drop.share)
    round_drop = Dropouts(mask=drop.mask, unmask=drop.unmask)
    fed = Federation.setup(nodes, MaskingParams(threshold=t, slots=2), setup_drop)

    (outcome,) = fed.round([fed.coordinator.ready], values, round_drop, seed=seed)

    assert outcome.error is None and outcome.total is not None
    assert set(outcome.survivors) == set(nodes) - drop.advertise - drop.share - drop.mask
    reference = np.sum([values[u] for u in outcome.survivors], axis=0)
    bound = FixedPoint(32, 8.0, len(fed.coordinator.members)).error_bound
    assert np.max(np.abs(outcome.total - reference)) <= bound


def test_several_rounds_several_groups_and_a_dropped_node_coming_back() -> None:
    nodes = _ids(9)
    fed = Federation.setup(nodes, MaskingParams(threshold=5, slots=4, min_group=3))
    rng = np.random.default_rng(7)
    bound = FixedPoint(32, 8.0, 9).error_bound
    for number, drop in enumerate([Dropouts(mask={nodes[0]}), Dropouts(), Dropouts(unmask={nodes[5]})]):
        values = {u: rng.normal(size=10) for u in nodes}
        groups = [nodes[:4], nodes[4:]]
        outcomes = fed.round(groups, values, drop, seed=number)
        for group, outcome in zip(groups, outcomes, strict=True):
            assert outcome.total is not None, outcome.error
            expected = [u for u in group if u not in drop.mask]
            assert list(outcome.survivors) == expected
            assert np.max(np.abs(outcome.total - np.sum([values[u] for u in expected], axis=0))) <= bound


def test_sparse_graph_rounds_are_correct() -> None:
    nodes = _ids(30)
    params = MaskingParams(threshold=16, slots=1, complete_up_to=10, colluding_fraction=0.0, dropout_fraction=0.05)
    fed = Federation.setup(nodes, params)
    assert all(len(fed.coordinator.neighbours(u)) < 29 for u in nodes)
    rng = np.random.default_rng(3)
    values = {u: rng.normal(size=8) for u in nodes}
    (outcome,) = fed.round([fed.coordinator.ready], values, Dropouts(mask={nodes[3]}, unmask={nodes[8]}))
    assert outcome.total is not None, outcome.error
    reference = np.sum([values[u] for u in outcome.survivors], axis=0)
    assert np.max(np.abs(outcome.total - reference)) <= FixedPoint(32, 8.0, 30).error_bound


def test_sparse_graph_is_regular_symmetric_and_seeded() -> None:
    graph = neighbour_graph(200, seed=b"s" * 16, complete_up_to=100)
    degrees = {len(g) for g in graph}
    assert degrees == {sparse_parameters(200, 0.2, 0.1)[0]}  # type: ignore[index]
    assert all(i in graph[j] for i, g in enumerate(graph) for j in g) and all(i not in g for i, g in enumerate(graph))
    assert graph == neighbour_graph(200, seed=b"s" * 16, complete_up_to=100)
    assert graph != neighbour_graph(200, seed=b"t" * 16, complete_up_to=100)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 400), complete_up_to=st.sampled_from([1, 10, 100]), seed=st.binary(min_size=16, max_size=16))
def test_a_nodes_own_row_equals_its_row_of_the_whole_graph(n: int, complete_up_to: int, seed: bytes) -> None:
    """What a node computes for itself (``neighbours_of``) is exactly the coordinator's graph row."""
    graph = neighbour_graph(n, seed=seed, complete_up_to=complete_up_to)
    assert [neighbours_of(i, n, seed=seed, complete_up_to=complete_up_to) for i in range(n)] == graph
    with pytest.raises(SecureAggregationError, match="outside"):
        neighbours_of(n, n, seed=seed, complete_up_to=complete_up_to)


@pytest.mark.parametrize("n", [128, 1000])
@pytest.mark.parametrize("colluding", [0.1, 0.2, 0.3])
def test_sparse_parameters_keep_colluders_from_exposing_any_honest_node(n: int, colluding: float) -> None:
    """The chosen degree and local threshold, checked against scipy's hypergeometric tail: the
    chance that the colluders hold t_local shares of some honest node's secrets is <= 2^-40, and the
    chance that some node's secrets cannot be rebuilt (colluders refusing, 10 % dropped) <= 2^-20."""
    from scipy.stats import hypergeom

    choice = sparse_parameters(n, colluding, 0.1)
    colluders, unavailable = int(colluding * n), int(colluding * n) + int(0.1 * n)
    assert choice is not None
    k, t_local = choice
    assert k < n - 2 and k // 2 < t_local <= k
    exposed = n * hypergeom.sf(t_local - 1, n - 1, colluders, k)  # P[X >= t_local]
    stuck = n * hypergeom.cdf(t_local - 1, n - 1, n - 1 - unavailable, k)  # P[helpers < t_local]
    assert exposed <= 2.0**-40 and stuck <= 2.0**-20
    assert float(exposure_probability(n, colluders, k, t_local)) == pytest.approx(exposed, rel=1e-6, abs=1e-300)
    # and it is the cheapest: one degree less (with any local threshold) misses a bound
    smaller = k - 2
    assert all(exposure_probability(n, colluders, smaller, t) > 2.0**-40
               or n * hypergeom.cdf(t - 1, n - 1, n - 1 - unavailable, smaller) > 2.0**-20
               for t in range(smaller // 2 + 1, smaller + 1))


GRAPH_EPOCHS = int(os.environ.get("QUORUMFL_GRAPH_EPOCHS", "1000"))


@settings(max_examples=GRAPH_EPOCHS, deadline=None)
@given(n=st.sampled_from([101, 128, 257]), seed=st.binary(min_size=16, max_size=16))
def test_the_sparse_graph_is_connected_in_every_epoch(n: int, seed: bytes) -> None:
    """Each epoch's graph (a random seed) is connected; QUORUMFL_GRAPH_EPOCHS=10000 for the full run."""
    graph = neighbour_graph(n, seed=seed, complete_up_to=100)
    seen, frontier = {0}, [0]
    while frontier:
        frontier = [j for i in frontier for j in graph[i] if j not in seen and not seen.add(j)]  # type: ignore[func-returns-value]
    assert len(seen) == n


def test_too_many_dropouts_abort_the_round_reveal_nothing_and_the_next_round_completes() -> None:
    nodes = _ids(10)
    fed = Federation.setup(nodes, MaskingParams(threshold=6, slots=3))
    values = {u: np.full(5, 1.0) for u in nodes}
    with pytest.raises(QuorumNotMetError):
        fed.round([nodes], values, Dropouts(mask=set(nodes[:5])))  # n − t + 1 = 5
    # No node was asked to unmask, so no share left any node.
    assert all(NodeEpoch.from_bytes(state).revealed == {} for state in fed.states.values())
    assert fed.coordinator.reconstructed == set()
    (outcome,) = fed.round([nodes], values)
    assert outcome.total is not None and np.allclose(outcome.total, 10.0, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 20), data=st.data())
def test_any_t_shares_reconstruct_and_t_minus_1_leave_every_secret_possible(n: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, n))
    secret = data.draw(st.binary(min_size=32, max_size=32))
    holders = list(range(1, n + 1))
    shares = split_secret(secret, threshold=t, holders=holders)
    subset = data.draw(st.lists(st.sampled_from(holders), unique=True, min_size=t, max_size=n))
    assert reconstruct_secret({x: shares[x] for x in subset}, threshold=t, length=32) == secret
    if t >= 2:
        known = {x: shares[x] for x in subset[: t - 1]}
        missing = next(x for x in holders if x not in known)
        candidates = [secret, bytes(32), b"\xff" * 32, data.draw(st.binary(min_size=32, max_size=32))]
        completions = []
        for candidate in candidates:
            # The one t-th share that makes the t − 1 known shares decode to this candidate.
            completion = interpolate_at([*known.items(), (0, int.from_bytes(candidate, "big"))], missing)
            assert reconstruct_secret({**known, missing: completion}, threshold=t, length=32) == candidate
            completions.append(completion)
        assert len(set(completions)) == len(set(candidates))


@pytest.mark.parametrize("offset", [0, SMALL_X, PRIME - 400])  # member indices; large x-coordinates
def test_a_corrupted_extra_share_is_detected(offset: int) -> None:
    holders = [offset + x for x in (1, 2, 3, 4)]
    shares = split_secret(b"k" * 32, threshold=3, holders=holders)
    assert reconstruct_secret(shares, threshold=3, length=32) == b"k" * 32
    shares[holders[3]] = (shares[holders[3]] + 1) % PRIME
    with pytest.raises(SecureAggregationError, match="inconsistent"):
        reconstruct_secret(shares, threshold=3, length=32)


@settings(max_examples=80, deadline=None)
@given(xs=st.lists(st.integers(1, 3000), unique=True, min_size=1, max_size=40), data=st.data())
def test_the_small_coordinate_path_equals_plain_barycentric_interpolation(xs: list[int], data: st.DataObject) -> None:
    """Member-index x-coordinates take the all-shares-at-once path (dual-code check): it rebuilds
    what the generic formula rebuilds from the first t shares, and refuses exactly the share sets
    that fail the generic check of each further share against those t."""
    xs = sorted(xs)
    t = data.draw(st.integers(1, len(xs)))
    coefficients = data.draw(st.lists(st.integers(0, PRIME - 1), min_size=t, max_size=t))
    ys = [sum(c * pow(x, k, PRIME) for k, c in enumerate(coefficients)) % PRIME for x in xs]
    if data.draw(st.booleans()):  # one share off the polynomial (or, when it is among the first t, a new polynomial)
        i = data.draw(st.integers(0, len(xs) - 1))
        ys[i] = (ys[i] + data.draw(st.integers(1, PRIME - 1))) % PRIME
    weights = _weights(xs[:t])
    consistent = all(_evaluate(xs[:t], ys[:t], weights, x) == y for x, y in zip(xs[t:], ys[t:], strict=True))
    if consistent:
        assert _small_reconstruct(xs, ys, t) == _evaluate(xs[:t], ys[:t], weights, 0)
    else:
        with pytest.raises(SecureAggregationError, match="inconsistent"):
            _small_reconstruct(xs, ys, t)


def _lone_masked_vector(values: np.ndarray, *, seed: int) -> np.ndarray:
    nodes = _ids(3)
    fed = Federation.setup(nodes, MaskingParams(threshold=2, slots=1))
    rnd = fed.coordinator.start_round([nodes], values.shape[0])
    state = NodeEpoch.from_bytes(fed.states[nodes[0]])
    return state.mask(fed.coordinator.mask_request(nodes[0], rnd), values, np.random.default_rng(seed))


def test_one_nodes_masked_vector_is_uniform() -> None:
    # A structured input (all zeros) must look uniform once masked: chi-square on the top 4 bits.
    masked = _lone_masked_vector(np.zeros(200_000), seed=1)
    counts = np.bincount((masked >> 28).astype(np.int64), minlength=16)
    assert chisquare(counts).pvalue > 1e-4
    # ... and the same coordinate over many independent epochs.
    draws = np.array([_lone_masked_vector(np.full(4, 2.5), seed=s)[0] for s in range(400)])
    assert chisquare(np.bincount((draws >> 29).astype(np.int64), minlength=8)).pvalue > 1e-4


def _reference_stream(key: bytes, length: int, dtype: np.dtype) -> np.ndarray:
    """AES-256-CTR with a zero IV, straight from ``cryptography``: the mask stream as specified."""
    raw = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(length * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(calls=st.lists(st.tuples(st.integers(0, 5_000), st.sampled_from([np.uint32, np.uint64]), st.booleans(),
                                st.binary(min_size=32, max_size=32)), min_size=1, max_size=6))
def test_a_mask_added_in_place_is_the_specified_stream_whatever_came_before(
        calls: list[tuple[int, type, bool, bytes]]) -> None:
    """``add_keystream`` reuses one scratch buffer per thread: each call, after longer or shorter
    ones, of either dtype, adds (or subtracts) exactly its own key's AES-256-CTR stream."""
    rng = np.random.default_rng(len(calls))
    for length, dtype, subtract, key in calls:
        target = rng.integers(0, np.iinfo(dtype).max, size=length, dtype=dtype, endpoint=True)
        expected = (target - _reference_stream(key, length, np.dtype(dtype)) if subtract
                    else target + _reference_stream(key, length, np.dtype(dtype)))
        add_keystream(target, key, subtract=subtract)
        np.testing.assert_array_equal(target, expected)


def test_masks_added_in_parallel_threads_do_not_mix() -> None:
    keys = [bytes([i]) * 32 for i in range(8)]
    targets = [np.zeros(50_000 + 1_000 * i, dtype=np.uint32) for i in range(8)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda i: [add_keystream(targets[i], keys[i]) for _ in range(3)], range(8)))
    for key, target in zip(keys, targets, strict=True):
        np.testing.assert_array_equal(target, 3 * _reference_stream(key, target.shape[0], np.dtype(np.uint32)))


def test_a_rebuilt_key_is_never_used_again() -> None:
    nodes = _ids(6)
    fed = Federation.setup(nodes, MaskingParams(threshold=4, slots=4))
    rng = np.random.default_rng(0)
    plan = [Dropouts(mask={nodes[0]}), Dropouts(mask={nodes[1]}), Dropouts(), Dropouts(mask={nodes[0]})]
    for number, drop in enumerate(plan):
        fed.round([nodes], {u: rng.normal(size=6) for u in nodes}, drop, seed=number)
        for node, slot in fed.coordinator.reconstructed:
            assert (node, slot) not in fed.masked_log
    assert fed.coordinator.reconstructed == {(nodes[0], 0), (nodes[1], 1), (nodes[0], 3)}
    assert len(set(fed.masked_log)) == len(fed.masked_log)  # every (node, slot) masked once
    state = NodeEpoch.from_bytes(fed.states[nodes[2]])
    assert sorted(state.used) == [0, 1, 2, 3] and state.mask_private == [b""] * 4 and state.seeds == [b""] * 4
    with pytest.raises(SecureAggregationError, match="no unused slot"):
        fed.coordinator.start_round([nodes], 6)


def test_a_slots_secrets_are_erased_once_used_leaving_only_what_was_revealed() -> None:
    nodes = _ids(6)
    fed = Federation.setup(nodes, MaskingParams(threshold=4, slots=3))
    fresh = NodeEpoch.from_bytes(fed.states[nodes[1]])
    assert len({k for k in fresh.mask_private}) == 3 and b"" not in fresh.seeds  # one key and seed per slot
    rng = np.random.default_rng(1)
    fed.round([nodes], {u: rng.normal(size=5) for u in nodes}, Dropouts(mask={nodes[0]}))  # slot 0; nodes[0] dropped
    state = NodeEpoch.from_bytes(fed.states[nodes[1]])
    assert state.mask_private[0] == b"" and state.seeds[0] == b"" and state.mask_private[1] != b""
    width = 66  # a share's bytes
    for owner, held in state.held.items():
        key_part, seed_part = held[:width], held[width: 2 * width]
        # what was revealed (a survivor's seed share, the dropped node's key share) stays; the rest is gone
        assert (key_part != bytes(width)) == (owner == nodes[0]), owner
        assert (seed_part != bytes(width)) == (owner != nodes[0]), owner
    fed.round([nodes], {u: rng.normal(size=5) for u in nodes})  # slot 1 (masking it erases all of slot 0)
    state = NodeEpoch.from_bytes(fed.states[nodes[1]])
    assert all(h[: 2 * width] == bytes(2 * width) for h in state.held.values())


def test_node_refuses_a_reused_or_older_slot() -> None:
    nodes = _ids(4)
    fed = Federation.setup(nodes, MaskingParams(threshold=3, slots=3))
    fed.round([nodes], {u: np.ones(3) for u in nodes})
    fed.round([nodes], {u: np.ones(3) for u in nodes})
    state = NodeEpoch.from_bytes(fed.states[nodes[1]])
    rnd = fed.coordinator.start_round([nodes], 3)
    request = fed.coordinator.mask_request(nodes[1], rnd)
    for slot in (0, 1):
        with pytest.raises(SecureAggregationError, match="already used|older"):
            state.mask(dataclasses.replace(request, slot=slot), np.ones(3), np.random.default_rng(0))


def test_node_refuses_unmasking_below_quorum_or_twice_with_other_survivors() -> None:
    nodes = _ids(5)
    fed = Federation.setup(nodes, MaskingParams(threshold=3, slots=1))
    rnd = fed.coordinator.start_round([nodes], 2)
    for node in nodes:
        state = NodeEpoch.from_bytes(fed.states[node])
        rnd.add_masked(node, state.mask(fed.coordinator.mask_request(node, rnd), np.ones(2), np.random.default_rng(0)))
        fed.states[node] = state.to_bytes()
    request, _ = rnd.unmask_request()
    state = NodeEpoch.from_bytes(fed.states[nodes[0]])
    too_few = dataclasses.replace(request, groups=((tuple(nodes[:2]), tuple(nodes[2:])),))
    with pytest.raises(QuorumNotMetError):
        state.unmask(too_few)
    state.unmask(request)
    other = dataclasses.replace(request, groups=((tuple(nodes[:4]), (nodes[4],)),))
    with pytest.raises(SecureAggregationError, match="already unmasked"):
        state.unmask(other)  # would reveal node 4's key after its seed: refused


def test_tampered_bundle_and_substituted_keys_are_refused() -> None:
    nodes = _ids(4)
    coord = CoordinatorEpoch(nodes, MaskingParams(threshold=3, slots=1))
    states = {}
    for node in nodes:
        states[node], ad = NodeEpoch.advertise(coord.announcement(), node)
        coord.receive_advertisement(ad)
    directories = coord.directories()
    swapped = dict(directories[nodes[0]].keys)
    swapped[nodes[0]] = directories[nodes[0]].keys[nodes[1]]
    with pytest.raises(SecureAggregationError, match="own keys"):
        NodeEpoch.from_bytes(states[nodes[0]].to_bytes()).share(dataclasses.replace(directories[nodes[0]], keys=swapped))
    for node in nodes:
        coord.receive_bundles(node, states[node].share(directories[node]))
    coord.close_setup(nodes)
    rnd = coord.start_round([nodes], 2)
    request = coord.mask_request(nodes[0], rnd)
    bad = request.incoming[0]
    tampered = dataclasses.replace(bad, ciphertext=bad.ciphertext[:-1] + bytes([bad.ciphertext[-1] ^ 1]))
    with pytest.raises(SecureAggregationError, match="authentication"):
        states[nodes[0]].mask(dataclasses.replace(request, incoming=(tampered,)), np.ones(2), np.random.default_rng(0))
    redirected = dataclasses.replace(bad, recipient=nodes[2])
    with pytest.raises(SecureAggregationError):
        states[nodes[2]].mask(dataclasses.replace(coord.mask_request(nodes[2], rnd), incoming=(redirected,)),
                              np.ones(2), np.random.default_rng(0))


def test_coordinator_rejects_malformed_masked_input() -> None:
    nodes = _ids(3)
    fed = Federation.setup(nodes, MaskingParams(threshold=2, slots=1))
    rnd = fed.coordinator.start_round([nodes], 4)
    with pytest.raises(SecureAggregationError, match="uint32"):
        rnd.add_masked(nodes[0], np.zeros(4, dtype=np.float32))
    with pytest.raises(SecureAggregationError, match="not a participant"):
        rnd.add_masked(12345, np.zeros(4, dtype=np.uint32))


def _fixed_point_error(bits: int, n: int, clip: float, seed: int) -> tuple[Fraction, float]:
    """The largest |decoded masked-style sum − exact sum| over 7 coordinates (exact rational reference),
    and the documented bound."""
    fp = FixedPoint(bits, clip, n)
    rng = np.random.default_rng(seed)
    values = rng.uniform(-clip, clip, size=(n, 7))
    values[0, 0] = clip  # extremes included
    values[-1, 1] = -clip
    total = np.zeros(7, dtype=fp.dtype)
    for row in values:
        encoded, clipped = fp.encode(row, rng)
        assert clipped == 0
        total += encoded
    decoded = fp.decode(total)
    exact = [sum((Fraction(float(v)) for v in values[:, j]), Fraction(0)) for j in range(7)]
    return max(abs(Fraction(float(decoded[j])) - exact[j]) for j in range(7)), fp.error_bound


@settings(max_examples=100, deadline=None)
@given(
    bits=st.sampled_from([32, 64]),
    n=st.integers(1, 200),
    clip=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**32 - 1),
)
@example(bits=64, n=1, clip=5.9703130205761745, seed=0)  # at the 2^52 cap: float64 rounding of v·scale counts
def test_fixed_point_sum_stays_within_the_documented_bound(bits: int, n: int, clip: float, seed: int) -> None:
    error, bound = _fixed_point_error(bits, n, clip, seed)
    assert error <= Fraction(bound)


def test_the_bound_before_float_rounding_terms_is_exceeded_at_the_cap() -> None:
    """Why ``error_bound`` has its float64 terms: with one summand at the 2^52 cap, the rounding of
    v·scale alone exceeds max_summands / scale for some draws."""
    fp = FixedPoint(64, 5.9703130205761745, 1)
    worst = max(_fixed_point_error(64, 1, fp.clip, seed)[0] for seed in range(200))
    assert worst > Fraction(fp.max_summands / fp.scale)
    assert worst <= Fraction(fp.error_bound)


def test_params_and_thresholds_are_validated_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="majority"):
        MaskingParams(threshold=2, slots=1).check(5)
    with pytest.raises(ConfigError, match="64 modulus bits"):
        FixedPoint(32, 1e9, 10)
    assert resolve_threshold(0.6, 10) == 6 and resolve_threshold(7, 10) == 7 and resolve_threshold(0.51, 4) == 3
    with pytest.raises(ConfigError, match="majority"):
        resolve_threshold(0.3, 10)


def test_only_the_complete_graph_protects_a_small_cohort_against_many_colluders() -> None:
    assert sparse_parameters(120, 0.45, 0.1) is None  # no k < n − 2 meets both bounds
    graph = neighbour_graph(120, seed=b"s" * 16, complete_up_to=100, colluding_fraction=0.45)
    assert all(len(g) == 119 for g in graph)


def test_a_wrong_seed_share_is_caught_by_its_commitment_and_the_rest_still_sum_to_numpy() -> None:
    nodes = _ids(6)
    fed = Federation.setup(nodes, MaskingParams(threshold=4, slots=2))
    rng = np.random.default_rng(5)
    values = {u: rng.normal(size=7) for u in nodes}
    liar = nodes[3]

    def lie(reply: UnmaskReply) -> UnmaskReply:  # one holder reveals a wrong seed share of another node
        if reply.node != liar:
            return reply
        owner = next(u for u in reply.seed_shares if u != liar)
        return dataclasses.replace(reply, seed_shares={**reply.seed_shares, owner: (reply.seed_shares[owner] + 1)})

    [outcome] = fed.round([nodes], values, tamper_unmask=lie)
    assert [(n, "does not match the commitment" in r) for n, r in fed.refused] == [(liar, True)]
    assert outcome.total is not None
    np.testing.assert_allclose(outcome.total, np.sum(np.stack(list(values.values())), axis=0), atol=1e-6)


def test_a_node_refuses_shares_whose_relayed_commitments_were_changed() -> None:
    nodes = _ids(4)
    fed = Federation.setup(nodes, MaskingParams(threshold=3, slots=2))
    rnd = fed.coordinator.start_round([nodes], 3)
    request = fed.coordinator.mask_request(nodes[0], rnd)
    forged = tuple(dataclasses.replace(b, commitment=bytes(len(b.commitment))) for b in request.incoming)
    state = NodeEpoch.from_bytes(fed.states[nodes[0]])
    with pytest.raises(SecureAggregationError, match="commitments relayed with node .* do not match"):
        state.mask(dataclasses.replace(request, incoming=forged), np.ones(3), np.random.default_rng(0))


def _plain_encode(fp: FixedPoint, values: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """The encoding written plainly: clip, scale, round up with probability of the fraction, mod M."""
    v = np.asarray(values, dtype=np.float64)
    clipped = int(np.count_nonzero(np.abs(v) > fp.clip))
    scaled = np.clip(v, -fp.clip, fp.clip) * fp.scale
    low = np.floor(scaled)
    q = low.astype(np.int64) + (rng.random(v.shape) < (scaled - low)).astype(np.int64)
    return (q % (1 << fp.modulus_bits) if fp.modulus_bits == 32 else q.view(np.uint64)).astype(fp.dtype), clipped


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([32, 64]),
    n=st.integers(1, 1000),
    clip=st.floats(0.01, 100.0),
    spread=st.floats(0.0, 3.0),
    length=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_encoder_equals_the_plain_form_draw_for_draw(bits: int, n: int, clip: float, spread: float, length: int,
                                                          seed: int) -> None:
    fp = FixedPoint(bits, clip, n)
    values = np.random.default_rng(seed).uniform(-spread * clip, spread * clip, length)  # above 1: some clipped
    got, clipped = fp.encode(values, np.random.default_rng(seed + 1))
    want, want_clipped = _plain_encode(fp, values, np.random.default_rng(seed + 1))
    assert got.dtype == fp.dtype and np.array_equal(got, want) and clipped == want_clipped


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_encoder_refuses_non_finite_values(bad: float) -> None:
    values = np.zeros(5)
    values[3] = bad
    with pytest.raises(ConfigError, match="NaN or infinite"):
        FixedPoint(32, 8.0, 10).encode(values, np.random.default_rng(0))
