"""Training data: the default byte-level corpus, user text/folders, and pre-tokenized `.bin` files.

The default corpus needs no download: the `.py` files of the running interpreter's standard
library (site-packages excluded), sorted by path, concatenated as bytes (token = byte, vocab 256).
The last `val_fraction` of the token stream is the validation split; the rest is training data.

Training windows (`--data.sampling`): `epoch` (the default) reads every window of S + 1 tokens
once per epoch in a seeded shuffled order, and a blend (`--data.blend=a.bin:0.7,b.bin:0.3`)
interleaves several files in the given shares, each walked in its own epochs
(`trainer.data.sampling`); `random` draws `global_batch` offsets anywhere from a generator
seeded with (seed, step), with replacement (the behaviour before epochs). Either way the order is
a pure function of (seed, step): data shard i of n takes rows [i*B/n, (i+1)*B/n) of the step's
global batch, so the union over ranks is the same whatever the parallel layout, and resuming at
step s continues with exactly the batches an uninterrupted run would have seen: the data
position is the step number. Validation batches are random draws from the validation split(s).

Pre-tokenized data is a flat `.bin` of token ids. `python -m trainer.data prepare` (see
`trainer.data.prepare` and docs/data.md) writes one with a JSON sidecar `FILE.json` beside it
giving the dtype (uint16 when the vocabulary fits, else uint32), the vocabulary, the EOS id and
the counts, and for chat data (`prepare --chat`) a loss mask `FILE.mask` (uint8, one per token:
1 = an assistant token the loss counts); a `.bin` without a sidecar is the legacy format:
uint16 ids, vocabulary unknown.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .sampling import SAMPLINGS, BlendError, WindowOrder, is_blend, parse_blend

__all__ = ["Corpus", "Blend", "DataError", "load_corpus", "load_data", "SAMPLINGS", "BlendError",
           "parse_blend", "is_blend", "default_corpus_files", "read_sidecar",
           "sidecar_path", "mask_path", "SIDECAR_FORMAT", "SIDECAR_VERSION", "TOKEN_DTYPES"]

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


def _gather(arr: np.ndarray, mask: np.ndarray | None, starts: np.ndarray,
            seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets [n, seq_len] of the windows at `starts`; with a loss
    mask, targets of tokens the mask excludes are -100 (cross_entropy's ignore_index)."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    window = torch.from_numpy(arr[idx].astype(np.int64))
    tokens, targets = window[:, :-1].contiguous(), window[:, 1:].contiguous()
    if mask is not None:
        keep = torch.from_numpy(mask[idx[:, 1:]].astype(bool))
        targets = targets.masked_fill(~keep, -100)
    return tokens, targets


def _check_shards(global_batch: int, n_shards: int) -> int:
    if global_batch % n_shards:
        raise DataError(
            f"global_batch={global_batch} is not divisible by the {n_shards} data shards "
            f"(dp x ep); use a multiple of {n_shards}"
        )
    return global_batch // n_shards


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids (uint8 bytes, uint16 or uint32)
    val: np.ndarray
    source: str
    max_token: int
    vocab_size: int | None = None  # the tokenizer's vocabulary, from the sidecar (None: unknown)
    eos_id: int | None = None  # from the sidecar; None for bytes and legacy .bin files
    sidecar: str | None = None  # path of the sidecar the dtype and vocabulary came from
    sampling: str = "epoch"  # epoch | random (trainer.data.sampling.SAMPLINGS)
    # the loss mask of `prepare --chat` (uint8 per token), split like the tokens; applied to
    # the targets only when `use_mask` (--data.loss_mask=true)
    mask_train: np.ndarray | None = None
    mask_val: np.ndarray | None = None
    use_mask: bool = False
    _orders: dict = field(default_factory=dict, repr=False)

    @property
    def n_train(self) -> int:
        return len(self.train)

    @property
    def n_val(self) -> int:
        return len(self.val)

    @property
    def files(self) -> list[str]:
        return [self.source]

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

    def n_windows(self, seq_len: int) -> int:
        """Windows of seq_len + 1 tokens in one epoch of the training split."""
        return (len(self.train) - 1) // seq_len

    def order(self, seq_len: int, seed: int) -> WindowOrder:
        key = (seq_len, seed)
        if key not in self._orders:
            self._orders[key] = WindowOrder([self.n_windows(seq_len)], [Fraction(1)], seq_len,
                                            seed)
        return self._orders[key]

    def windows(self, step: int, global_batch: int, seq_len: int, shard: int, n_shards: int,
                seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index [n], start offset [n]) of this shard's training windows of `step`
        (0-based: the step being computed); source 0 is this file."""
        per = _check_shards(global_batch, n_shards)
        if self.sampling == "random":
            g = np.random.default_rng([seed, step, 0])
            offs = g.integers(0, len(self.train) - seq_len - 1, size=global_batch, endpoint=True)
            starts = offs[shard * per:(shard + 1) * per]
        else:
            w = self.order(seq_len, seed).windows(step * global_batch + shard * per, per)
            starts = w.starts
        return np.zeros(len(starts), dtype=np.int64), starts

    def batch(self, step: int, global_batch: int, seq_len: int, shard: int, n_shards: int,
              seed: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and next-token targets [global_batch / n_shards, seq_len] of this shard."""
        if split == "train":
            _, starts = self.windows(step, global_batch, seq_len, shard, n_shards, seed)
            return _gather(self.train, self.mask_train if self.use_mask else None, starts,
                           seq_len)
        per = _check_shards(global_batch, n_shards)
        # split-specific stream so validation draws never depend on the training schedule
        g = np.random.default_rng([seed, step, 1])
        offs = g.integers(0, len(self.val) - seq_len - 1, size=global_batch, endpoint=True)
        return _gather(self.val, self.mask_val if self.use_mask else None,
                       offs[shard * per:(shard + 1) * per], seq_len)

    def progress(self, steps_done: int, global_batch: int, seq_len: int,
                 seed: int) -> dict[str, Any]:
        """{"epoch": epochs of the training split read (fractional), "tokens_seen": tokens
        read} after `steps_done` steps (random sampling: windows read / windows per epoch)."""
        g = steps_done * global_batch
        return {"epoch": g / self.n_windows(seq_len), "tokens_seen": g * seq_len}


@dataclass
class Blend:
    """Several token files read in fixed shares (`--data.blend`), each in its own epochs;
    the same interface as `Corpus` (trainer.data.sampling has the order)."""

    parts: list[Corpus]
    weights: list[Fraction]
    use_mask: bool = False
    _orders: dict = field(default_factory=dict, repr=False)

    @property
    def source(self) -> str:
        return "blend " + ",".join(f"{p.source}:{float(w):g}"
                                   for p, w in zip(self.parts, self.weights, strict=True))

    @property
    def files(self) -> list[str]:
        return [p.source for p in self.parts]

    @property
    def n_train(self) -> int:
        return sum(p.n_train for p in self.parts)

    @property
    def n_val(self) -> int:
        return sum(p.n_val for p in self.parts)

    @property
    def max_token(self) -> int:
        return max(p.max_token for p in self.parts)

    @property
    def vocab_size(self) -> int | None:
        known = [p.vocab_size for p in self.parts if p.vocab_size is not None]
        return max(known) if known else None

    @property
    def eos_id(self) -> int | None:
        return self.parts[0].eos_id

    def check(self, seq_len: int, vocab_size: int) -> None:
        for p in self.parts:
            p.check(seq_len, vocab_size)
        eos = {p.source: p.eos_id for p in self.parts}
        if len(set(eos.values())) > 1:
            raise DataError(f"--data.blend sources name different EOS ids {eos}; tokenize every "
                            f"source with the same tokenizer")

    def order(self, seq_len: int, seed: int) -> WindowOrder:
        key = (seq_len, seed)
        if key not in self._orders:
            self._orders[key] = WindowOrder([p.n_windows(seq_len) for p in self.parts],
                                            self.weights, seq_len, seed)
        return self._orders[key]

    def windows(self, step: int, global_batch: int, seq_len: int, shard: int, n_shards: int,
                seed: int) -> tuple[np.ndarray, np.ndarray]:
        per = _check_shards(global_batch, n_shards)
        w = self.order(seq_len, seed).windows(step * global_batch + shard * per, per)
        return w.src, w.starts

    def batch(self, step: int, global_batch: int, seq_len: int, shard: int, n_shards: int,
              seed: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        per = _check_shards(global_batch, n_shards)
        if split == "train":
            src, starts = self.windows(step, global_batch, seq_len, shard, n_shards, seed)
        else:  # the blend's shares, random windows of each source's validation split, drawn
            # for the whole global batch so that every layout sees the same union
            src, _ = self.order(seq_len, seed).sources(step * global_batch, global_batch)
            hi = np.array([len(p.val) - seq_len - 1 for p in self.parts])[src]  # last start
            u = np.random.default_rng([seed, step, 1]).random(global_batch)
            starts = np.minimum((u * (hi + 1)).astype(np.int64), hi)
            src, starts = (a[shard * per:(shard + 1) * per] for a in (src, starts))
        tokens = torch.empty(per, seq_len, dtype=torch.int64)
        targets = torch.empty(per, seq_len, dtype=torch.int64)
        for d, p in enumerate(self.parts):
            sel = np.flatnonzero(src == d)
            if len(sel):
                arr, mask = (p.train, p.mask_train) if split == "train" else (p.val, p.mask_val)
                x, y = _gather(arr, mask if self.use_mask else None, starts[sel], seq_len)
                tokens[sel], targets[sel] = x, y
        return tokens, targets

    def progress(self, steps_done: int, global_batch: int, seq_len: int,
                 seed: int) -> dict[str, Any]:
        """"epoch": the most epochs any source has read; "source_epochs": each source's."""
        epochs = self.order(seq_len, seed).epochs(steps_done * global_batch)
        return {"epoch": max(epochs), "tokens_seen": steps_done * global_batch * seq_len,
                "source_epochs": dict(zip(self.files, epochs, strict=True))}


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
    mask = _load_mask(Path(path), meta)
    return Corpus(train=tokens[:-n_val], val=tokens[-n_val:], source=source, max_token=max_token,
                  vocab_size=meta["vocab_size"], eos_id=meta.get("eos_id"),
                  sidecar=str(sidecar_path(source)),
                  mask_train=None if mask is None else mask[:-n_val],
                  mask_val=None if mask is None else mask[-n_val:])


def mask_path(bin_path: str | Path) -> Path:
    """`FILE.mask` beside `FILE.bin`: the loss mask `prepare --chat` writes (uint8 per token)."""
    return Path(bin_path).with_suffix(".mask")


def _load_mask(p: Path, meta: dict) -> np.ndarray | None:
    """The loss mask the sidecar names (None when it names none), length-checked."""
    entry = meta.get("loss_mask")
    if entry is None:
        return None
    side = sidecar_path(p)
    if not isinstance(entry, dict) or entry.get("dtype") != "uint8" or \
            not isinstance(entry.get("file"), str):
        raise DataError(f"sidecar {str(side)!r}: loss_mask={entry!r} is not "
                        f'{{"file": NAME, "dtype": "uint8"}}')
    m = p.with_name(entry["file"])
    if not m.is_file():
        raise DataError(f"sidecar {str(side)!r} names the loss mask {str(m)!r}, which does not "
                        f"exist; re-run `python -m trainer.data prepare --chat`")
    size = m.stat().st_size
    if size != meta["n_tokens"]:
        raise DataError(f"loss mask {str(m)!r} has {size} entries but {str(p)!r} holds "
                        f"{meta['n_tokens']} tokens (sidecar {str(side)!r}): the files do not "
                        f"belong together; re-run `python -m trainer.data prepare --chat`")
    return np.memmap(m, dtype=np.uint8, mode="r")


def load_data(path: str, val_fraction: float, *, blend: str = "", sampling: str = "epoch",
              loss_mask: bool = False) -> Corpus | Blend:
    """The training data of a run (`--data.path`, `--data.blend`, `--data.sampling`,
    `--data.loss_mask`), every option checked before a file is read."""
    if sampling not in SAMPLINGS:
        raise DataError(f"--data.sampling={sampling!r}; valid: {', '.join(SAMPLINGS)} (epoch: "
                        f"every window once per epoch, shuffled; random: offsets drawn with "
                        f"replacement)")
    if not 0.0 < val_fraction < 0.5:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 0.5)")
    if blend:
        if path:
            raise DataError(f"--data {path!r} and --data.blend={blend!r} both given; a blend "
                            f"names its files itself: pass one of them")
        try:
            spec = parse_blend(blend)
        except BlendError as e:
            raise DataError(str(e)) from None
        if sampling == "random":
            raise DataError("--data.blend walks each source in epochs; --data.sampling=random "
                            "reads one file only (use --data.sampling=epoch)")
        for f, _ in spec:
            if not Path(f).is_file():
                raise DataError(f"--data.blend source {f!r} does not exist (or is not a file)")
        parts = [load_corpus(f, val_fraction) for f, _ in spec]
        for c in parts:
            c.use_mask = loss_mask
        data: Corpus | Blend = Blend(parts, [w for _, w in spec], use_mask=loss_mask)
    else:
        data = load_corpus(path, val_fraction)
        data.sampling = sampling
        data.use_mask = loss_mask
    parts_ = data.parts if isinstance(data, Blend) else [data]
    no_mask = [c.source for c in parts_ if c.mask_train is None]
    if loss_mask and no_mask:
        raise DataError(f"--data.loss_mask=true needs a loss mask beside the tokens (FILE.mask, "
                        f"written by `python -m trainer.data prepare --chat`); {no_mask[0]} has "
                        f"none")
    return data
