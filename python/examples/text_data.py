"""Real English text for the GPT example: the Debian package ``fortunes``, byte-tokenized.

The corpus is every fortune file under /usr/share/games/fortunes/ (the ``.dat`` and ``.u8``
index files and symbolic links skipped), read in file-name order and cut into fortunes at the
``%`` separator lines. A deterministic split sends every 20th fortune to ``val``, the rest to
``train``; each split is its fortunes joined by a blank line, as bytes. The tokenizer is the
identity on bytes: vocabulary 256, token = byte value.

Batches (``batch``) follow one rule, so that a step's global batch does not depend on how it
is split over ranks. Sample ``n`` (n = 0, 1, 2, ... over the whole run) is the window of
``seq_len + 1`` tokens starting at ``splitmix64(seed, n) mod (len(tokens) - seq_len)``; its
inputs are the first ``seq_len`` tokens, its targets the last ``seq_len``. With
``G = world_size * micro_batch``, step ``s`` holds samples ``s*G .. s*G + G - 1`` and rank
``r`` takes samples ``s*G + r*micro_batch .. s*G + (r+1)*micro_batch - 1``. The global batch
of a step, the ranks' micro-batches concatenated in rank order, is therefore a function of
(step, G, seed) only: 4 ranks x 2 samples, 2 x 4 and 1 x 8 see the same 8 windows.

Run ``python text_data.py`` to print the corpus size and the first sample.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

FORTUNES_DIR = Path("/usr/share/games/fortunes")
VOCAB_SIZE = 256
VAL_EVERY = 20

_MASK64 = (1 << 64) - 1


def _fortune_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{directory} not found: the text corpus is the Debian package 'fortunes' "
            "(apt-get install fortunes, or scripts/install-deps.sh)"
        )
    files = sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8")
    )
    if not files:
        raise FileNotFoundError(f"{directory} holds no fortune files (apt-get install fortunes)")
    return files


@functools.cache
def load_tokens(split: str = "train", directory: Path = FORTUNES_DIR) -> torch.Tensor:
    """The ``split`` ("train" or "val") of the corpus as a 1-D uint8 tensor of byte tokens."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    fortunes: list[bytes] = []
    for path in _fortune_files(directory):
        for fortune in path.read_bytes().split(b"\n%\n"):
            fortune = fortune.strip(b"%\n")
            if fortune:
                fortunes.append(fortune)
    want_val = split == "val"
    chosen = [f for i, f in enumerate(fortunes) if (i % VAL_EVERY == VAL_EVERY - 1) == want_val]
    text = b"\n\n".join(chosen)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def encode(text: str) -> torch.Tensor:
    """Byte tokens (int64) of ``text`` in UTF-8."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: torch.Tensor) -> str:
    """Text of byte ``tokens``; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def splitmix64(seed: int, n: int) -> int:
    """SplitMix64 of the 64-bit state ``seed * 2**32 + n``: a fixed, portable hash."""
    z = ((seed << 32) + n + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_start(seed: int, n: int, num_tokens: int, seq_len: int) -> int:
    """Where sample ``n`` starts: a window of ``seq_len + 1`` tokens fits after it."""
    return splitmix64(seed, n) % (num_tokens - seq_len)


def batch(
    step: int,
    rank: int,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    seed: int,
    split: str = "train",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step``: (inputs, targets), int64, [micro_batch, seq_len]."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    tokens = load_tokens(split)
    first = step * world_size * micro_batch + rank * micro_batch
    starts = [sample_start(seed, n, tokens.numel(), seq_len) for n in range(first, first + micro_batch)]
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts]).to(torch.int64)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def main() -> None:
    train, val = load_tokens("train"), load_tokens("val")
    print(f"fortunes corpus: train {train.numel()} bytes, val {val.numel()} bytes")
    inputs, _ = batch(step=0, rank=0, world_size=1, micro_batch=1, seq_len=128, seed=0)
    text = decode(inputs[0])
    print(f"sample 0 (seed 0): {text!r}; re-encodes to the same tokens: {torch.equal(encode(text), inputs[0])}")


if __name__ == "__main__":
    main()
