"""Text to token batches: a byte-level tokenizer and a deterministic, rank-sharded sampler.

Batches depend only on ``(seed, step, micro_step)``: the sampler draws one *global* batch of
``world_size * batch_size`` windows and each rank takes its own rows. So a resumed run sees
exactly the batches an uninterrupted run would have seen, with no sampler state to save.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from polyaccel.errors import ConfigError, InvalidArgument

#: byte-level: every byte value is a token, so any UTF-8 text round-trips
VOCAB_SIZE = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (no special tokens, nothing to download)."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> torch.Tensor:
        data = text.encode("utf-8")
        if not data:  # torch.frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_text(path: str | None) -> str:
    """The bundled corpus, or the UTF-8 text file at ``path``."""
    if path is None:
        from .corpus import TEXT

        return TEXT
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--text {path}: no such file; pass a UTF-8 text file or leave --text out")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--text {path}: not UTF-8 text ({exc})") from None
    if not text:
        raise ConfigError(f"--text {path}: the file is empty; pass a UTF-8 text of more than --seq-len bytes, "
                          "or leave --text out for the bundled text")
    return text


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [batch, seq_len] int64
    labels: torch.Tensor  # same as input_ids: HF causal LMs shift labels internally

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


class TokenSampler:
    """Random windows of ``seq_len`` tokens, reproducible from (seed, step, micro_step)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if tokens.dim() != 1:
            raise ConfigError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 2:
            raise ConfigError(f"--seq-len {seq_len}: must be at least 2")
        if tokens.numel() < seq_len + 1:
            fix = (f"use --seq-len {tokens.numel() - 1} or less, or a longer --text file" if tokens.numel() >= 3
                   else "pass a longer --text file")
            raise ConfigError(f"--seq-len {seq_len}: the text has only {tokens.numel()} tokens (a window needs "
                              f"--seq-len + 1 = {seq_len + 1}); {fix}")
        if batch_size < 1:
            raise ConfigError(f"--batch-size {batch_size}: must be at least 1")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed

    def _generator(self, step: int, micro_step: int) -> torch.Generator:
        # a distinct, stable stream per (seed, step, micro_step)
        key = ((self.seed * 1_000_003 + step) * 10_007 + micro_step) % (2**63 - 1)
        return torch.Generator().manual_seed(key)

    def global_batch(self, step: int, micro_step: int, world_size: int) -> Batch:
        n = world_size * self.batch_size
        starts = torch.randint(0, self.tokens.numel() - self.seq_len + 1, (n,),
                               generator=self._generator(step, micro_step))
        offsets = torch.arange(self.seq_len)
        ids = self.tokens[starts[:, None] + offsets[None, :]]
        return Batch(ids, ids)

    def batch(self, step: int, micro_step: int, rank: int, world_size: int) -> Batch:
        """This rank's rows of the global batch for ``step`` (0-based) and ``micro_step``."""
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} is outside world size {world_size}")
        g = self.global_batch(step, micro_step, world_size)
        rows = slice(rank * self.batch_size, (rank + 1) * self.batch_size)
        return Batch(g.input_ids[rows], g.labels[rows])
