"""SEAL (through ``tenseal.sealapi``) for one CKKS parameter set: context, levels, encode/decode, encrypt, NTT.

The bindings read and write objects only through file paths. On Linux each process and thread keeps
two anonymous in-memory files (``memfd_create``; SEAL opens them as ``/proc/self/fd/N``): one we
write each object into for SEAL to load, overwritten in place (SEAL reads the length its stream
header gives, so a shorter object needs no truncation), and one SEAL saves into. They have no name
in any directory, so no other process can open them by name, and the kernel frees them when the
process exits, ``os._exit`` included (a ClientApp task ends that way and runs no finaliser). After
a secret key passes through one, it is truncated to nothing. A process that forks gets new ones
(the inherited descriptors share their file with the parent), and a thread's are closed when the
thread ends. This replaced a private file per object in /dev/shm (create, write, load, remove): a
2 MB load 0.38 ms against 1.20, a load and a save 4.3 against 7.1 ms (medians of 30).
Where ``memfd_create`` does not exist each object still passes through a private file of its own
(``mkstemp``: 0600, in /dev/shm when it exists), removed as soon as it is read. Objects are parsed
with ``streams``. Everything the protocol computes itself (sums, shares, partial decryptions) is
numpy on the parsed arrays, CKKS encoding included (``encode_coefficients``, SEAL's encoder
rewritten in numpy and tested against it); SEAL does the NTT, products of NTT polynomials, the
rescale and decoding.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tenseal import sealapi

from quorumfl.aggregation.ckks.params import CkksParams
from quorumfl.aggregation.ckks.rns import residues_of_integers
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

__all__ = ["SCRATCH_PREFIX", "Seal"]

U64 = NDArray[np.uint64]
PACK = 16  # SEAL accepts ciphertexts of up to 16 polynomials (15 of ours and a row of ones per batch)
ENCODE_BLOCK = 8  # chunks encoded together: 8 × N complex values, 1 MB, per temporary
SCRATCH_PREFIX = "quorumfl-ckks-"  # then the process id: the name of every file an object passes through


def _scratch_root() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


@dataclass(frozen=True)
class _Channel:
    """The two anonymous files one process and thread hands SEAL (module docstring)."""

    pid: int
    load_fd: int
    save_fd: int

    @property
    def load_path(self) -> str:
        return f"/proc/self/fd/{self.load_fd}"

    @property
    def save_path(self) -> str:
        return f"/proc/self/fd/{self.save_fd}"


_local = threading.local()


def _memfd_works() -> bool:
    """memfd exists and SEAL can reach one through /proc/self/fd (checked once per process)."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        fd = os.memfd_create("quorumfl-ckks-probe", os.MFD_CLOEXEC)
    except OSError:
        return False
    try:
        with open(f"/proc/self/fd/{fd}", "wb"):
            return True
    except OSError:
        return False
    finally:
        os.close(fd)


_MEMFD = _memfd_works()


def _channel() -> _Channel | None:
    """This thread's channel, made on first use and again in a forked child; None without memfd."""
    if not _MEMFD:
        return None
    channel: _Channel | None = getattr(_local, "channel", None)
    if channel is None or channel.pid != os.getpid():
        # In a forked child the inherited descriptors still point at the parent's files: they are left
        # to the parent (closed here only in this process) and this process makes its own.
        if channel is not None:
            for fd in (channel.load_fd, channel.save_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
        channel = _Channel(os.getpid(), os.memfd_create("quorumfl-ckks-load", os.MFD_CLOEXEC),
                           os.memfd_create("quorumfl-ckks-save", os.MFD_CLOEXEC))
        # closed when the thread ends and its local goes; only by the process that made them (a forked
        # child closes the inherited numbers above, and may have reused them for its own since)
        weakref.finalize(channel, _close, channel.pid, channel.load_fd, channel.save_fd)
        _local.channel = channel
    return channel


def _close(pid: int, *fds: int) -> None:
    if os.getpid() == pid:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _write_all(fd: int, raw: bytes) -> None:
    view, offset = memoryview(raw), 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    parts, offset = [], 0
    while offset < size:
        part = os.pread(fd, size - offset, offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


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
        # parms_id of each data level, keyed by how many primes it keeps; the key level holds all.
        self.levels: dict[int, ParmsId] = {}
        data = self.context.first_context_data()
        while data is not None:
            self.levels[len(data.parms().coeff_modulus())] = tuple(data.parms_id())
            data = data.next_context_data()
        self.key_level: ParmsId = tuple(self.context.key_parms_id())
        probe = sealapi.Ciphertext(self.context)
        self.version = stream_version(self.save(probe))
        # encode_coefficients: where slot i and its conjugate sit among the N evaluation points, and ζ^(−j)·Δ/N
        degree, slots, position = params.poly_degree, params.slots, 1
        self._slot_real = np.empty(slots, dtype=np.int64)
        self._slot_conj = np.empty(slots, dtype=np.int64)
        for i in range(slots):
            self._slot_real[i] = (position - 1) >> 1
            self._slot_conj[i] = (2 * degree - position - 1) >> 1
            position = position * 3 % (2 * degree)
        self._twist = np.exp(-1j * np.pi * np.arange(degree) / degree) * (2.0**params.scale_bits / degree)

    # ---- bytes <-> SEAL objects -----------------------------------------------------------------
    @staticmethod
    def _private_file() -> tuple[int, str]:
        """A new empty file only this user can read (``mkstemp``: 0600, O_EXCL; /dev/shm is sticky,
        so no other user can swap it before SEAL opens it by name). Only where memfd does not exist."""
        return tempfile.mkstemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=_scratch_root())

    def save(self, obj: Any, *, secret: bool = False) -> bytes:
        """SEAL's stream of ``obj`` (``secret``: the channel is emptied once it is read)."""
        channel = _channel()
        if channel is not None:
            try:
                obj.save(channel.save_path)  # SEAL truncates the file and writes into it
                return _read_all(channel.save_fd)
            finally:
                if secret:
                    os.ftruncate(channel.save_fd, 0)
        fd, path = self._private_file()
        try:
            os.close(fd)
            obj.save(path)  # SEAL truncates the file and writes into it: it stays 0600
            with open(path, "rb") as fh:
                return fh.read()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def load(self, kind: type, raw: bytes, *, secret: bool = False) -> Any:
        """A SEAL object of ``kind`` from its stream ``raw``; SEAL's refusal as ``SecureAggregationError``."""
        channel = _channel()
        if channel is not None:
            try:
                _write_all(channel.load_fd, raw)
                return self._load_from(kind, channel.load_path)
            finally:
                if secret:
                    os.ftruncate(channel.load_fd, 0)
        fd, path = self._private_file()
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(raw)
            return self._load_from(kind, path)
        finally:
            os.remove(path)

    def _load_from(self, kind: type, path: str) -> Any:
        obj = kind()
        try:
            obj.load(self.context, path)
        except (RuntimeError, ValueError) as exc:
            raise SecureAggregationError(f"SEAL refused a {kind.__name__}: {exc}") from exc
        return obj

    def primes_at(self, count: int) -> tuple[int, ...]:
        return self.primes[:count]

    # ---- keys -------------------------------------------------------------------------------------
    def new_secret(self) -> tuple[Any, U64]:
        """A fresh SEAL secret key and its key-level NTT residues ``[prime, coeff]``."""
        secret = sealapi.KeyGenerator(self.context).secret_key()
        return secret, parse_plaintext(self.save(secret, secret=True), degree=self.params.poly_degree).coeffs

    def secret_from(self, coeffs: U64) -> Any:
        """A SEAL SecretKey holding the given key-level residues (for reference decryption in tests)."""
        raw = build_plaintext(PlaintextData(self.key_level, 1.0, coeffs), version=self.version)
        return self.load(sealapi.SecretKey, raw, secret=True)

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
    def encode_coefficients(self, values: NDArray[np.float64], primes: int) -> U64:
        """``values`` in chunks of N (two per complex slot: the first N/2 as real parts, the next N/2 as
        imaginary parts) as plaintext polynomials at scale Δ, in the coefficient domain, residues at
        ``primes`` primes: ``[chunk, prime, coeff]`` (``to_ntt`` gives SEAL's plaintext).

        This is SEAL's ``CKKSEncoder.encode`` in numpy, one FFT per chunk instead of 2 × 138 SEAL
        calls and file round trips for a 1.1M-parameter update: slot i is the value at ζ^(3^i mod
        2N) and its conjugate at ζ^(−3^i) (ζ = e^(iπ/N), SEAL's order), so the coefficients are
        m_j = ζ^(−j)·DFT(v)_j / N, scaled by Δ and rounded. A coefficient of up to 2^104 is reduced
        per prime exactly by ``rns.residues_of_integers``. Tests decode it with SEAL's decoder and
        compare it with SEAL's encoder."""
        if primes not in self.levels:
            raise SecureAggregationError(f"no ciphertext level with {primes} primes")
        degree, slots = self.params.poly_degree, self.params.slots
        chunks = self.params.chunks(values.shape[0])
        padded = np.zeros(chunks * degree)
        padded[: values.shape[0]] = values
        halves = padded.reshape(chunks, 2, slots)
        out = np.empty((chunks, primes, degree), dtype=np.uint64)
        for start in range(0, chunks, ENCODE_BLOCK):  # blocks of chunks: the temporaries stay a few MB
            self._encode_block(halves[start: start + ENCODE_BLOCK], out[start: start + ENCODE_BLOCK])
        return out

    def _encode_block(self, halves: NDArray[np.float64], out: U64) -> None:
        values = np.empty((halves.shape[0], self.params.slots), dtype=np.complex128)
        values.real = halves[:, 0]
        values.imag = halves[:, 1]
        spread = np.empty((halves.shape[0], self.params.poly_degree), dtype=np.complex128)
        spread[:, self._slot_real] = values
        spread[:, self._slot_conj] = np.conjugate(values, out=values)
        coefficients = np.fft.fft(spread, axis=1)
        coefficients *= self._twist
        residues_of_integers(np.round(coefficients.real), self.primes_at(out.shape[1]), out)

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

    def _each_batch(self, inputs: Sequence[tuple[U64, bool]], *, out_primes: int, op: Callable[[list[Any]], Any]) -> U64:
        """``op`` on ``inputs`` (polynomials ``[poly, prime, coeff]`` of one shape, each with whether it is
        in NTT form) packed as ciphertexts of 15 polynomials and a filler row of ⌊q/2⌋ (dropped after):
        ``op`` takes one ciphertext per input and returns the one kept. SEAL takes at most 16
        polynomials per ciphertext and refuses a "transparent" one (every polynomial after the first
        zero), which a zero update would otherwise be; ⌊q/2⌋ stays non-zero through the NTT, a
        product and a rescale. Every batch costs a file round trip per input and one for the result
        (SEAL's ``save`` compresses with zstd), so batches are as large as SEAL allows and one call
        does every step it can."""
        count, primes, degree = inputs[0][0].shape
        if any(polys.shape != inputs[0][0].shape for polys, _ in inputs):
            raise SecureAggregationError("polynomial batches of different shapes")
        parms = self.levels[primes]
        filler = np.broadcast_to(np.asarray(self.primes_at(primes), dtype=np.uint64)[:, None] // np.uint64(2),
                                 (1, primes, degree))
        out = np.empty((count, out_primes, degree), dtype=np.uint64)
        for start in range(0, count, PACK - 1):
            cts = [self.load(sealapi.Ciphertext, build_ciphertext(CiphertextData(
                parms, ntt, 2.0**self.params.scale_bits, np.concatenate([polys[start: start + PACK - 1], filler])),
                version=self.version)) for polys, ntt in inputs]
            out[start: start + PACK - 1] = parse_ciphertext(self.save(op(cts))).polys[:-1]
        return out

    def _in_place(self, step: Callable[[Any], None]) -> Callable[[list[Any]], Any]:
        def apply(cts: list[Any]) -> Any:
            step(cts[0])
            return cts[0]
        return apply

    def to_ntt(self, coeffs: U64) -> U64:
        """NTT (SEAL's ordering) of coefficient-domain polynomials ``[poly, prime, coeff]`` at a data level."""
        return self._each_batch([(coeffs, False)], out_primes=coeffs.shape[1],
                                op=self._in_place(self.evaluator.transform_to_ntt_inplace))

    def rescale(self, polys: U64) -> U64:
        """round(x / q_L) of NTT polynomials ``[poly, prime, coeff]`` at a data level of L ≥ 2 primes, as
        ``[poly, prime − 1, coeff]`` (SEAL's ``rescale_to_next``: exact RNS division by the last prime
        with rounding)."""
        self._check_rescale(polys.shape[1])
        return self._each_batch([(polys, True)], out_primes=polys.shape[1] - 1,
                                op=self._in_place(self.evaluator.rescale_to_next_inplace))

    def _check_rescale(self, primes: int) -> None:
        if primes < 2 or primes not in self.levels:
            raise SecureAggregationError(f"cannot rescale polynomials at {primes} primes")

    def _plain(self, plain: U64) -> Any:
        parms = self.levels[plain.shape[0]]
        return self.load(sealapi.Plaintext, build_plaintext(PlaintextData(parms, 1.0, plain), version=self.version))

    def multiply(self, polys: U64, plain: U64) -> U64:
        """Element-wise product mod q of NTT polynomials ``[poly, prime, coeff]`` with one NTT ``[prime, coeff]``.

        SEAL's ``multiply_plain`` on ciphertexts packed 15 polynomials at a time (~9 ms per 2M
        residues; numpy has no 128-bit product).
        """
        pt = self._plain(plain)
        return self._each_batch([(polys, True)], out_primes=polys.shape[1],
                                op=self._in_place(lambda ct: self.evaluator.multiply_plain_inplace(ct, pt)))

    def ntt_with_product(self, coeffs: U64, polys: U64, plain: U64, *, subtract: bool, rescale: bool) -> U64:
        """NTT(coeffs) − polys·plain (``subtract``) or + polys·plain, for coefficient-domain ``coeffs`` and
        NTT ``polys`` (both ``[poly, prime, coeff]``) and one NTT ``plain`` ``[prime, coeff]``; then, with
        ``rescale``, divided by q_L and rounded (``rescale``). The same as ``to_ntt``, ``multiply``, a
        modular difference or sum and ``rescale`` one after the other, in one pass of SEAL calls: an
        encryption (Δ·x + e − a·s) and a partial decryption (flooding + a·λσ) each cost one saved
        ciphertext per batch instead of three."""
        primes = coeffs.shape[1]
        if rescale:
            self._check_rescale(primes)
        pt = self._plain(plain)
        combine = self.evaluator.sub_inplace if subtract else self.evaluator.add_inplace

        def step(cts: list[Any]) -> Any:
            first, product = cts
            self.evaluator.transform_to_ntt_inplace(first)
            self.evaluator.multiply_plain_inplace(product, pt)
            combine(first, product)
            if rescale:
                self.evaluator.rescale_to_next_inplace(first)
            return first

        return self._each_batch([(coeffs, False), (polys, True)], out_primes=primes - 1 if rescale else primes, op=step)

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
