"""GGUF tensor blocks → MLX's forms, in numpy: float arrays, or affine-quantized triples (packed weight,
scales, biases; ``w = scale * q + bias`` per group of 32).

Exact where MLX's affine form holds the block: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 (scale and bias are the block's d,
m, -8d, -16d, -128d), Q4_K and Q5_K (scale ``d * sc``, bias ``-dmin * m`` per 32-weight sub-block). Scales and
biases are stored as float16 like every MLX model: for Q4_K/Q5_K that rounds ``d * sc`` to 11 bits (at most
2^-11 of a step). Q6_K, Q3_K and Q2_K scale every 16 weights, which MLX cannot (its smallest group is 32):
their weights are dequantized and requantized per 32 (min-max, round to nearest) with more bits than the
file's, as :data:`REQUANT_BITS` says; bench/RESULTS.md has the errors measured. Layouts follow ggml's
``ggml-common.h`` and ``dequantize_row_*``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ModelError

__all__ = ["BLOCKS", "FLOAT_TYPES", "GROUP", "REQUANT_BITS", "TYPE_BITS", "bits_of", "convert_rows", "pack"]

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30

GROUP = 32
# GGML type → (weights per block, bytes per block).
BLOCKS = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2),
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}  # fmt: skip
FLOAT_TYPES = {F32: "F32", F16: "F16", BF16: "BF16"}
# Exact types: the file's own bit width.
TYPE_BITS = {Q4_0: 4, Q4_1: 4, Q5_0: 5, Q5_1: 5, Q8_0: 8, Q4_K: 4, Q5_K: 5}
# 16-weight-group types, requantized to 32-weight groups with more bits than the file's: 6 keeps Q6_K's error
# below Q5_K's at ~10% more bytes than a Q4_K_M file (8 would cost ~18%), and keeps Q2_K's greedy answers
# llama.cpp's, which at 4 bits parted within 3 tokens (bench/RESULTS.md: ``r-requant-error``, ``r-requant``).
REQUANT_BITS = {Q6_K: 6, Q3_K: 6, Q2_K: 6}


def bits_of(ggml_type: int) -> int:
    """The MLX bit width a quantized GGML type becomes."""
    return TYPE_BITS.get(ggml_type) or REQUANT_BITS[ggml_type]


@dataclass
class Affine:
    """Unpacked affine form of some rows: ``q`` (uint8, rows x cols) and float32 ``scales``/``biases``."""

    q: np.ndarray
    scales: np.ndarray
    biases: np.ndarray


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned values (rows x cols, each < 2**bits) the way MLX does: a little-endian bit stream of
    consecutive values, lowest bits first, as uint32 words (rows x cols·bits/32)."""
    rows, cols = q.shape
    if bits in (2, 4, 8):
        # Whole values per byte: little-endian bytes are already MLX's word order.
        per = 8 // bits
        byte = q[:, 0::per].astype(np.uint8)
        for k in range(1, per):
            byte |= q[:, k::per] << (k * bits)
        words: np.ndarray = np.ascontiguousarray(byte).view("<u4")
        return words
    # 3, 5, 6 bits: `per` values fill whole bytes (8 of 3 or 5 bits, 4 of 6), gathered in a uint64 each
    per = 8 // int(np.gcd(8, bits))
    wide = np.uint32 if per * bits <= 32 else np.uint64
    gathered = q[:, 0::per].astype(wide)
    for k in range(1, per):
        gathered |= q[:, k::per].astype(wide) << wide(k * bits)
    nbytes, size = per * bits // 8, np.dtype(wide).itemsize
    stream = gathered.astype(f"<u{size}").view(np.uint8).reshape(rows, cols // per, size)[..., :nbytes]
    packed: np.ndarray = np.ascontiguousarray(stream).reshape(rows, cols * bits // 8).view("<u4")
    return packed


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    # Q4_0/Q4_1/Q5_x: 16 bytes → weights 0-15 in the low nibbles, 16-31 in the high.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    # Q5_0/Q5_1: 4 bytes of bits, weight j's fifth bit is bit j.
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes → 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = sc.astype(np.uint8)
    scales = np.empty((*s.shape[:-1], 8), np.uint8)
    mins = np.empty_like(scales)
    scales[..., :4] = s[..., 0:4] & 63
    mins[..., :4] = s[..., 4:8] & 63
    scales[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return scales, mins


def _affine(blocks: np.ndarray, ggml_type: int) -> Affine:
    """Blocks (n x bytes per block) of an exactly representable type → q, scale and bias per 32 weights."""
    n = blocks.shape[0]
    if ggml_type in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        d = _f16(blocks[:, 0:2])[:, 0]
        if ggml_type == Q8_0:
            q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return Affine(q, d[:, None], (-128.0 * d)[:, None])
        has_min = ggml_type in (Q4_1, Q5_1)
        m = _f16(blocks[:, 2:4])[:, 0] if has_min else None
        start = 4 if has_min else 2
        if ggml_type in (Q5_0, Q5_1):
            high = _high_bits(blocks[:, start : start + 4])
            q = _nibbles_32(blocks[:, start + 4 : start + 20]) | (high << 4)
            offset = 16.0
        else:
            q = _nibbles_32(blocks[:, start : start + 16])
            offset = 8.0
        bias = m if m is not None else -offset * d
        return Affine(q, d[:, None], bias[:, None])
    if ggml_type in (Q4_K, Q5_K):
        d = _f16(blocks[:, 0:2])
        dmin = _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        if ggml_type == Q4_K:
            qs = blocks[:, 16:144].reshape(n, 4, 32)
            q = np.stack([qs & 0x0F, qs >> 4], axis=2)  # (n, chunk, low/high, 32)
        else:
            qh = blocks[:, 16:48]  # (n, 32): bit 2c of qh[l] is the fifth bit of chunk c's low weight l
            qs = blocks[:, 48:176].reshape(n, 4, 32)
            hb = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32)
            hb = hb.reshape(n, 4, 2, 32)
            q = np.stack([qs & 0x0F, qs >> 4], axis=2) | (hb << 4)
        return Affine(
            q.reshape(n, 256),
            (d * sc.astype(np.float32)).reshape(n, 8),
            (-dmin * mn.astype(np.float32)).reshape(n, 8),
        )
    raise ModelError(f"internal: type {ggml_type} has no exact affine form")


def dequantize_16(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """Q6_K, Q3_K or Q2_K blocks (n x bytes) → float32 weights (n x 256), as ggml's dequantize_row_*."""
    n = blocks.shape[0]
    if ggml_type == Q6_K:
        ql, qh = blocks[:, 0:128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32).reshape(n, 16)
        d = _f16(blocks[:, 208:210])
        low = np.concatenate(
            [ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2
        )
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        q = (low | (high << 4)).astype(np.float32) - 32.0  # (n, 2, 128)
        y6: np.ndarray = (q.reshape(n, 16, 16) * (d * sc)[:, :, None]).reshape(n, 256)
        return y6
    if ggml_type == Q3_K:
        hmask, qs = blocks[:, 0:32], blocks[:, 32:96].reshape(n, 2, 32)
        raw = blocks[:, 96:108].astype(np.uint8)
        low4 = np.concatenate([raw[:, 0:8] & 0x0F, raw[:, 0:8] >> 4], axis=1)  # scales 0-7, 8-15: low 4 bits
        top = np.concatenate([(raw[:, 8:12] >> s) & 3 for s in (0, 2, 4, 6)], axis=1)  # high 2 bits
        sc = (low4 | (top << 4)).astype(np.float32) - 32.0  # (n, 16)
        d = _f16(blocks[:, 108:110])
        q2 = np.concatenate([(qs >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # (n, 2, 128)
        hm = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32): bit j
        hm = hm.reshape(n, 2, 128)
        q = q2.astype(np.float32) - 4.0 * (1 - hm)
        y3: np.ndarray = (q.reshape(n, 16, 16) * (d * sc)[:, :, None]).reshape(n, 256)
        return y3
    if ggml_type == Q2_K:
        packed, qs = blocks[:, 0:16], blocks[:, 16:80].reshape(n, 2, 32)
        d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        q = np.concatenate([(qs >> s) & 3 for s in (0, 2, 4, 6)], axis=2).astype(np.float32)
        scale = d * (packed & 0x0F).astype(np.float32)
        minimum = dmin * (packed >> 4).astype(np.float32)
        y: np.ndarray = (q.reshape(n, 16, 16) * scale[:, :, None] - minimum[:, :, None]).reshape(n, 256)
        return y
    raise ModelError(f"internal: type {ggml_type} is not a 16-weight-group type")


def requantize(w: np.ndarray, bits: int) -> Affine:
    """Float weights (rows x cols) → MLX affine form per 32 (min-max, round to nearest against the float16
    scale and bias actually stored)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.min(axis=2), g.max(axis=2)
    levels = float((1 << bits) - 1)
    scale = ((hi - lo) / levels).astype(np.float16).astype(np.float32)
    bias = lo.astype(np.float16).astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.rint((g - bias[:, :, None]) / safe[:, :, None]), 0, levels).astype(np.uint8)
    return Affine(q.reshape(rows, cols), scale, bias)


def convert_rows(raw: np.ndarray, ggml_type: int, cols: int) -> Affine | np.ndarray:
    """Some rows of a tensor's bytes (rows x bytes per row) → a float array or the unpacked affine form."""
    rows = raw.shape[0]
    if ggml_type in FLOAT_TYPES:
        dtype = {F32: "<f4", F16: "<f2", BF16: "<u2"}[ggml_type]  # BF16 kept as its raw 16 bits
        return np.ascontiguousarray(raw).view(dtype).reshape(rows, cols)
    block, size = BLOCKS[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(rows * cols // block, size)
    if ggml_type in TYPE_BITS:
        a = _affine(blocks, ggml_type)
        return Affine(a.q.reshape(rows, cols), a.scales.reshape(rows, -1), a.biases.reshape(rows, -1))
    w = dequantize_16(blocks, ggml_type).reshape(rows, cols)
    return requantize(w, REQUANT_BITS[ggml_type])
