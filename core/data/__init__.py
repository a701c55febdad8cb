"""Datasets, partitioners and department partition directories."""

from quorumfl.core.data.datasets import DATASETS, Dataset, holdout_split, load_dataset
from quorumfl.core.data.partition import Partitioner, partition
from quorumfl.core.data.store import Partition, department_slug, prepare_partitions, read_partition

__all__ = [
    "DATASETS",
    "Dataset",
    "Partition",
    "Partitioner",
    "department_slug",
    "holdout_split",
    "load_dataset",
    "partition",
    "prepare_partitions",
    "read_partition",
]
