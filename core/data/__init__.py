"""Datasets, partitioners and department partition directories."""

from quorumfl.core.data.datasets import DATASETS, Dataset, holdout_split, load_dataset
from quorumfl.core.data.departments import check_data, import_partition, propose_schema
from quorumfl.core.data.partition import Partitioner, partition
from quorumfl.core.data.store import Partition, department_slug, prepare_partitions, read_partition

__all__ = [
    "DATASETS",
    "Dataset",
    "Partition",
    "Partitioner",
    "check_data",
    "department_slug",
    "holdout_split",
    "import_partition",
    "load_dataset",
    "partition",
    "prepare_partitions",
    "propose_schema",
    "read_partition",
]
