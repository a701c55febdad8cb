"""Export of an edge model to ONNX and to an ExecuTorch ``.pte``, as bytes, at one of three precisions.

- ``int8``: the QAT-converted pt2e graph (``quorumfl.edge.qat``): INT8 weights and activations.
- ``dynamic``: INT8 weights, activations quantised on the fly, by onnxruntime's own
  ``quantize_dynamic`` on the fp32 ONNX graph (MatMulInteger, and the embedding table stored in INT8
  and gathered through DequantizeLinear). For models that static INT8 cannot serve (a table lookup,
  see ``qat.int8_obstacle``). ONNX only: an ExecuTorch program of this form is not built here.
- ``fp32``: the model as trained, for devices that have the memory, or as the honest fallback.

A model may offer an ``export_form()`` (the text task's ``HashedBag``): the same function and weights
in operators that exporters handle (a masked mean of gathered embeddings instead of
``embedding_bag``'s ragged form).

ONNX: ``torch.onnx.export(dynamo=True)`` of the converted pt2e graph gives QuantizeLinear /
DequantizeLinear around integer weights, which onnxruntime fuses into INT8 kernels (QLinearConv,
QGemm); the batch dimension stays dynamic. Stack-trace metadata that the exporter attaches to every
node is dropped, so the file holds the graph and weights only.

ExecuTorch: the same graph lowered with the XNNPACK partitioner; the program takes batch 1 (an
ExecuTorch program exported with a bounded dynamic batch refuses larger inputs, so edge devices
feed it one sample at a time and use the ONNX artifact for batches). No I/O here beyond the
temporary files onnxruntime's quantiser reads and writes.
"""

from __future__ import annotations

import logging
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from quorumfl.errors import ConfigError, EdgeError
from quorumfl.training.qat import MAX_BATCH, quiet

__all__ = ["ArtifactFormat", "Precision", "dynamic_onnx_bytes", "export_artifact", "export_form", "onnx_bytes",
           "parse_option", "parse_precision", "pte_bytes", "quiet"]

class ArtifactFormat(StrEnum):
    ONNX = "onnx"
    PTE = "pte"


_E = TypeVar("_E", bound=StrEnum)


class Precision(StrEnum):
    INT8 = "int8"
    DYNAMIC = "dynamic"
    FP32 = "fp32"


def parse_option(kind: type[_E], value: str, option: str) -> _E:
    """``value`` as a member of ``kind``, or a ConfigError naming ``option`` and the choices."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{option} must be one of {[m.value for m in kind]}, got {value!r}") from None


def parse_precision(value: str) -> Precision:
    return parse_option(Precision, value, "--precision")


def export_form(model: nn.Module) -> nn.Module:
    """The model in exportable operators (its ``export_form()`` when it has one), in eval mode."""
    form = getattr(model, "export_form", None)
    exported = form() if callable(form) else model
    if not isinstance(exported, nn.Module):
        raise EdgeError(f"{type(model).__name__}.export_form() returned {type(exported).__name__}, not a torch module")
    return exported.eval()


def onnx_bytes(module: nn.Module | torch.fx.GraphModule, example: torch.Tensor) -> bytes:
    """An ONNX model with a dynamic batch dimension (opset of the installed exporter)."""
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    if isinstance(module, nn.Module) and not isinstance(module, torch.fx.GraphModule):
        module = module.eval()
    try:
        with quiet():
            program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
            exported = torch.onnx.export(program, (example,), dynamo=True, verbose=False)
    except Exception as exc:
        raise EdgeError(f"ONNX export failed: {exc}") from exc
    if exported is None:
        raise EdgeError("ONNX export returned no program")
    proto = exported.model_proto
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    del proto.metadata_props[:]
    return bytes(proto.SerializeToString())


def dynamic_onnx_bytes(fp32_onnx: bytes) -> bytes:
    """The fp32 ONNX model with INT8 weights (onnxruntime's dynamic quantisation)."""
    root = logging.getLogger()  # the quantiser logs a preprocessing hint on the root logger
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        with quiet(), tempfile.TemporaryDirectory(prefix="quorumfl-dynamic-") as folder:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            source, target = Path(folder) / "fp32.onnx", Path(folder) / "dynamic.onnx"
            source.write_bytes(fp32_onnx)
            quantize_dynamic(source, target, weight_type=QuantType.QInt8)
            return target.read_bytes()
    except Exception as exc:  # onnxruntime raises many types; name the step
        raise EdgeError(f"dynamic quantisation failed: {exc}") from exc
    finally:
        root.setLevel(level)


def pte_bytes(module: nn.Module, example: torch.Tensor) -> bytes:
    """An ExecuTorch program (XNNPACK delegate) taking one sample of the model's input shape."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    try:
        with quiet():
            program = torch.export.export(module, (example[:1],))
            lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
            return bytes(lowered.to_executorch().buffer)
    except Exception as exc:
        raise EdgeError(f"ExecuTorch export failed: {exc}") from exc


def export_artifact(module: nn.Module, example: torch.Tensor, fmt: ArtifactFormat, precision: Precision) -> bytes:
    """One artifact: ``module`` is the converted INT8 graph for ``int8``, the fp32 export form otherwise."""
    if fmt is ArtifactFormat.ONNX:
        fp32_or_int8 = onnx_bytes(module, example)
        return dynamic_onnx_bytes(fp32_or_int8) if precision is Precision.DYNAMIC else fp32_or_int8
    if precision is Precision.DYNAMIC:
        raise EdgeError("dynamic quantisation is exported as ONNX only (onnxruntime runs it); ask for the onnx "
                        "format, or --precision fp32 for an ExecuTorch program")
    return pte_bytes(module, example)
