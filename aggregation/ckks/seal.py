"""SEAL (through ``tenseal.sealapi``) for one CKKS parameter set: context, levels, encode/decode, encrypt, NTT.

The bindings read and write objects only through file paths, so objects pass through a private
scratch directory (in /dev/shm when it exists: memory, not disk) and are parsed with
``streams``; nothing secret is ever written there except during a secret-key round trip, which
is deleted at once. Everything the protocol computes itself (sums, shares, partial decryptions)
is numpy on the parsed arrays; SEAL does what needs its exact conventions: CKKS encoding, the
NTT of error and flooding noise, and products of NTT polynomials.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tenseal import sealapi

from quorumfl.aggregation.ckks.params import CkksParams
from quorumfl.aggregation.ckks.streams import (
    CiphertextData,
    ParmsId,
    PlaintextData,
    build_ciphertext,
    build_plaintext,
    parse_ciphertext,
    parse_plaintext,
    stream_version,
)
from quorumfl.errors import SecureAggregationError

__all__ = ["Seal"]

U64 = NDArray[np.uint64]
PACK = 16  # SEAL accepts ciphertexts of up to 16 polynomials: NTT transforms go 16 at a time


def _scratch_root() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class Seal:
    """A SEAL context for ``params`` plus the conversions the protocol needs."""

    _lock = threading.Lock()
    _cache: dict[CkksParams, Seal] = {}

    @classmethod
    def of(cls, params: CkksParams) -> Seal:
        """One context per parameter set and process (building one costs ~10 ms and some memory)."""
        with cls._lock:
            if params not in cls._cache:
                cls._cache[params] = cls(params)
            return cls._cache[params]

    def __init__(self, params: CkksParams) -> None:
        self.params = params
        parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
        parms.set_poly_modulus_degree(params.poly_degree)
        parms.set_coeff_modulus(sealapi.CoeffModulus.Create(params.poly_degree, list(params.coeff_bits)))
        self.context = sealapi.SEALContext(parms, True, sealapi.SEC_LEVEL_TYPE.TC128)
        if not self.context.parameters_set():
            raise SecureAggregationError(f"SEAL rejects the CKKS parameters: {self.context.parameters_error_message()}")
        self.primes: tuple[int, ...] = tuple(m.value() for m in parms.coeff_modulus())
        self.encoder = sealapi.CKKSEncoder(self.context)
        self.evaluator = sealapi.Evaluator(self.context)
        self._scratch = tempfile.mkdtemp(prefix="quorumfl-ckks-", dir=_scratch_root())
        os.chmod(self._scratch, 0o700)
        self._counter = 0
        # parms_id of each data level, keyed by how many primes it keeps; the key level holds all.
        self.levels: dict[int, ParmsId] = {}
        data = self.context.first_context_data()
        while data is not None:
            self.levels[len(data.parms().coeff_modulus())] = tuple(data.parms_id())
            data = data.next_context_data()
        self.key_level: ParmsId = tuple(self.context.key_parms_id())
        probe = sealapi.Ciphertext(self.context)
        self.version = stream_version(self.save(probe))

    def __del__(self) -> None:
        shutil.rmtree(getattr(self, "_scratch", ""), ignore_errors=True)

    # ---- bytes <-> SEAL objects -----------------------------------------------------------------
    def _path(self) -> str:
        self._counter += 1
        return os.path.join(self._scratch, f"{os.getpid()}-{threading.get_ident()}-{self._counter}")

    def save(self, obj: Any) -> bytes:
        path = self._path()
        try:
            obj.save(path)
            with open(path, "rb") as fh:
                return fh.read()
        finally:
            if os.path.exists(path):
                os.remove(path)

    def load(self, kind: type, raw: bytes) -> Any:
        path = self._path()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(raw)
            obj = kind()
            try:
                obj.load(self.context, path)
            except (RuntimeError, ValueError) as exc:
                raise SecureAggregationError(f"SEAL refused a {kind.__name__}: {exc}") from exc
            return obj
        finally:
            os.remove(path)

    def primes_at(self, count: int) -> tuple[int, ...]:
        return self.primes[:count]

    # ---- keys -------------------------------------------------------------------------------------
    def new_secret(self) -> tuple[Any, U64]:
        """A fresh SEAL secret key and its key-level NTT residues ``[prime, coeff]``."""
        secret = sealapi.KeyGenerator(self.context).secret_key()
        return secret, parse_plaintext(self.save(secret), degree=self.params.poly_degree).coeffs

    def secret_from(self, coeffs: U64) -> Any:
        """A SEAL SecretKey holding the given key-level residues (for reference decryption in tests)."""
        raw = build_plaintext(PlaintextData(self.key_level, 1.0, coeffs), version=self.version)
        return self.load(sealapi.SecretKey, raw)

    def zero_encryption(self, secret: Any) -> CiphertextData:
        """Symmetric encryption of zero at the key level: c0 + c1·s = −e with SEAL's error distribution."""
        ct = sealapi.Ciphertext(self.context)
        sealapi.Encryptor(self.context, secret).encrypt_zero_symmetric(list(self.key_level), ct)
        return parse_ciphertext(self.save(ct))

    def public_key(self, b: U64, a: U64) -> bytes:
        """PublicKey stream for the key-level pair (b, a)."""
        data = CiphertextData(self.key_level, True, 1.0, np.stack([b, a]))
        raw = build_ciphertext(data, version=self.version)
        self.load(sealapi.PublicKey, raw)  # SEAL checks it
        return raw

    # ---- vectors ------------------------------------------------------------------------------------
    def encode(self, values: NDArray[np.float64], primes: int) -> U64:
        """``values`` in chunks of N (two per complex slot: the first N/2 as real parts, the next N/2 as
        imaginary parts) as NTT plaintexts at scale Δ and ``primes`` primes: ``[chunk, prime, coeff]``."""
        if primes not in self.levels:
            raise SecureAggregationError(f"no ciphertext level with {primes} primes")
        parms = list(self.levels[primes])
        slots, per = self.params.slots, self.params.values_per_ciphertext
        chunks = self.params.chunks(values.shape[0])
        padded = np.zeros(chunks * per)
        padded[: values.shape[0]] = values
        out = np.empty((chunks, primes, self.params.poly_degree), dtype=np.uint64)
        scale = 2.0**self.params.scale_bits
        for c in range(chunks):
            piece = padded[c * per: (c + 1) * per]
            plain = sealapi.Plaintext()
            self.encoder.encode((piece[:slots] + 1j * piece[slots:]).tolist(), parms, scale, plain)
            coeffs = parse_plaintext(self.save(plain), degree=self.params.poly_degree).coeffs
            if coeffs.shape != (primes, self.params.poly_degree):
                raise SecureAggregationError(f"SEAL produced a plaintext of shape {coeffs.shape}")
            out[c] = coeffs
        return out

    def _unpack(self, plain: Any) -> NDArray[np.float64]:
        """One decoded plaintext's N/2 complex slots as its N real values (real parts, then imaginary)."""
        z = np.asarray(self.encoder.decode_complex(plain), dtype=np.complex128)
        return np.concatenate([z.real, z.imag])

    def decode(self, coeffs: U64, length: int, *, scale: float | None = None) -> NDArray[np.float64]:
        """Decode ``[chunk, prime, coeff]`` NTT plaintexts at ``scale`` (Δ unless given) to ``length`` values."""
        chunks, primes, _ = coeffs.shape
        parms = self.levels[primes]
        scale = 2.0**self.params.scale_bits if scale is None else scale
        per = self.params.values_per_ciphertext
        out = np.empty(chunks * per)
        for c in range(chunks):
            plain = self.load(sealapi.Plaintext, build_plaintext(PlaintextData(parms, scale, coeffs[c]), version=self.version))
            out[c * per: (c + 1) * per] = self._unpack(plain)
        return out[:length]

    def to_ntt(self, coeffs: U64) -> U64:
        """NTT (SEAL's ordering) of coefficient-domain polynomials ``[poly, prime, coeff]`` at a data level."""
        polys, primes, _ = coeffs.shape
        parms = self.levels[primes]
        out = np.empty_like(coeffs)
        for start in range(0, polys, PACK):
            batch = coeffs[start: start + PACK]
            if batch.shape[0] == 1:  # a ciphertext needs two polynomials: pad with a copy
                batch = np.concatenate([batch, batch])
            ct = self.load(sealapi.Ciphertext, build_ciphertext(CiphertextData(parms, False, 1.0, batch), version=self.version))
            self.evaluator.transform_to_ntt_inplace(ct)
            done = parse_ciphertext(self.save(ct)).polys
            out[start: start + PACK] = done[: min(PACK, polys - start)]
        return out

    def rescale(self, polys: U64) -> U64:
        """round(x / q_L) of NTT polynomials ``[poly, prime, coeff]`` at a data level of L ≥ 2 primes, as
        ``[poly, prime − 1, coeff]`` (SEAL's ``rescale_to_next`` on ciphertexts packed 16 polynomials at
        a time: exact RNS division by the last prime with rounding)."""
        polys_n, primes, degree = polys.shape
        if primes < 2 or primes not in self.levels:
            raise SecureAggregationError(f"cannot rescale polynomials at {primes} primes")
        parms = self.levels[primes]
        out = np.empty((polys_n, primes - 1, degree), dtype=np.uint64)
        for start in range(0, polys_n, PACK):
            batch = polys[start: start + PACK]
            if batch.shape[0] == 1:
                batch = np.concatenate([batch, batch])
            ct = self.load(sealapi.Ciphertext, build_ciphertext(
                CiphertextData(parms, True, 2.0**self.params.scale_bits, batch), version=self.version))
            self.evaluator.rescale_to_next_inplace(ct)
            out[start: start + PACK] = parse_ciphertext(self.save(ct)).polys[: min(PACK, polys_n - start)]
        return out

    def multiply(self, polys: U64, plain: U64) -> U64:
        """Element-wise product mod q of NTT polynomials ``[poly, prime, coeff]`` with one NTT ``[prime, coeff]``.

        SEAL's ``multiply_plain`` on ciphertexts packed 16 polynomials at a time (~9 ms per 2M
        residues; numpy has no 128-bit product).
        """
        polys_n, primes, _ = polys.shape
        parms = self.levels[primes]
        pt = self.load(sealapi.Plaintext, build_plaintext(PlaintextData(parms, 1.0, plain), version=self.version))
        out = np.empty_like(polys)
        for start in range(0, polys_n, PACK):
            batch = polys[start: start + PACK]
            if batch.shape[0] == 1:
                batch = np.concatenate([batch, batch])
            ct = self.load(sealapi.Ciphertext, build_ciphertext(CiphertextData(parms, True, 1.0, batch), version=self.version))
            self.evaluator.multiply_plain_inplace(ct, pt)
            out[start: start + PACK] = parse_ciphertext(self.save(ct)).polys[: min(PACK, polys_n - start)]
        return out

    def decrypt_reference(self, secret: Any, c0: U64, c1: U64, length: int) -> NDArray[np.float64]:
        """SEAL's own Decryptor on the ciphertexts (c0, c1), each ``[chunk, prime, coeff]`` (tests' reference)."""
        chunks, primes, _ = c0.shape
        parms = self.levels[primes]
        decryptor = sealapi.Decryptor(self.context, secret)
        per = self.params.values_per_ciphertext
        out = np.empty(chunks * per)
        for c in range(chunks):
            ct = self.load(sealapi.Ciphertext, build_ciphertext(
                CiphertextData(parms, True, 2.0**self.params.scale_bits, np.stack([c0[c], c1[c]])), version=self.version))
            plain = sealapi.Plaintext()
            decryptor.decrypt(ct, plain)
            out[c * per: (c + 1) * per] = self._unpack(plain)
        return out[:length]
