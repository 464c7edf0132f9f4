"""Training data: the default byte-level corpus, user text/folders, and pre-tokenized `.bin` files.

The default corpus needs no download: the `.py` files of the running interpreter's standard
library (site-packages excluded), sorted by path, concatenated as bytes (token = byte, vocab 256).
The last `val_fraction` of the token stream is the validation split; the rest is training data.

Sampling is a pure function of (seed, step): step s draws `global_batch` window offsets from a
generator seeded with (seed, s), and data shard i of n takes offsets [i*B/n, (i+1)*B/n). So the
union over ranks is the same global batch whatever the parallel layout (the equivalence tests
rely on this), and resuming at step s continues with exactly the batches an uninterrupted run
would have seen: the data position is the step number.

Pre-tokenized data is a flat `.bin` of token ids. `python -m trainer.data prepare` (see
`trainer.data.prepare` and docs/data.md) writes one with a JSON sidecar `FILE.json` beside it
giving the dtype (uint16 when the vocabulary fits, else uint32), the vocabulary, the EOS id and
the counts; a `.bin` without a sidecar is the legacy format: uint16 ids, vocabulary unknown.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Corpus", "DataError", "load_corpus", "default_corpus_files", "read_sidecar",
           "sidecar_path", "SIDECAR_FORMAT", "SIDECAR_VERSION", "TOKEN_DTYPES"]

SIDECAR_FORMAT = "piper-moe-tokens"
SIDECAR_VERSION = 1
# dtype name in the sidecar -> numpy dtype of the ids; uint16 holds vocabularies up to 65,536
TOKEN_DTYPES: dict[str, type[np.unsignedinteger]] = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """The data path or content is unusable; the message names it and what would work."""


def default_corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return sorted(files)


def _read_text_files(files: list[Path]) -> np.ndarray:
    chunks = []
    for p in files:
        data = p.read_bytes()
        if b"\x00" in data[:4096]:  # binary file inside a folder of text: skip it
            continue
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        chunks.append(np.frombuffer(b"\n", dtype=np.uint8))
    if not chunks:
        raise DataError(f"no text files found among {len(files)} files")
    return np.concatenate(chunks)


def sidecar_path(bin_path: str | Path) -> Path:
    """`FILE.json` beside `FILE.bin`: the metadata `prepare` writes."""
    return Path(bin_path).with_suffix(".json")


def read_sidecar(bin_path: str | Path) -> dict | None:
    """The validated sidecar of `bin_path`, or None when there is none (legacy uint16 `.bin`)."""
    side = sidecar_path(bin_path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read the sidecar {str(side)!r} of {str(bin_path)!r}: {e}") from e
    if not isinstance(meta, dict):
        raise DataError(f"sidecar {str(side)!r} holds {type(meta).__name__}, not a JSON object")
    version = meta.get("version")
    if version != SIDECAR_VERSION:
        raise DataError(
            f"sidecar {str(side)!r} has format version {version!r}; this piper-moe reads version "
            f"{SIDECAR_VERSION} (re-run `python -m trainer.data prepare`)"
        )
    dtype = meta.get("dtype")
    if dtype not in TOKEN_DTYPES:
        raise DataError(
            f"sidecar {str(side)!r} names dtype {dtype!r}; valid dtypes: {', '.join(TOKEN_DTYPES)}"
        )
    for key in ("vocab_size", "n_tokens"):
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "vocab_size" else 0):
            raise DataError(f"sidecar {str(side)!r}: {key}={v!r} is not a valid count")
    eos = meta.get("eos_id")
    if eos is not None and (not isinstance(eos, int) or not 0 <= eos < meta["vocab_size"]):
        raise DataError(
            f"sidecar {str(side)!r}: eos_id={eos!r} is not a token id of its vocabulary "
            f"0..{meta['vocab_size'] - 1}"
        )
    return meta


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids (uint8 bytes, uint16 or uint32)
    val: np.ndarray
    source: str
    max_token: int
    vocab_size: int | None = None  # the tokenizer's vocabulary, from the sidecar (None: unknown)
    eos_id: int | None = None  # from the sidecar; None for bytes and legacy .bin files
    sidecar: str | None = None  # path of the sidecar the dtype and vocabulary came from

    def check(self, seq_len: int, vocab_size: int) -> None:
        need = seq_len + 1
        for name, arr in (("training", self.train), ("validation", self.val)):
            if len(arr) < need:
                raise DataError(
                    f"{self.source}: the {name} split has {len(arr)} tokens, fewer than "
                    f"seq_len + 1 = {need}; use more data, a shorter --train.seq_len, or a "
                    f"different --data.val_fraction"
                )
        if self.vocab_size is not None and self.vocab_size > vocab_size:
            raise DataError(
                f"{self.source}: its tokenizer's vocabulary has {self.vocab_size} tokens (sidecar "
                f"{self.sidecar}), more than the model's vocab_size {vocab_size}; use a model "
                f"with vocab_size >= {self.vocab_size} (--model.vocab_size) or tokenize with the "
                f"model's own tokenizer"
            )
        if self.max_token >= vocab_size:
            raise DataError(
                f"{self.source}: token id {self.max_token} does not fit the model's vocab_size "
                f"{vocab_size}; valid token ids are 0..{vocab_size - 1}"
            )

    def batch(self, step: int, global_batch: int, seq_len: int, shard: int, n_shards: int,
              seed: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and next-token targets [global_batch / n_shards, seq_len] of this shard."""
        arr = self.train if split == "train" else self.val
        if global_batch % n_shards:
            raise DataError(
                f"global_batch={global_batch} is not divisible by the {n_shards} data shards "
                f"(dp x ep); use a multiple of {n_shards}"
            )
        # split-specific stream so validation draws never depend on the training schedule
        g = np.random.default_rng([seed, step, 0 if split == "train" else 1])
        offs = g.integers(0, len(arr) - seq_len - 1, size=global_batch, endpoint=True)
        per = global_batch // n_shards
        mine = offs[shard * per:(shard + 1) * per]
        idx = mine[:, None] + np.arange(seq_len + 1)[None, :]
        window = torch.from_numpy(arr[idx].astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _load_bin(p: Path) -> tuple[np.ndarray, dict | None]:
    """Memmap a `.bin` with the dtype its sidecar names (uint16 without one), size-checked."""
    meta = read_sidecar(p)
    dtype = "uint16" if meta is None else meta["dtype"]
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = p.stat().st_size
    whence = "" if meta is None else f" (dtype from its sidecar {str(sidecar_path(p))!r})"
    if size % itemsize:
        raise DataError(
            f"{str(p)!r} has {size} bytes, not a whole number of {dtype} tokens "
            f"({itemsize} bytes each){whence}"
        )
    if meta is not None and meta["n_tokens"] != size // itemsize:
        raise DataError(
            f"{str(p)!r} holds {size // itemsize} {dtype} tokens but its sidecar "
            f"{str(sidecar_path(p))!r} says {meta['n_tokens']}: the two files do not belong "
            f"together; re-run `python -m trainer.data prepare`"
        )
    if size == 0:
        raise DataError(f"data {str(p)!r} is empty")
    return np.memmap(p, dtype=TOKEN_DTYPES[dtype], mode="r"), meta


def load_corpus(path: str, val_fraction: float) -> Corpus:
    """Load `path` ("" = stdlib sources): a text file, a folder of text files, or a `.bin` of
    token ids (dtype from its sidecar `FILE.json`; uint16 without one)."""
    if not 0.0 < val_fraction < 0.5:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 0.5)")
    meta = None  # the sidecar of a .bin, when it has one
    if not path:
        files = default_corpus_files()
        if not files:
            raise DataError("the standard library sources were not found; pass --data PATH")
        tokens = _read_text_files(files)
        source = f"stdlib sources ({len(files)} files)"
    else:
        p = Path(path)
        if not p.exists():
            raise DataError(
                f"data path {path!r} does not exist; pass a text file, a folder of text files, "
                f"or a pre-tokenized .bin file (or omit --data for the default corpus)"
            )
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            if not files:
                raise DataError(f"data folder {path!r} contains no files")
            tokens = _read_text_files(files)
            source = f"{path} ({len(files)} files)"
        elif p.suffix == ".bin":
            tokens, meta = _load_bin(p)
            source = str(p)
        else:
            tokens = np.frombuffer(p.read_bytes(), dtype=np.uint8)
            source = str(p)
    if len(tokens) == 0:
        raise DataError(f"data {source!r} is empty")
    n_val = max(1, int(len(tokens) * val_fraction))
    max_token = int(tokens.max())
    if meta is None:
        return Corpus(train=tokens[:-n_val], val=tokens[-n_val:], source=source,
                      max_token=max_token)
    if max_token >= meta["vocab_size"]:
        raise DataError(
            f"{source}: token id {max_token} does not fit the vocab_size {meta['vocab_size']} "
            f"its sidecar {str(sidecar_path(source))!r} names; the two files do not belong "
            f"together; re-run `python -m trainer.data prepare`"
        )
    return Corpus(train=tokens[:-n_val], val=tokens[-n_val:], source=source, max_token=max_token,
                  vocab_size=meta["vocab_size"], eos_id=meta.get("eos_id"),
                  sidecar=str(sidecar_path(source)))
