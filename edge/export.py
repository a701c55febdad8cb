"""Export of an INT8 (or fp32 reference) model to ONNX and to an ExecuTorch ``.pte``, as bytes.

ONNX: ``torch.onnx.export(dynamo=True)`` of the converted pt2e graph gives QuantizeLinear /
DequantizeLinear around integer weights, which onnxruntime fuses into INT8 kernels (QLinearConv,
QGemm); the batch dimension stays dynamic. Stack-trace metadata that the exporter attaches to every
node is dropped, so the file holds the graph and weights only.

ExecuTorch: the same graph lowered with the XNNPACK partitioner; the program takes batch 1 (an
ExecuTorch program exported with a bounded dynamic batch refuses larger inputs, so edge devices
feed it one sample at a time and use the ONNX artifact for batches). No I/O here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

import torch
from torch import nn

from quorumfl.edge.qat import MAX_BATCH, QuantizedModel
from quorumfl.errors import EdgeError

__all__ = ["ArtifactFormat", "export_artifact", "onnx_bytes", "pte_bytes", "quiet"]

# Libraries whose warnings during export are about their own internals (CUDA kernels not built into
# a CPU wheel, torchvision ops not registered, deprecated pytree hooks), not about the model.
_NOISY = ("torchao", "torch.onnx", "torch.utils._pytree", "torch.export", "torch._export", "onnxscript")


@contextmanager
def quiet() -> Iterator[None]:
    """Silence library warnings and log notes about their internals while exporting."""
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class ArtifactFormat(StrEnum):
    ONNX = "onnx"
    PTE = "pte"


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


def pte_bytes(quantized: QuantizedModel) -> bytes:
    """An ExecuTorch program (XNNPACK delegate) taking one sample of the model's input shape."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    try:
        with quiet():
            program = torch.export.export(quantized.module, (quantized.example[:1],))
            lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
            return bytes(lowered.to_executorch().buffer)
    except Exception as exc:
        raise EdgeError(f"ExecuTorch export failed: {exc}") from exc


def export_artifact(quantized: QuantizedModel, fmt: ArtifactFormat) -> bytes:
    if fmt is ArtifactFormat.ONNX:
        return onnx_bytes(quantized.module, quantized.example)
    return pte_bytes(quantized)
