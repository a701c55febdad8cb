"""The active server against the masking protocol's key set-up: each attack is refused by the node.

The server relays every node's key advertisement. Here it plays the attacker with the real node code
(``NodeEpoch``, and through Flower records ``quorumfl.client.secure``): it substitutes its own keys for
a department's (unsigned, signed with its own key, or a department's signature replayed from another
epoch or run, or moved to another node), and it re-labels a node as another department. Each is
refused with the reason; an honest signed epoch with dropouts still sums to the numpy reference.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Context, Message, RecordDict

from quorumfl.aggregation.secagg import (
    CoordinatorEpoch,
    FixedPoint,
    KeyAdvertisement,
    KeyDirectory,
    MaskingParams,
)
from quorumfl.aggregation.secagg.identity import Roster, sign
from quorumfl.aggregation.secagg.streams import new_private_key, public_key
from quorumfl.errors import SecureAggregationError

from .secagg_harness import Dropouts, Federation

NODES = [(2**63 + 977 * i) % 2**64 for i in range(5)]
NAMES = ["tax-office", "urban-planning", "public-works", "parks", "libraries"]
KEYS = {name: ec.generate_private_key(ec.SECP384R1()) for name in NAMES}
SERVER_KEY = ec.generate_private_key(ec.SECP384R1())  # the attacker's own key, on no roster


def _line(key: ec.EllipticCurvePrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


ROSTER_JSON = json.dumps({name: _line(key) for name, key in KEYS.items()})
ROSTER = Roster.from_json(ROSTER_JSON)
PARAMS = MaskingParams(threshold=3, slots=2)


def _signers() -> dict[int, tuple[str, object]]:
    return {node: (name, lambda m, k=KEYS[name]: sign(k, m)) for node, name in zip(NODES, NAMES, strict=True)}


def _fake_keys(node: int) -> tuple[bytes, tuple[bytes, ...]]:
    return public_key(new_private_key()), tuple(public_key(new_private_key()) for _ in range(PARAMS.slots))


def test_an_honest_signed_epoch_with_dropouts_equals_the_numpy_sum() -> None:
    fed = Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER)  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    values = {u: rng.uniform(-2, 2, size=16) for u in NODES}
    (outcome,) = fed.round([fed.coordinator.ready], values, Dropouts(mask={NODES[1]}, unmask={NODES[2]}))
    assert outcome.total is not None, outcome.error
    reference = np.sum([values[u] for u in NODES if u != NODES[1]], axis=0)
    assert np.max(np.abs(outcome.total - reference)) <= FixedPoint(32, 8.0, len(NODES)).error_bound


def _substitute(victim: int, make: object) -> object:
    """The server hands every other node a directory where ``victim``'s advertisement is replaced."""
    def tamper(node: int, directory: KeyDirectory) -> KeyDirectory:
        if node == victim:
            return directory
        keys = dict(directory.keys)
        keys[victim] = make(keys[victim], directory)  # type: ignore[operator]
        return dataclasses.replace(directory, keys=keys)
    return tamper


def _message(ad: KeyAdvertisement, directory: KeyDirectory, *, binding: bytes = b"run:1", epoch: bytes | None = None,
             node: int | None = None) -> bytes:
    from quorumfl.aggregation.secagg.identity import advertisement_message
    from quorumfl.aggregation.secagg.messages import announcement_terms

    return advertisement_message(binding=binding, epoch=epoch or directory.epoch,
                                 terms=announcement_terms(PARAMS, tuple(sorted(NODES))),
                                 node=ad.node if node is None else node, department=ad.department,
                                 share_key=ad.share_key, mask_keys=ad.mask_keys)


def test_substituted_keys_without_a_signature_are_refused() -> None:
    def unsigned(ad: KeyAdvertisement, d: KeyDirectory) -> KeyAdvertisement:
        share_key, mask_keys = _fake_keys(ad.node)
        return KeyAdvertisement(ad.node, share_key, mask_keys, ad.department, b"")

    with pytest.raises(SecureAggregationError, match="not signed by its registered key"):
        Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER,  # type: ignore[arg-type]
                         tamper=_substitute(NODES[0], unsigned))  # type: ignore[arg-type]


def test_substituted_keys_signed_with_the_servers_own_key_are_refused() -> None:
    def forged(ad: KeyAdvertisement, d: KeyDirectory) -> KeyAdvertisement:
        share_key, mask_keys = _fake_keys(ad.node)
        fake = KeyAdvertisement(ad.node, share_key, mask_keys, ad.department, b"")
        return dataclasses.replace(fake, signature=sign(SERVER_KEY, _message(fake, d)))

    with pytest.raises(SecureAggregationError, match="'tax-office' is not signed by its registered key"):
        Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER,  # type: ignore[arg-type]
                         tamper=_substitute(NODES[0], forged))  # type: ignore[arg-type]


def test_a_department_renamed_to_one_not_on_the_roster_is_refused() -> None:
    def renamed(ad: KeyAdvertisement, d: KeyDirectory) -> KeyAdvertisement:
        share_key, mask_keys = _fake_keys(ad.node)
        fake = KeyAdvertisement(ad.node, share_key, mask_keys, "server-shadow", b"")
        return dataclasses.replace(fake, signature=sign(SERVER_KEY, _message(fake, d)))

    with pytest.raises(SecureAggregationError, match="'server-shadow' is not on the admin's roster"):
        Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER,  # type: ignore[arg-type]
                         tamper=_substitute(NODES[0], renamed))  # type: ignore[arg-type]


def test_a_signature_replayed_from_another_epoch_or_run_is_refused() -> None:
    # The server kept tax-office's signed advertisement (and would know nothing of its private keys:
    # it replays it so that the others mask with keys it hopes to learn, or to pin the victim's keys).
    old = Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER)  # type: ignore[arg-type]
    replayed = old.coordinator.ads[NODES[0]]
    with pytest.raises(SecureAggregationError, match="not signed by its registered key"):
        Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER,  # type: ignore[arg-type]
                         tamper=_substitute(NODES[0], lambda ad, d: replayed))  # type: ignore[arg-type]
    with pytest.raises(SecureAggregationError, match="not signed by its registered key"):
        Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER, binding=b"run:2",  # type: ignore[arg-type]
                         tamper=_substitute(NODES[0], lambda ad, d: dataclasses.replace(
                             ad, signature=sign(KEYS["tax-office"], _message(ad, d, binding=b"run:1")))))  # type: ignore[arg-type]


def test_one_departments_advertisement_claimed_for_another_node_is_refused() -> None:
    # The server puts urban-planning's genuine advertisement in tax-office's place.
    def moved(ad: KeyAdvertisement, d: KeyDirectory) -> KeyAdvertisement:
        genuine = d.keys[NODES[1]]
        return dataclasses.replace(genuine, node=ad.node)

    with pytest.raises(SecureAggregationError, match="not signed by its registered key"):
        Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER,  # type: ignore[arg-type]
                         tamper=_substitute(NODES[0], moved))  # type: ignore[arg-type]


def test_unsigned_advertisements_are_refused_when_the_run_has_a_roster() -> None:
    with pytest.raises(SecureAggregationError, match="must sign its advertisement"):
        Federation.setup(NODES, PARAMS, roster=ROSTER)


def test_signed_advertisements_without_a_roster_to_check_them_are_refused() -> None:
    with pytest.raises(SecureAggregationError, match="need the run's roster"):
        Federation.setup(NODES, PARAMS, signers=_signers())  # type: ignore[arg-type]


# ---- through Flower records, as the ClientApp runs it ---------------------------------------------
def _context(node: int, name: str, key_path: str, *, department: str | None = None, roster: str = ROSTER_JSON) -> Context:
    signed = {"secagg-threshold": 0.6, "secagg-min-group": 0, "secagg-clip": 8.0, "secagg-modulus-bits": 32,
              "secagg-colluding-fraction": 0.2, "secagg-dropout-fraction": 0.1, "secagg-epoch-rounds": 2,
              "num-rounds": 2}  # = PARAMS
    return Context(run_id=7, node_id=node, node_config={"node-key": key_path, "department": department or name},
                   state=RecordDict(), run_config={"roster": roster, **signed})


def _write_keys(tmp_path: object) -> dict[str, str]:
    from pathlib import Path

    paths = {}
    for name, key in KEYS.items():
        path = Path(str(tmp_path)) / f"{name}.key"
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        paths[name] = str(path)
    return paths


@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's Message needs the task's identity that a ClientApp process has."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 7)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


@pytest.mark.usefixtures("task_identity")
def test_the_clientapp_refuses_a_substituted_key_in_the_directory(tmp_path: object) -> None:
    from quorumfl.client import secure
    from quorumfl.protocol.secure_wire import (
        ADVERTISE,
        SECAGG,
        SHARE,
        decode_advertisement,
        encode_announcement,
        encode_directory,
    )

    paths = _write_keys(tmp_path)
    contexts = {node: _context(node, name, paths[name]) for node, name in zip(NODES, NAMES, strict=True)}
    coordinator = CoordinatorEpoch(NODES, PARAMS)
    announce = RecordDict({SECAGG: encode_announcement(coordinator.announcement())})
    for node, context in contexts.items():
        reply = secure.advertise(Message(announce, dst_node_id=node, message_type=ADVERTISE), context)
        ad = decode_advertisement(reply.config_records[SECAGG], node=node)
        assert ad.department == NAMES[NODES.index(node)]
        coordinator.receive_advertisement(ad)
    directories = coordinator.directories()
    victim, target = NODES[0], NODES[1]
    keys = dict(directories[target].keys)
    share_key, mask_keys = _fake_keys(victim)
    keys[victim] = KeyAdvertisement(victim, share_key, mask_keys, "tax-office", keys[victim].signature)
    forged = dataclasses.replace(directories[target], keys=keys)
    message = Message(RecordDict({SECAGG: encode_directory(forged)}), dst_node_id=target, message_type=SHARE)
    with pytest.raises(SecureAggregationError, match="'tax-office' is not signed by its registered key"):
        secure.share(message, contexts[target])
    honest = Message(RecordDict({SECAGG: encode_directory(directories[NODES[2]])}), dst_node_id=NODES[2],
                     message_type=SHARE)
    assert secure.share(honest, contexts[NODES[2]]).config_records[SECAGG]["recipients"]


def test_a_node_started_under_another_departments_name_is_refused(tmp_path: object) -> None:
    from quorumfl.client import secure

    paths = _write_keys(tmp_path)
    context = _context(NODES[0], "tax-office", paths["tax-office"], department="public-works")
    with pytest.raises(SecureAggregationError, match="started as department 'public-works' but its key is 'tax-office'"):
        secure.identity(context)
    assert secure.identity(_context(NODES[0], "tax-office", paths["tax-office"])).department == "tax-office"
    outsider = ec.generate_private_key(ec.SECP384R1())
    roster = json.dumps({"tax-office": _line(outsider)})
    with pytest.raises(SecureAggregationError, match="not on the admin's roster"):
        secure.identity(_context(NODES[0], "tax-office", paths["tax-office"], roster=roster))
    no_roster = Context(run_id=7, node_id=NODES[0], node_config={"node-key": paths["tax-office"]}, state=RecordDict(),
                        run_config={"roster": ""})
    with pytest.raises(SecureAggregationError, match="carries no roster"):
        secure.identity(no_roster)


# ---- the consistency stage -------------------------------------------------------------------------
def _masked_slot(fed: Federation, values: dict[int, np.ndarray], skip: tuple[int, ...] = ()) -> tuple[object, object]:
    """Every node (but ``skip``) masks its input on the next slot; the honest view of who survived."""
    from quorumfl.aggregation.secagg import NodeEpoch

    rnd = fed.coordinator.start_round([fed.coordinator.ready], 8)
    rng = np.random.default_rng(0)
    for node in rnd.groups[0]:
        if node in skip:
            continue
        state = NodeEpoch.from_bytes(fed.states[node])
        rnd.add_masked(node, state.mask(fed.coordinator.mask_request(node, rnd), values[node], rng))
        fed.states[node] = state.to_bytes()
    request, _ = rnd.unmask_request()
    return rnd, request


def test_a_split_view_of_who_dropped_is_refused_by_the_nodes() -> None:
    """The server tells tax-office's neighbours 1, 2 that it dropped (to get its slot key from them)
    and 3, 4 and tax-office itself that it survived (to get its self-mask seed): the consistency
    signatures of each side fall short of the threshold for 1 and 2, so they reveal nothing."""
    from quorumfl.aggregation.secagg import NodeEpoch, UnmaskRequest

    fed = Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER)  # type: ignore[arg-type]
    rnd, honest = _masked_slot(fed, {u: np.full(8, 0.5) for u in NODES})
    assert isinstance(honest, UnmaskRequest)
    victim = NODES[0]
    dropped_view = dataclasses.replace(honest, groups=((tuple(NODES[1:]), (victim,)),))
    shown = {NODES[1]: dropped_view, NODES[2]: dropped_view}
    signatures: dict[int, bytes] = {}
    for node in NODES:
        state = NodeEpoch.from_bytes(fed.states[node])
        signatures[node] = state.confirm(shown.get(node, honest), _signers()[node][1])  # type: ignore[operator]
        fed.states[node] = state.to_bytes()
    for node in (NODES[1], NODES[2]):
        state = NodeEpoch.from_bytes(fed.states[node])
        request = dataclasses.replace(dropped_view, confirmations=signatures)
        with pytest.raises(SecureAggregationError, match="only 2 survivor\\(s\\) confirmed this view"):
            state.unmask(request, roster=ROSTER)
        # and it will not be talked into signing the other view for the same slot
        with pytest.raises(SecureAggregationError, match="refusing to sign a second view"):
            state.confirm(honest, _signers()[node][1])  # type: ignore[operator]
    # Shown the dropped view without having confirmed it, a node refuses too.
    state = NodeEpoch.from_bytes(fed.states[NODES[3]])
    with pytest.raises(SecureAggregationError, match="did not confirm these survivors"):
        state.unmask(dataclasses.replace(dropped_view, confirmations=signatures), roster=ROSTER)


def test_forged_or_missing_confirmations_reveal_nothing() -> None:
    from quorumfl.aggregation.secagg import NodeEpoch

    fed = Federation.setup(NODES, PARAMS, signers=_signers(), roster=ROSTER)  # type: ignore[arg-type]
    # A node dropped, so the view asks for its slot key (a view without dropouts asks for no key and
    # needs no signatures: test_secagg_no_dropout_unmask.py)
    rnd, request = _masked_slot(fed, {u: np.full(8, 0.5) for u in NODES}, skip=(NODES[4],))
    state = NodeEpoch.from_bytes(fed.states[NODES[1]])
    mine = state.confirm(request, _signers()[NODES[1]][1])  # type: ignore[arg-type, operator]
    forged = {n: sign(SERVER_KEY, b"anything") for n in NODES}
    forged[NODES[1]] = mine
    for confirmations in ({}, {NODES[1]: mine}, forged):
        with pytest.raises(SecureAggregationError, match="confirmed this view with a valid signature"):
            state.unmask(dataclasses.replace(request, confirmations=confirmations), roster=ROSTER)  # type: ignore[arg-type]


def test_signed_rounds_with_dropouts_at_every_stage_equal_the_numpy_sum() -> None:
    nodes = [(2**63 + 977 * i) % 2**64 for i in range(5)]
    fed = Federation.setup(nodes, PARAMS, Dropouts(advertise=set()), signers=_signers(), roster=ROSTER)  # type: ignore[arg-type]
    rng = np.random.default_rng(11)
    bound = FixedPoint(32, 8.0, len(nodes)).error_bound
    for drop in [Dropouts(mask={nodes[4]}), Dropouts(confirm={nodes[0]}, unmask={nodes[1]})]:
        values = {u: rng.normal(size=12) for u in nodes}
        (outcome,) = fed.round([fed.coordinator.ready], values, drop)
        assert outcome.total is not None, outcome.error
        expected = [u for u in nodes if u not in drop.mask]
        assert list(outcome.survivors) == expected
        assert np.max(np.abs(outcome.total - np.sum([values[u] for u in expected], axis=0))) <= bound
