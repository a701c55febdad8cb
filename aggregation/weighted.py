"""Weighted averaging of model updates with running sums (FedAvg / FedProx server step).

Flower's ``aggregate_arrayrecords`` divides by the sum of weights without checking it and keeps no
validation, so this module does the arithmetic itself: every update is checked (names, shapes,
finiteness, weight) *before* it touches the running sums, so a bad node can never change the
aggregate. Memory is two float32 blocks per float32 tensor (a float64 accumulator for other dtypes,
and for a float32 tensor once a partial sum is widened), independent of the node count.

Speed (float32 tensors of ``LARGE`` = 64 elements and up: every weight matrix and nearly every bias
or normalisation vector): w·x is accumulated in place (y ← y + w·x, one pass, on torch's intra-op threads;
numpy's dot is single-threaded) into a float32 block. Every ``BLOCK`` updates the block is added into a
float32 partial sum, and every ``BLOCKS`` blocks that partial sum into the float64 sums. Nothing is ever
cleared: a block's first term is written into it (``mul`` with ``out``) rather than added to zeros, and a
block that starts a partial sum becomes it (the two tensors swap) instead of being added to zeros. Both float32
accumulators stay in the CPU's cache for models of a few million parameters, so the common case reads
each update once and touches little else: converting a float32 block into the float64 sums costs as
much as adding several updates (measured: 0.68 ms against 0.06–0.25 ms per 1M floats), which is why
that conversion happens once per ``BLOCK``·``BLOCKS`` updates and not once per ``BLOCK``.
``add`` checks finiteness first with one dot product per update (x·x is finite exactly when every
element is, unless the squares overflow; only then does the element-wise check run): two passes over
each update. ``extend``, which the server's FedAvg step uses, checks the block instead, once per
``BLOCK`` updates, since a NaN or ±inf in any term stays non-finite in the block; when the block is not
finite it is cleared and its updates redone one by one through ``add``, so a rejected update still
never touches the sums (a float32 add cannot be undone exactly, so nothing is subtracted). A new
float32 tensor costs page faults on first touch (~1 ms per 4 MB, as much as adding ten updates), so
``result`` divides into the spare block and hands it to the caller, and a dropped mean's blocks go to
a small pool (``POOL_BYTES``) that the next mean (the next round's) takes them from. Measured
figures come from ``benchmarks/aggregate_throughput.py`` (docs/results.md).
Error bound of that summation: every coordinate of the result is within
(BLOCK + BLOCKS + 2)·2⁻²⁴·Σ|wᵢxᵢ|/Σwᵢ of the exact weighted mean. Each term wᵢxᵢ is rounded once in
float32, then added by recursive summation into a block of at most BLOCK terms (at most BLOCK − 1
roundings, each bounded by u times the running partial sum's magnitude, itself ≤ Σ|wᵢxᵢ| of its
terms), the block into a partial sum of at most BLOCKS blocks (at most BLOCKS − 1 roundings, bounded
the same way), the partial sum into float64 (exact to within 2⁻⁵³, counted in the last term), and the
float64 mean rounded once to float32: 1 + (BLOCK − 1) + (BLOCKS − 1) + 1 plus a second-order term
that the remaining 2⁻²⁴ covers (Higham, Accuracy and Stability of Numerical Algorithms, §4.2). That is
about 2·10⁻⁶ of the mean magnitude for BLOCK = BLOCKS = 16; tested against a float64 numpy reference,
across the float64 flush. Tensors under 64 elements and other dtypes keep element-wise float64
accumulation. Small float32 tensors took that path below 16,384 elements until the sixteenth session:
numpy's finiteness check, product and float64 add cost ~5 µs per tensor and update against ~2 µs for
one torch ``add_`` into a block (a model with 30 small tensors beside a 200k one: 25.0 → 18.4 ms for
100 updates). The float64 sums of a float32 tensor are made only when a partial sum is first widened into them (or
when a node sends that tensor in another dtype, which then counts beside the float32 sums).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import AggregationError, EmptyAggregationError

__all__ = ["BLOCK", "BLOCKS", "LARGE", "NodeUpdate", "WeightedMean", "aggregate_weighted_mean", "aggregate_weighted_metrics",
           "error_bound"]

Arrays = Mapping[str, NDArray[np.generic]]

LARGE = 1 << 6  # float32 tensors with at least this many elements take the block path (torch, float32 blocks)
BLOCK = 16  # float32 terms per block before it is added into the float32 partial sum
BLOCKS = 16  # blocks per float32 partial sum before it is added into the float64 sums
UNIT_ROUNDOFF = 2.0**-24  # float32
POOL_BYTES = 256 << 20  # float32 blocks kept between aggregations (two per large tensor of a 32M-parameter model)


def error_bound(weights: Iterable[float], magnitudes: NDArray[np.float64]) -> NDArray[np.float64]:
    """The documented bound on |result − exact mean| per coordinate for the BLAS path, given the
    weights and Σ|wᵢxᵢ| per coordinate (``magnitudes``)."""
    total = float(sum(weights))
    return np.asarray((BLOCK + BLOCKS + 2) * UNIT_ROUNDOFF * magnitudes / total, dtype=np.float64)


@functools.cache
def _torch() -> Any:
    """torch, imported on first use: read-only CLI commands import this module but never aggregate."""
    import torch

    return torch


@functools.cache
def _is_real(dtype: np.dtype[Any]) -> bool:
    """Numeric and not complex (cached: numpy's ``issubdtype`` costs microseconds per call)."""
    return bool(np.issubdtype(dtype, np.number) and not np.issubdtype(dtype, np.complexfloating))


def _blas_path(arr: NDArray[np.generic]) -> bool:
    """Large float32 tensors: checked with a dot product and accumulated in place on torch's threads."""
    return arr.dtype == np.float32 and arr.size >= LARGE


def _all_finite(arr: NDArray[np.generic]) -> bool:
    if _blas_path(arr) and arr.flags.c_contiguous:
        flat = _torch().from_numpy(arr.reshape(-1))
        if math.isfinite(float(flat.dot(flat))):
            return True  # a NaN or ±inf anywhere makes the dot product non-finite
    return bool(np.isfinite(arr).all())  # small tensors, other dtypes, or squares that overflowed


class _BlockPool:
    """float32 blocks a finished ``WeightedMean`` leaves for the next one (the server makes one per
    round): a new 4 MB tensor costs ~1 ms of page faults on first touch, as much as adding ten updates.
    Holds at most ``limit`` bytes; what does not fit is freed."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._free: dict[int, list[Any]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, numel: int) -> Any:
        with self._lock:
            free = self._free.get(numel)
            if free:
                self._bytes -= 4 * numel
                return free.pop()
        return _torch().empty(numel, dtype=_torch().float32)

    def give(self, *owners: dict[str, Any]) -> None:
        with self._lock:
            for owner in owners:
                for tensor in owner.values():
                    size = 4 * tensor.numel()
                    if self._bytes + size <= self._limit:
                        self._free.setdefault(tensor.numel(), []).append(tensor)
                        self._bytes += size
                owner.clear()


_POOL = _BlockPool(POOL_BYTES)


@dataclass(frozen=True)
class NodeUpdate:
    """One node's contribution: named parameter arrays and its weight (its example count)."""

    node: str
    arrays: Arrays
    weight: float


def _check_weight(node: str, weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)):
        raise AggregationError(f"weight must be a number, got {type(weight).__name__}", node=node)
    value = float(weight)
    if not math.isfinite(value) or value <= 0.0:
        raise AggregationError(
            f"weight must be a positive finite example count, got {weight!r}", node=node
        )
    return value


class WeightedMean:
    """Running weighted mean over updates that share the names and shapes of a template.

    ``add`` validates an update completely before accumulating it, so a rejected update leaves the
    sums untouched. ``result`` returns arrays in the template's dtypes.
    """

    def __init__(self, template: Arrays) -> None:
        if not template:
            raise AggregationError("template has no parameter arrays; pass the global model's arrays")
        self._shapes = {name: tuple(np.shape(a)) for name, a in template.items()}
        self._dtypes = {name: np.asarray(a).dtype for name, a in template.items()}
        self._names = frozenset(self._shapes)
        # float64 sums, made on first use: a tensor that only ever takes the BLAS path needs one only
        # once a partial sum is widened (``BLOCK``·``BLOCKS`` updates), and zeroing it costs a pass
        self._sums: dict[str, NDArray[np.float64]] = {}
        self._scratch: dict[str, NDArray[np.floating]] = {}
        self._blocks: dict[str, Any] = {}  # float32 torch tensors: the current block of the BLAS path
        self._partials: dict[str, Any] = {}  # float32 torch tensors: sums of up to BLOCKS blocks
        self._in_block = 0
        self._in_partial = 0
        # names whose block (partial sum) holds terms that count; any other block holds leftovers, and
        # its next term is written, not added. Per name: a node may send a large tensor in another dtype,
        # which takes the exact path and leaves that block untouched.
        self._in_blocks: set[str] = set()
        self._in_partials: set[str] = set()
        self._total = 0.0
        self._nodes: list[str] = []
        self._seen: set[str] = set()  # the same nodes, for the duplicate check
        # the blocks go back to the pool when this mean is dropped (never the one ``result`` handed out)
        weakref.finalize(self, _POOL.give, self._blocks, self._partials)

    @property
    def nodes(self) -> list[str]:
        """Nodes whose updates were accepted, in arrival order."""
        return list(self._nodes)

    @property
    def total_weight(self) -> float:
        return self._total

    def check(self, update: NodeUpdate, *, large_finite: bool = True) -> float:
        """Validate ``update`` against the template; return its weight as float. With
        ``large_finite=False`` the finiteness of large float32 tensors is left to the caller
        (``extend`` checks it on the block they were added to)."""
        node = update.node
        weight = _check_weight(node, update.weight)
        if not update.arrays:
            raise AggregationError("update is empty (no parameter arrays)", node=node)
        if update.arrays.keys() != self._names:
            names, expected = set(update.arrays), set(self._names)
            missing = sorted(expected - names)
            extra = sorted(names - expected)
            raise AggregationError(
                f"parameter names differ from the global model (missing {missing}, unexpected {extra})",
                node=node,
            )
        for name, array in update.arrays.items():
            arr = array if isinstance(array, np.ndarray) else np.asarray(array)
            if arr.shape != self._shapes[name]:
                raise AggregationError(
                    f"shape mismatch for '{name}': expected {self._shapes[name]}, got {arr.shape}",
                    node=node,
                )
            if not _is_real(arr.dtype):
                raise AggregationError(
                    f"'{name}' has non-real dtype {arr.dtype}", node=node
                )
            if (large_finite or not _blas_path(arr)) and not _all_finite(arr):
                bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
                raise AggregationError(
                    f"'{name}' contains {bad} non-finite value(s) (NaN or Inf)", node=node
                )
        return weight

    def add(self, update: NodeUpdate) -> None:
        """Validate and accumulate one update; raises ``AggregationError`` naming the node."""
        if update.node in self._seen:
            raise AggregationError("a second update from the same node in one aggregation", node=update.node)
        weight = self.check(update)
        self._accumulate_large(update, weight)
        self._accumulate_small(update, weight)
        self._total += weight
        self._nodes.append(update.node)
        self._seen.add(update.node)
        self._in_block += 1
        if self._in_block >= BLOCK:
            self._flush()

    def extend(self, updates: Iterable[NodeUpdate]) -> dict[str, str]:
        """Validate and accumulate many updates; return ``{node: reason}`` for those rejected.

        The accepted set and the result are those of ``add`` on each update in turn (within the error
        bound), in about one pass over each update instead of two: the large float32 tensors of up to
        ``BLOCK`` updates are added to the blocks unchecked, and the block is checked once (one dot
        product). A non-finite value in any update makes its coordinate of the block non-finite for good
        (NaN and ±inf absorb every later finite or infinite term), so a finite block proves every one of
        its updates finite. A block that is not is cleared and its updates are added again one by one,
        each checked first, exactly as ``add`` does: a rejected update never touches the sums. Up to
        ``BLOCK`` updates are held meanwhile (references; the caller's arrays are not copied)."""
        rejected: dict[str, str] = {}
        pending: list[tuple[NodeUpdate, float]] = []
        held: set[str] = set()  # the nodes in ``pending``
        self._flush()  # the block holds only unchecked terms of this batch, so clearing it loses nothing
        for update in updates:
            node = update.node
            if node in held:  # settled first: was the earlier one accepted?
                rejected.update(self._settle(pending))
                pending, held = [], set()
            try:
                if node in self._seen:
                    raise AggregationError("a second update from the same node in one aggregation", node=node)
                weight = self.check(update, large_finite=False)
            except AggregationError as exc:
                rejected[node] = str(exc)
                continue
            self._accumulate_large(update, weight)
            pending.append((update, weight))
            held.add(node)
            if len(pending) >= BLOCK:
                rejected.update(self._settle(pending))
                pending, held = [], set()
        rejected.update(self._settle(pending))
        return rejected

    def _settle(self, pending: list[tuple[NodeUpdate, float]]) -> dict[str, str]:
        """Commit a batch whose large tensors are in the blocks, or redo it update by update."""
        if not pending:
            return {}
        if all(math.isfinite(float(self._blocks[name].dot(self._blocks[name]))) for name in self._in_blocks):
            for update, weight in pending:
                self._accumulate_small(update, weight)
                self._total += weight
                self._nodes.append(update.node)
                self._seen.add(update.node)
            self._in_block = len(pending)
            self._flush()
            return {}
        self._in_blocks = set()
        self._in_block = 0
        rejected: dict[str, str] = {}
        for update, _ in pending:
            try:
                self.add(update)
            except AggregationError as exc:
                rejected[update.node] = str(exc)
        self._flush()
        return rejected

    def _accumulate_large(self, update: NodeUpdate, weight: float) -> None:
        """w·x into the float32 blocks, for the large float32 tensors. A block's first term is written
        (``mul`` into it) rather than added to zeros, so no pass over memory clears a block."""
        torch, blocks, in_blocks = _torch(), self._blocks, self._in_blocks
        for name, array in update.arrays.items():
            arr = np.asarray(array)
            if _blas_path(arr):
                if arr.ndim != 1 or not arr.flags.c_contiguous:
                    arr = np.ascontiguousarray(arr).reshape(-1)
                term = torch.from_numpy(arr)
                if name in in_blocks:
                    blocks[name].add_(term, alpha=weight)
                else:
                    block = blocks.get(name)
                    if block is None:  # torch's allocation is 64-byte aligned; numpy's is not always
                        block = blocks[name] = _POOL.take(arr.size)
                    torch.mul(term, weight, out=block)
                    in_blocks.add(name)

    def _accumulate_small(self, update: NodeUpdate, weight: float) -> None:
        """w·x into the float64 sums, for the other tensors."""
        for name, array in update.arrays.items():
            arr = np.asarray(array)
            if _blas_path(arr):
                continue
            # w·x in the update's own float precision (one rounding per term) into a reused buffer,
            # then added into the float64 sums: no allocation per update, and half the memory
            # traffic of converting x to float64 first.
            dtype = arr.dtype if np.issubdtype(arr.dtype, np.floating) else np.dtype(np.float64)
            scratch = self._scratch.get(name)
            if scratch is None or scratch.dtype != dtype:
                scratch = self._scratch[name] = np.empty(self._shapes[name], dtype=dtype)
            np.multiply(arr, dtype.type(weight), out=scratch)
            wide = self._wide(name)
            np.add(wide, scratch, out=wide)

    def _wide(self, name: str) -> NDArray[np.float64]:
        """The float64 sums of ``name``, made (zeros) on first use."""
        wide = self._sums.get(name)
        if wide is None:
            wide = self._sums[name] = np.zeros(self._shapes[name], dtype=np.float64)
        return wide

    def _flush(self) -> None:
        """Add the float32 blocks into the float32 partial sums and start new blocks; every ``BLOCKS``
        blocks, add the partial sums into the float64 sums."""
        if self._in_block:
            for name in self._in_blocks:
                block, partial = self._blocks[name], self._partials.get(name)
                if name not in self._in_partials:  # the block becomes the partial sum: no copy
                    self._partials[name] = block
                    self._blocks[name] = partial if partial is not None else _POOL.take(block.numel())
                    self._in_partials.add(name)
                else:
                    self._partials[name].add_(block)
            self._in_blocks = set()
            self._in_block = 0
            self._in_partial += 1
        if self._in_partial >= BLOCKS:
            for name in self._in_partials:
                partial, wide = self._partials[name], self._sums.get(name)
                if wide is None:  # its first partial sum: converted, not added to zeros
                    self._sums[name] = partial.to(_torch().float64).numpy().reshape(self._shapes[name])
                else:
                    _torch().from_numpy(wide.reshape(-1)).add_(partial)
            self._in_partials = set()
            self._in_partial = 0

    def result(self) -> dict[str, NDArray[np.generic]]:
        """The weighted mean of everything added so far."""
        if not self._nodes:
            raise EmptyAggregationError("no valid update to aggregate")
        if not math.isfinite(self._total) or self._total <= 0.0:
            raise AggregationError(f"sum of weights is {self._total}; it must be positive and finite")
        self._flush()
        result: dict[str, NDArray[np.generic]] = {}
        for name in self._shapes:
            partial = self._partials.get(name) if name in self._in_partials else None
            acc = self._sums.get(name)
            if partial is None:  # everything is in the float64 sums
                result[name] = (self._wide(name) / self._total).astype(self._dtypes[name], copy=False)
            elif acc is None:  # everything is in the float32 partial sum: divide there, into the spare
                # block (its pages are mapped already: a new 4 MB tensor costs ~1 ms of page faults);
                # the caller keeps it, so a later ``add`` starts a new block
                spare = self._blocks.pop(name, None)
                out = _torch().div(partial, self._total, out=spare) if spare is not None else partial / self._total
                result[name] = out.numpy().reshape(self._shapes[name]).astype(self._dtypes[name], copy=False)
            else:  # both: a widened partial sum or a term of another dtype went into the float64 sums
                wide = _torch().from_numpy(acc.reshape(-1)) + partial
                result[name] = (wide / self._total).numpy().astype(self._dtypes[name]).reshape(self._shapes[name])
        return result


def aggregate_weighted_mean(
    updates: Iterable[NodeUpdate], *, template: Arrays | None = None
) -> dict[str, NDArray[np.generic]]:
    """Weighted mean of ``updates`` (weights = example counts); strict: any bad update raises.

    Without ``template`` the first update's names and shapes are the reference.
    """
    iterator = iter(updates)
    first: NodeUpdate | None = None
    if template is None:
        first = next(iterator, None)
        if first is None:
            raise EmptyAggregationError("no updates to aggregate")
        if not first.arrays:
            raise AggregationError("update is empty (no parameter arrays)", node=first.node)
        template = first.arrays
    mean = WeightedMean(template)
    if first is not None:
        mean.add(first)
    for update in iterator:
        mean.add(update)
    return mean.result()


def aggregate_weighted_metrics(
    metrics: Iterable[tuple[str, Mapping[str, float], float]],
) -> dict[str, float]:
    """Weighted mean of per-node scalar metrics ``(node, {name: value}, weight)``.

    A metric missing at some nodes is averaged over the nodes that report it.
    """
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for node, values, weight in metrics:
        w = _check_weight(node, weight)
        for key, value in values.items():
            v = float(value)
            if not math.isfinite(v):
                raise AggregationError(f"metric '{key}' is {value!r}", node=node)
            sums[key] = sums.get(key, 0.0) + w * v
            weights[key] = weights.get(key, 0.0) + w
    return {key: sums[key] / weights[key] for key in sums}
