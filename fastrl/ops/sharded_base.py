"""The pieces every op on a head sharded over the vocabulary shares (``fastrl.ops.sharded`` and its siblings): what a
sharded head is (``vocab_shard``: a DTensor placed ``Shard(0)`` on a 1-D mesh, ``torch.chunk``'s rows per rank), the
one collective they call (``all_reduce``) and the merge of per-shard row statistics (``merge_stats``).

``import torch.distributed.tensor`` never happens at ``import fastrl``: a tensor can only be a DTensor once that
module was imported by whoever made it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

__all__ = ["VocabShard", "vocab_shard", "is_vocab_sharded", "chunk_range", "local_replica", "merge_stats",
           "all_reduce"]


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary-sharded head."""

    weight: torch.Tensor  # [V_l, H] the local rows (differentiable view of the DTensor: to_local)
    bias: torch.Tensor | None  # [V_l]
    v0: int  # global id of the first local row
    vocab: int  # V, the global vocabulary
    group: object  # the mesh's process group
    world: int  # P


def _dtensor_types():
    """(DTensor, Shard, Replicate) when torch.distributed.tensor was imported by someone, else None."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Shard, Replicate


def is_vocab_sharded(weight) -> bool:
    """Whether ``weight`` is a DTensor placed ``Shard(0)`` (cheap; no import of torch.distributed.tensor)."""
    types_ = _dtensor_types()
    if types_ is None or not isinstance(weight, types_[0]):
        return False
    return any(p == types_[1](0) for p in weight.placements)


def chunk_range(V: int, P: int, rank: int) -> tuple[int, int]:
    """``[v0, v1)`` of rank ``rank`` under ``torch.chunk``'s split of V rows in P pieces (DTensor's Shard(0))."""
    per = math.ceil(V / P)
    v0 = min(rank * per, V)
    return v0, min(v0 + per, V)


def local_replica(t, name: str):
    """A plain tensor as it is; a DTensor placed ``Replicate()`` as its (differentiable) local tensor."""
    types_ = _dtensor_types()
    if types_ is None or t is None or not isinstance(t, types_[0]):
        return t
    if any(p != types_[2]() for p in t.placements):
        raise ValueError(f"{name} must be replicated on the head's mesh (a plain tensor or a DTensor placed "
                         f"Replicate()), got a DTensor placed {tuple(t.placements)}")
    return t.to_local()


def vocab_shard(weight, bias=None, *, weight_name: str = "weight", bias_name: str = "bias") -> VocabShard | None:
    """This rank's shard of a head placed ``Shard(0)`` on a 1-D mesh; None for any other weight."""
    if not is_vocab_sharded(weight):
        return None
    DTensor, Shard, _ = _dtensor_types()
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"{weight_name}: a vocabulary-sharded head must be a DTensor placed (Shard(0),) on a 1-D "
                         f"device mesh, got placements {tuple(weight.placements)} on a {mesh.ndim}-D mesh")
    V, P, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    v0, v1 = chunk_range(V, P, rank)
    local = weight.to_local()
    if local.shape[0] != v1 - v0:
        raise ValueError(f"{weight_name}: rank {rank} holds {local.shape[0]} rows of V = {V}, expected "
                         f"torch.chunk's {v1 - v0} (rows [{v0}, {v1}))")
    b = None
    if bias is not None:
        if isinstance(bias, DTensor):
            if tuple(bias.placements) == (Shard(0),) and bias.device_mesh == mesh:
                b = bias.to_local()
            else:
                b = local_replica(bias, bias_name)[v0:v1]
        else:
            b = bias[v0:v1]
        if b.shape[0] != v1 - v0:
            raise ValueError(f"{bias_name} must be [V] = [{V}] like {weight_name}, got {b.shape[0]} local rows")
    return VocabShard(local, b, v0, V, mesh.get_group(), P)


def all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """In-place all-reduce of ``t`` over the head's group (``op``: "sum" or "max"); the only collective here."""
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def merge_stats(lse_l: torch.Tensor, ent_l: torch.Tensor | None, zt_l: torch.Tensor | None, group
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Global (lse, entropy, target logit) [N] from each rank's shard statistics (lse_l = -inf on an empty shard):
    one MAX and one SUM all-reduce of O(N) numbers."""
    M = all_reduce(lse_l.clone(), "max", group)
    e = torch.exp(lse_l - M)  # 0 on an empty shard
    parts = [e]
    if zt_l is not None:
        parts.append(zt_l)
    if ent_l is not None:
        # the shard's mean logit relative to M, weighted by its share of the mass (0 where the shard is empty)
        parts.append(torch.where(e > 0, e * ((lse_l - M) - ent_l), torch.zeros_like(e)))
    S = all_reduce(torch.stack(parts), "sum", group)
    log_s = torch.log(S[0])
    lse = M + log_s
    zt = S[1] if zt_l is not None else None
    ent = log_s - S[-1] / S[0] if ent_l is not None else None
    return lse, ent, zt
