"""Run an exported edge model: ONNX through onnxruntime (CPU, INT8 kernels), ``.pte`` through the
ExecuTorch runtime. Inputs are checked against the shape the artifact declares before they reach
the runtime, so a wrong input gets an error naming the expected shape rather than a runtime crash.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from quorumfl.edge.export import ArtifactFormat
from quorumfl.errors import EdgeError

__all__ = ["EdgeModel", "load_model"]


class EdgeModel:
    """Logits for a float32 batch ``(N, *input_shape)``."""

    def __init__(self, payload: bytes, fmt: ArtifactFormat, input_shape: tuple[int, ...], *, threads: int = 1) -> None:
        self.format = fmt
        self.input_shape = tuple(input_shape)
        try:
            if fmt is ArtifactFormat.ONNX:
                import onnxruntime as ort

                options = ort.SessionOptions()
                options.intra_op_num_threads = threads
                options.inter_op_num_threads = 1
                options.log_severity_level = 3
                self._session = ort.InferenceSession(payload, options, providers=["CPUExecutionProvider"])
                self._input = self._session.get_inputs()[0].name
            else:
                from executorch.runtime import Runtime

                # The program and its buffer must outlive the method (it points into them).
                self._payload = payload
                self._program = Runtime.get().load_program(payload)
                self._method = self._program.load_method("forward")
        except Exception as exc:
            raise EdgeError(f"cannot load the {fmt} model: {exc}") from exc

    def __call__(self, x: NDArray[np.float32]) -> NDArray[np.float32]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != len(self.input_shape) + 1 or tuple(x.shape[1:]) != self.input_shape:
            raise EdgeError(f"input has shape {x.shape}; the model takes (N, {', '.join(map(str, self.input_shape))})")
        if not np.isfinite(x).all():
            raise EdgeError("input contains NaN or Inf values")
        if self.format is ArtifactFormat.ONNX:
            return np.asarray(self._session.run(None, {self._input: x})[0], dtype=np.float32)
        import torch

        rows = [self._method.execute([torch.from_numpy(x[i : i + 1].copy())])[0].numpy() for i in range(len(x))]
        return np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, 0), np.float32)


def load_model(payload: bytes, fmt: ArtifactFormat | str, input_shape: tuple[int, ...], *, threads: int = 1) -> EdgeModel:
    return EdgeModel(payload, ArtifactFormat(fmt), input_shape, threads=threads)
