"""Byte-level data: the default corpus, user text/folders, and pre-tokenized uint16 `.bin` files.

The default corpus needs no download: the `.py` files of the running interpreter's standard
library (site-packages excluded), sorted by path, concatenated as bytes (token = byte, vocab 256).
The last `val_fraction` of the token stream is the validation split; the rest is training data.

Sampling is a pure function of (seed, step): step s draws `global_batch` window offsets from a
generator seeded with (seed, s), and data shard i of n takes offsets [i*B/n, (i+1)*B/n). So the
union over ranks is the same global batch whatever the parallel layout (the equivalence tests
rely on this), and resuming at step s continues with exactly the batches an uninterrupted run
would have seen: the data position is the step number.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Corpus", "DataError", "load_corpus", "default_corpus_files"]


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


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids (uint8 or uint16)
    val: np.ndarray
    source: str
    max_token: int

    def check(self, seq_len: int, vocab_size: int) -> None:
        need = seq_len + 1
        for name, arr in (("training", self.train), ("validation", self.val)):
            if len(arr) < need:
                raise DataError(
                    f"{self.source}: the {name} split has {len(arr)} tokens, fewer than "
                    f"seq_len + 1 = {need}; use more data, a shorter --train.seq_len, or a "
                    f"different --data.val_fraction"
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


def load_corpus(path: str, val_fraction: float) -> Corpus:
    """Load `path` ("" = stdlib sources): a text file, a folder of text files, or a `.bin` of uint16."""
    if not 0.0 < val_fraction < 0.5:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 0.5)")
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
                f"or a pre-tokenized uint16 .bin file (or omit --data for the default corpus)"
            )
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            if not files:
                raise DataError(f"data folder {path!r} contains no files")
            tokens = _read_text_files(files)
            source = f"{path} ({len(files)} files)"
        elif p.suffix == ".bin":
            if p.stat().st_size % 2:
                raise DataError(
                    f"{path!r} has {p.stat().st_size} bytes, not a whole number of uint16 tokens"
                )
            tokens = np.memmap(p, dtype=np.uint16, mode="r")
            source = str(p)
        else:
            tokens = np.frombuffer(p.read_bytes(), dtype=np.uint8)
            source = str(p)
    if len(tokens) == 0:
        raise DataError(f"data {source!r} is empty")
    n_val = max(1, int(len(tokens) * val_fraction))
    max_token = int(tokens.max())
    return Corpus(train=tokens[:-n_val], val=tokens[-n_val:], source=source, max_token=max_token)
