"""The causal load-balanced sequence split of context parallelism: which tokens rank r holds.

Under a causal mask the last tokens of a sequence attend to far more keys than the first, so a plain
contiguous split gives the last rank most of the work. Megatron-Core (`get_batch_on_this_cp_rank`) and
torch's `context_parallel` (`_HeadTailLoadBalancer`) cut the sequence into 2 * cp equal chunks and give
rank r chunks r and 2*cp - 1 - r, one from the head and one from the tail, concatenated in that order:
every rank then holds as many (query, key) pairs below the diagonal as any other.

cp = 2, S = 8 (chunks of 2 tokens):  rank 0 holds chunks 0, 3 = tokens 0 1 6 7;
                                     rank 1 holds chunks 1, 2 = tokens 2 3 4 5.

Pure functions of shapes and ranks (STYLE 11): no process group, no device.

>>> x = torch.arange(8)
>>> [shard_sequence(x, 0, r, 2).tolist() for r in range(2)]
[[0, 1, 6, 7], [2, 3, 4, 5]]
>>> positions(8, rank=1, cp=2)
tensor([2, 3, 4, 5])
>>> torch.equal(unshard_sequence([shard_sequence(x, 0, r, 2) for r in range(2)], 0), x)
True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_divisible", "positions", "shard_sequence", "unshard_sequence"]


def check_divisible(seq_len: int, cp: int) -> None:
    """Raise ValueError unless a sequence of seq_len tokens cuts into 2 * cp equal chunks."""
    if cp < 1:
        raise ValueError(f"context-parallel degree cp={cp}: it must be >= 1")
    if seq_len % (2 * cp):
        step = 2 * cp
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * cp = {step}: the load-balanced split cuts it "
            f"into {step} equal chunks; pad the sequence to {-(-seq_len // step) * step} tokens "
            f"(a multiple of {step}) or choose a cp with 2 * cp dividing {seq_len}")


def _chunks(rank: int, cp: int) -> tuple[int, int]:
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside 0..{cp - 1} for a context-parallel degree of {cp}")
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """Rank `rank`'s tokens of x along `dim` (chunks rank and 2*cp-1-rank of 2*cp), as a new tensor.

    >>> shard_sequence(torch.arange(12).view(1, 12), dim=1, rank=0, cp=3)
    tensor([[ 0,  1, 10, 11]])
    """
    dim = dim % x.dim()
    check_divisible(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim)
    head, tail = _chunks(rank, cp)
    return torch.cat([chunks[head], chunks[tail]], dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order: the inverse of `shard_sequence`.

    >>> unshard_sequence([torch.tensor([0, 3]), torch.tensor([1, 2])], dim=0)
    tensor([0, 1, 2, 3])
    """
    if not shards:
        raise ValueError("unshard_sequence: no shards given; pass one tensor per context-parallel rank, in rank order")
    cp = len(shards)
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"unshard_sequence: shards differ in shape {[tuple(s.shape) for s in shards]}; "
                         f"shard_sequence makes equal shards")
    dim = dim % shards[0].dim()
    if shards[0].shape[dim] % 2:
        raise ValueError(f"unshard_sequence: a shard holds {shards[0].shape[dim]} tokens along dim {dim}; "
                         f"a load-balanced shard holds two equal chunks, so an even number")
    ordered: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, s in enumerate(shards):
        head, tail = s.chunk(2, dim)
        ordered[r], ordered[2 * cp - 1 - r] = head, tail
    return torch.cat(ordered, dim)


def positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    """The global position ids of rank r's tokens, in the order it holds them (a LongTensor of
    seq_len / cp): what rotary embeddings and the causal mask of ring attention read.

    >>> positions(12, rank=2, cp=3)
    tensor([4, 5, 6, 7])
    """
    check_divisible(seq_len, cp)
    return shard_sequence(torch.arange(seq_len), 0, rank, cp)
