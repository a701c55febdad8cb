"""Edge devices: quantisation-aware training to INT8 (torchao pt2e, XNNPACK quantizer), ONNX and
ExecuTorch exports, the Ed25519-signed artifact registry, and resumable gRPC model sync.

Modules: ``qat`` (fine-tune and convert), ``export`` (ONNX / .pte bytes), ``runtime`` (run an
artifact), ``manifest`` (what is signed, the device's checks), ``signing`` (keys), ``registry``
(promotion on the server), ``service`` (the gRPC server), ``sync`` (the device's client).
"""
