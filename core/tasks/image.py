"""The ``image`` task: the built-in image datasets (scikit-learn's digits, Fashion-MNIST), a department's
own image folders (scanned forms: one sub-folder per class, PNG or JPEG), and the image models.

Schema::

    {"task": "image", "version": "1", "dataset": "digits", "input_shape": [1, 8, 8],
     "classes": ["0", "1", ..., "9"]}

``dataset`` is a built-in dataset's name, or ``"folder"`` for departments' own image folders
(``quorumfl data schema FOLDER --task image`` proposes the classes from the sub-folder names and the
input shape from the first image; ``quorumfl data import`` reads a department's folder). Its models
are ``quorumfl.core.models``' MLPs and CNNs; the examples are images (channels, height, width) in
[0, 1] with int64 class labels. Partitions of the built-in datasets come from ``quorumfl data split``.

Images are decoded by Pillow (torchvision does not import beside this torch). An image is taken as
it is — never resized or recoloured behind the department's back: one of another size or with other
channels is refused, naming the file and what to convert it to.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numpy.typing import NDArray

from quorumfl.core.files import FileChangedError, read_unchanged
from quorumfl.core.tasks.base import Schema
from quorumfl.core.tasks.objective import CLASSIFICATION, Objective
from quorumfl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from PIL import Image
    from torch import nn

__all__ = ["FOLDER", "ImageTask", "image_schema", "read_image_folder"]


def image_schema(dataset: str, input_shape: Sequence[int], num_classes: int) -> dict[str, Any]:
    """The schema of a built-in image dataset (also derived for partitions written before schemas)."""
    return {"task": "image", "version": ImageTask.version, "dataset": dataset,
            "input_shape": [int(d) for d in input_shape], "classes": [str(c) for c in range(num_classes)]}


class ImageTask:
    """Image classification on the built-in datasets."""

    name = "image"
    version = "1"
    default_model = "mlp"
    # the local optimizer and learning rate a run takes unless it names them (run config "auto" / 0)
    training_defaults = ("sgd", 0.05)
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
        classes = _class_folders(source) if options.get("dataset", FOLDER) == FOLDER and source.is_dir() else []
        if classes:
            first = next((f for c in classes for f in _image_files(source / c)), None)
            if first is None:
                raise DataError(f"{source}: its class sub-folders hold no PNG or JPEG images; add the images")
            image = _open(first)
            channels = 1 if image.mode in GREY else 3
            return {"task": self.name, "version": self.version, "dataset": FOLDER,
                    "input_shape": [channels, image.height, image.width], "classes": classes}
        from quorumfl.core.data.datasets import load_dataset

        train, _ = load_dataset(options.get("dataset", "digits"), data_dir=source if source.is_dir() else None)
        return image_schema(train.name, train.input_shape, train.num_classes)

    def read(self, source: Path, schema: Schema) -> tuple[NDArray[Any], NDArray[Any]]:
        if schema.get("dataset") != FOLDER:
            raise DataError(f"{source}: the schema's dataset is the built-in '{schema.get('dataset')}', whose "
                            "partitions come from 'quorumfl data split'; for a department's own images use a schema "
                            "of dataset 'folder' ('quorumfl data schema FOLDER --task image')")
        return read_image_folder(source, self.input_shape(schema), [str(c) for c in schema["classes"]])


FOLDER = "folder"
SUFFIXES = (".png", ".jpg", ".jpeg")
GREY = ("L", "1")  # one channel (a binary scan reads as 0 and 1)
COLOUR = ("RGB",)


def _class_folders(source: Path) -> list[str]:
    return sorted(p.name for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)


def _open(path: Path) -> Image.Image:
    """The decoded image; refuses a file that is not PNG/JPEG or that changes while it is read."""
    from PIL import Image, UnidentifiedImageError

    try:
        raw = read_unchanged(path)
    except FileChangedError:
        raise DataError(f"{path} changed while it was read; import the folder again once it is complete") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{path} is not a readable PNG or JPEG image ({exc}); re-save it or remove it") from None
    if image.format not in ("PNG", "JPEG"):
        raise DataError(f"{path} is a {image.format} image; save it as PNG or JPEG")
    return image


def read_image_folder(source: Path, shape: tuple[int, ...], classes: list[str]) -> tuple[NDArray[Any], NDArray[Any]]:
    """A department's images (one sub-folder per class) as (N, C, H, W) float32 in [0, 1] and int64 labels."""
    import numpy as np

    if not source.is_dir():
        raise DataError(f"{source} is not a folder; give the department's image folder (one sub-folder per class)")
    channels, height, width = shape
    index = {c: i for i, c in enumerate(classes)}
    stray = [p for p in source.iterdir() if p.is_file() and not p.name.startswith(".")]
    if stray:
        raise DataError(f"{stray[0]}: the image folder holds only class sub-folders; move the file into its class's "
                        "sub-folder")
    xs: list[NDArray[Any]] = []
    ys: list[int] = []
    for name in _class_folders(source):
        if name not in index:
            raise DataError(f"{source / name}: class '{name}' is not in the schema's classes; rename the folder or "
                            "add the class to the schema")
        for path in sorted(p for p in (source / name).iterdir() if not p.name.startswith(".")):
            if not path.is_file() or path.suffix.lower() not in SUFFIXES:
                raise DataError(f"{path} is not a .png, .jpg or .jpeg file; convert it or remove it")
            image = _open(path)
            if (image.width, image.height) != (width, height):
                raise DataError(f"{path} is {image.width}x{image.height}, the schema's images are {width}x{height}; "
                                "resize it (or propose the schema from images of this size)")
            grey = image.mode in GREY
            if channels == 1 and not grey or channels == 3 and image.mode not in COLOUR:
                want = "greyscale (mode L)" if channels == 1 else "RGB"
                raise DataError(f"{path} has mode {image.mode}, the schema's images have {channels} channel(s); "
                                f"convert it to {want}")
            pixels = np.asarray(image.convert("L") if grey else image, dtype=np.float32) / 255.0
            xs.append(pixels[None] if channels == 1 else pixels.transpose(2, 0, 1))
            ys.append(index[name])
    if not xs:
        raise DataError(f"{source} holds no images; put PNG or JPEG files in one sub-folder per class")
    return np.stack(xs).astype(np.float32), np.asarray(ys, dtype=np.int64)
