"""The ``image`` task: the built-in image datasets (scikit-learn's digits, Fashion-MNIST) and models.

Schema::

    {"task": "image", "version": "1", "dataset": "digits", "input_shape": [1, 8, 8],
     "classes": ["0", "1", ..., "9"]}

Its models are ``quorumfl.core.models``' MLPs and CNNs; the examples are images (channels, height,
width) in [0, 1] with int64 class labels. Departments' partitions come from ``quorumfl data split``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numpy.typing import NDArray

from quorumfl.core.tasks.base import Schema
from quorumfl.core.tasks.objective import CLASSIFICATION, Objective
from quorumfl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ImageTask", "image_schema"]


def image_schema(dataset: str, input_shape: Sequence[int], num_classes: int) -> dict[str, Any]:
    """The schema of a built-in image dataset (also derived for partitions written before schemas)."""
    return {"task": "image", "version": ImageTask.version, "dataset": dataset,
            "input_shape": [int(d) for d in input_shape], "classes": [str(c) for c in range(num_classes)]}


class ImageTask:
    """Image classification on the built-in datasets."""

    name = "image"
    version = "1"
    default_model = "mlp"
    needs_statistics = False

    def model_names(self) -> Sequence[str]:
        from quorumfl.core.models import MODELS

        return tuple(MODELS)

    def check_schema(self, schema: Schema) -> None:
        shape = schema.get("input_shape")
        classes = schema.get("classes")
        if schema.get("task") != self.name or str(schema.get("version")) != self.version:
            raise ConfigError(f"image schema: 'task'/'version' must be 'image'/'{self.version}'")
        if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(d, int) and d > 0 for d in shape)):
            raise ConfigError("image schema: 'input_shape' must be [channels, height, width]")
        if not (isinstance(classes, list) and len(classes) >= 2):
            raise ConfigError("image schema: 'classes' must list two or more classes")

    def input_shape(self, schema: Schema) -> tuple[int, ...]:
        return tuple(int(d) for d in schema["input_shape"])

    def outputs(self, schema: Schema) -> int:
        return len(schema["classes"])

    def objective(self, schema: Schema) -> Objective:
        return CLASSIFICATION

    def build_model(self, model: str, schema: Schema, *, seed: int) -> nn.Module:
        from quorumfl.core.models import build_model

        return build_model(model, self.input_shape(schema), self.outputs(schema), seed=seed)

    def infer_schema(self, source: Path, options: Mapping[str, str]) -> dict[str, Any]:
        from quorumfl.core.data.datasets import load_dataset

        train, _ = load_dataset(options.get("dataset", "digits"), data_dir=source if source.is_dir() else None)
        return image_schema(train.name, train.input_shape, train.num_classes)

    def read(self, source: Path, schema: Schema) -> tuple[NDArray[Any], NDArray[Any]]:
        raise DataError(f"{source}: the image task takes the built-in datasets ({schema.get('dataset', 'digits')}, "
                        "fashion-mnist) through 'quorumfl data split'; it does not import image files")
