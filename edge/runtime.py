"""Run an exported edge model: ONNX through onnxruntime (CPU, INT8 kernels), ``.pte`` through the
ExecuTorch runtime. Inputs are checked against the shape and dtype the artifact declares (float32
features or images; int64 token ids, which must be non-negative) before they reach the runtime, so a
wrong input gets an error naming what the model takes rather than a runtime crash.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.edge.export import ArtifactFormat
from quorumfl.errors import EdgeError

__all__ = ["EdgeModel", "load_model"]


class EdgeModel:
    """Outputs (class logits, or the scaled regression target) for a batch ``(N, *input_shape)``."""

    def __init__(self, payload: bytes, fmt: ArtifactFormat, input_shape: tuple[int, ...], *, threads: int = 1,
                 input_dtype: str = "float32") -> None:
        if input_dtype not in ("float32", "int64"):
            raise EdgeError(f"the model's input dtype {input_dtype!r} is not float32 or int64; update the edge client")
        self.format = fmt
        self.input_shape = tuple(input_shape)
        self.input_dtype = input_dtype
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

    def __call__(self, x: NDArray[Any]) -> NDArray[np.float32]:
        x = np.asarray(x)
        if x.ndim != len(self.input_shape) + 1 or tuple(x.shape[1:]) != self.input_shape:
            raise EdgeError(f"input has shape {x.shape}; the model takes (N, {', '.join(map(str, self.input_shape))})")
        if self.input_dtype == "int64":
            if x.dtype.kind not in "iu":
                raise EdgeError(f"input is {x.dtype}; the model takes int64 token ids (the task's encoding of a text)")
            x = np.ascontiguousarray(x, dtype=np.int64)
            if x.size and int(x.min()) < 0:
                raise EdgeError("input has negative token ids; encode the text with the task's reader")
        else:
            x = np.ascontiguousarray(x, dtype=np.float32)
            if not np.isfinite(x).all():
                raise EdgeError("input contains NaN or Inf values")
        if self.format is ArtifactFormat.ONNX:
            return np.asarray(self._session.run(None, {self._input: x})[0], dtype=np.float32)
        import torch

        rows = [self._method.execute([torch.from_numpy(x[i : i + 1].copy())])[0].numpy() for i in range(len(x))]
        return np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, 0), np.float32)


def load_model(payload: bytes, fmt: ArtifactFormat | str, input_shape: tuple[int, ...], *, threads: int = 1,
               input_dtype: str = "float32") -> EdgeModel:
    return EdgeModel(payload, ArtifactFormat(fmt), input_shape, threads=threads, input_dtype=input_dtype)
