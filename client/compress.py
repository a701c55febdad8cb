"""The node's side of update compression: error feedback with the residual kept on the node's disk.

``compressed_update`` encodes a plaintext reply's update; ``shared_update_vector`` gives the shared
random-k values that masking secure aggregation sums (every node keeps the same coordinates, from
the round's seed, so the masked sum is the sum of the nodes' encodings). In a full-precision sync
round the update and the whole residual go out uncompressed and the residual is cleared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from numpy.typing import NDArray

from quorumfl.aggregation.compression import (
    Encoded,
    ErrorFeedback,
    Scheme,
    decode_arrays,
    shared_positions,
)
from quorumfl.aggregation.secagg import flatten
from quorumfl.client.personal_store import PersonalStore
from quorumfl.protocol.wire import TrainConfig, encode_update

if TYPE_CHECKING:
    from quorumfl.client.steps import LocalTraining

__all__ = ["compressed_update", "shared_update_vector"]


def _step(context: Context, local: LocalTraining) -> tuple[dict[str, Encoded], dict[str, NDArray[np.float32]]]:
    """Run error feedback for this round: the encoding, and the update it decodes to (what the server gets)."""
    from quorumfl.client.steps import run_state_key  # steps imports this module

    config: TrainConfig = local.config
    feedback = ErrorFeedback(Scheme(config.compression), config.compression_fraction)
    store = PersonalStore.for_node(dict(context.node_config), int(context.node_id), kind="residual")
    residual = store.load(run_state_key(context))
    update = {k: np.asarray(local.trained[k], np.float32) - np.asarray(local.received[k], np.float32)
              for k in local.trained}
    encoded, new_residual = feedback.step(update, residual, seed=config.compression_seed,
                                          full=config.compression_full)
    store.save(run_state_key(context), dict(new_residual))
    decoded = decode_arrays(encoded, fraction=config.compression_fraction, seed=config.compression_seed)
    return encoded, decoded


def compressed_update(context: Context, local: LocalTraining) -> tuple[ArrayRecord, ConfigRecord]:
    """Encode ``trained − received`` with error feedback for a plaintext reply."""
    encoded, _ = _step(context, local)
    return encode_update(encoded, local.config)


def shared_update_vector(context: Context, local: LocalTraining) -> NDArray[np.float64]:
    """The shared random-k values of ``trained − received`` (with error feedback), in flatten order;
    the whole update in a full-precision sync round."""
    config = local.config
    _, decoded = _step(context, local)
    flat: NDArray[np.float64] = flatten(decoded)
    if config.compression_full:
        return flat
    shapes = {k: tuple(np.shape(v)) for k, v in local.trained.items()}
    shared: NDArray[np.float64] = flat[shared_positions(shapes, config.compression_fraction, config.compression_seed)]
    return shared
