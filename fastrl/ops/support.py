"""Sampling supports: the set of ids a token's distribution is renormalised over (``fastrl.KeptSet``,
``fastrl.SamplerRule``).

A sampler that truncates (top-k, top-p, min-p, a minimum length) draws from ``pi^S``, the softmax restricted to a
kept set ``S`` and renormalised. fastrl computes log-probs, entropies and losses under ``pi^S`` when an op is given
``support=``:

* ``KeptSet``: the kept ids of every token, recorded where the completions were sampled (a logits processor after
  transformers' warpers, vLLM's sampling mask). Stored compactly on the device as CSR: ``ids`` (int64, ascending
  within each token) and ``offsets`` (``[N + 1]``). Rows follow the flattened token order of ``targets``.
* ``SamplerRule``: the sampler's settings, replayed on the training logits (after the op's temperature).

This module holds the data types and their validation only; the ops (``fastrl.ops.kept``) consume them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fastrl.ops._checks import token_name
from fastrl.ops.kept_plan import choose_for

__all__ = ["KeptSet", "SamplerRule"]


class KeptSet:
    """The ids kept at each token, as CSR on the device.

    ``ids``: int64 ``[nnz]``, ascending within each token; ``offsets``: int64 ``[N + 1]``, token ``n`` keeps
    ``ids[offsets[n]:offsets[n + 1]]``; ``vocab_size``: V. ``lead_shape``: the token layout it was built from
    (``(N,)`` or ``(B, T)``), used to name tokens in errors and by ``rows_of_sequences``.

    An ignored token may have an empty set; a counted one may not (checked by the ops, which know which tokens
    count). Constructors validate ids (in ``[0, V)``, no duplicates) and raise ``ValueError`` naming the token.

    What the kept-set engine reads to choose its plan (``describe_plan`` prints the choice):

    * ``width``: the most ids any token keeps, or a bound on it (the per-row plan's ``K_max``: its widest bucket,
      and the ``[N, width]`` padding it runs under CUDA graph capture). Known from construction (``from_padded``: K; ``from_lists`` / ``from_mask`` and a
      validated CSR: measured), kept by slicing and ``to``; None where unknown (the engine then measures it where the
      host may be read, and takes the fixed union plan where not).
    * ``overlap``: whether neighbouring tokens' sets share most of their ids (True: union tiles; False: the per-row
      plan; None, the default: measured on the host, the per-row plan without host reads).
    """

    __slots__ = ("ids", "offsets", "vocab_size", "lead_shape", "width", "overlap")

    def __init__(self, ids: torch.Tensor, offsets: torch.Tensor, vocab_size: int,
                 lead_shape: tuple[int, ...] | None = None, *, validate: bool = True, width: int | None = None,
                 overlap: bool | None = None):
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"KeptSet ids must be a 1-D int32/int64 tensor, got {_describe(ids)}")
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"KeptSet offsets must be a 1-D int32/int64 tensor, got {_describe(offsets)}")
        if offsets.numel() == 0:
            raise ValueError("KeptSet offsets must have N + 1 >= 1 entries, got an empty tensor")
        if ids.device != offsets.device:
            raise ValueError(f"KeptSet ids and offsets must share a device, got {ids.device} and {offsets.device}")
        self.ids = ids.to(torch.int64)
        self.offsets = offsets.to(torch.int64)
        self.vocab_size = vocab_size
        n = self.offsets.numel() - 1
        self.lead_shape = tuple(lead_shape) if lead_shape is not None else (n,)
        if math.prod(self.lead_shape) != n:
            raise ValueError(f"KeptSet lead_shape {self.lead_shape} does not hold its {n} tokens")
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 0):
            raise ValueError(f"KeptSet width must be None or an int >= 0 (the most ids a token keeps), got {width!r}")
        if overlap is not None and not isinstance(overlap, bool):
            raise TypeError(f"KeptSet overlap must be None or a bool, got {type(overlap).__name__}")
        self.width, self.overlap = width, overlap
        if validate:
            self._validate()
            most = int(self.sizes().max()) if n else 0
            if width is not None and most > width:
                raise ValueError(f"KeptSet width={width}, but a token keeps {most} ids")
            self.width = most if width is None else width

    # ------------------------------------------------------------------------------------------ constructors

    @classmethod
    def from_lists(cls, ids_per_token: Sequence[Sequence[int]], vocab_size: int,
                   device: torch.device | str | None = None) -> "KeptSet":
        """One list of kept ids per token (vLLM's per-token ascending id lists; any order is accepted)."""
        if isinstance(ids_per_token, torch.Tensor):
            raise TypeError("KeptSet.from_lists takes a list of per-token id lists; for a tensor use from_padded")
        lengths, flat = [], []
        for n, row in enumerate(ids_per_token):
            row = row.tolist() if isinstance(row, torch.Tensor) else list(row)
            for j in row:
                if isinstance(j, bool) or not isinstance(j, int):
                    raise TypeError(f"KeptSet.from_lists: token {n} holds {j!r}, expected int ids")
            lengths.append(len(row))
            flat.extend(sorted(row))
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        if lengths:
            offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        ids = torch.tensor(flat, dtype=torch.int64)
        return cls(ids.to(device) if device is not None else ids, offsets.to(ids.device if device is None else device),
                   vocab_size, width=max(lengths, default=0))

    @classmethod
    def from_padded(cls, ids: torch.Tensor, vocab_size: int, pad_id: int = -1) -> "KeptSet":
        """``[N, K]`` or ``[B, T, K]`` ids, ``pad_id`` where a token keeps fewer than K (any order within a row)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() not in (2, 3) or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"KeptSet.from_padded takes an int32/int64 [N, K] or [B, T, K] tensor, got {_describe(ids)}")
        lead = tuple(ids.shape[:-1])
        flat = ids.reshape(-1, ids.shape[-1]).to(torch.int64)
        valid = flat != pad_id
        # pads sort last: replace them by V (outside every id) before sorting each row
        keyed = torch.where(valid, flat, torch.full_like(flat, vocab_size if vocab_size > 0 else 0))
        if (keyed < 0).any():
            n, k = (int(i) for i in (keyed < 0).nonzero()[0])
            raise ValueError(f"KeptSet: {token_name(n, lead)} holds id {int(flat[n, k])}, expected ids in "
                             f"[0, {vocab_size}) or pad_id={pad_id}")
        sorted_ids, _ = keyed.sort(dim=1)
        counts = valid.sum(1)
        keep = torch.arange(flat.shape[1], device=flat.device)[None, :] < counts[:, None]
        offsets = torch.zeros(flat.shape[0] + 1, dtype=torch.int64, device=flat.device)
        offsets[1:] = counts.cumsum(0)
        return cls(sorted_ids[keep], offsets, vocab_size, lead, width=flat.shape[1])

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "KeptSet":
        """A bool ``[..., V]`` mask, True where the id is kept."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() < 2:
            raise TypeError(f"KeptSet.from_mask takes a bool [..., V] tensor, got {_describe(mask)}")
        lead = tuple(mask.shape[:-1])
        flat = mask.reshape(-1, mask.shape[-1])
        rows, cols = flat.nonzero(as_tuple=True)  # row-major: ascending ids within each token
        offsets = torch.zeros(flat.shape[0] + 1, dtype=torch.int64, device=mask.device)
        sizes = flat.sum(1)
        offsets[1:] = sizes.cumsum(0)
        width = int(sizes.max()) if sizes.numel() else 0  # (nonzero above read the host already)
        return cls(cols.to(torch.int64), offsets, mask.shape[-1], lead, validate=False, width=width)

    # ----------------------------------------------------------------------------------------------- access

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def sizes(self) -> torch.Tensor:  # [N] int64
        """How many ids each token keeps."""
        return self.offsets[1:] - self.offsets[:-1]

    def to(self, *args, **kwargs) -> "KeptSet":
        """Move to a device (dtype arguments are ignored: ids stay int64)."""
        device = None
        for a in args:
            if isinstance(a, (torch.device, str)):
                device = a
        device = kwargs.get("device", device)
        if device is None:
            return self
        non_blocking = kwargs.get("non_blocking", False)
        return KeptSet(self.ids.to(device, non_blocking=non_blocking), self.offsets.to(device, non_blocking=non_blocking),
                       self.vocab_size, self.lead_shape, validate=False, width=self.width, overlap=self.overlap)

    def __getitem__(self, index) -> "KeptSet":
        """Rows (tokens) ``index``: an int, a slice with step 1, or a 1-D int64 / bool tensor of token rows."""
        n = len(self)
        if isinstance(index, int):
            if not -n <= index < n:
                raise IndexError(f"KeptSet row {index} out of range for {n} tokens")
            index = slice(index % n, index % n + 1)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                index = torch.arange(start, stop, step, device=self.device)
            else:
                stop = max(stop, start)
                o = self.offsets[start : stop + 1]
                base = o[0]
                lo, hi = int(base), int(o[-1])
                return KeptSet(self.ids[lo:hi], o - base, self.vocab_size, validate=False, width=self.width,
                               overlap=self.overlap)
        if isinstance(index, torch.Tensor):
            if index.dtype == torch.bool:
                if index.shape != (n,):
                    raise IndexError(f"KeptSet bool index must be [{n}], got {tuple(index.shape)}")
                index = index.nonzero().squeeze(1)
            index = index.to(self.device, torch.int64).reshape(-1)
            starts, counts = self.offsets[index], self.sizes()[index]
            offsets = torch.zeros(index.numel() + 1, dtype=torch.int64, device=self.device)
            offsets[1:] = counts.cumsum(0)
            # gather positions: for each output slot, its row's start plus its rank inside the row
            row_of = torch.repeat_interleave(torch.arange(index.numel(), device=self.device), counts)
            pos = starts[row_of] + (torch.arange(int(offsets[-1]), device=self.device) - offsets[:-1][row_of])
            return KeptSet(self.ids[pos], offsets, self.vocab_size, validate=False, width=self.width,
                           overlap=self.overlap)
        raise TypeError(f"KeptSet indices are ints, slices or int/bool tensors, got {type(index).__name__}")

    def rows_of_sequences(self, start: int, stop: int) -> "KeptSet":
        """The tokens of sequences ``start:stop`` of a ``[B, T]`` layout (trainers split batches by sequence)."""
        if len(self.lead_shape) != 2:
            raise ValueError(f"rows_of_sequences needs a [B, T] KeptSet, this one is laid out as {self.lead_shape}")
        T = self.lead_shape[1]
        out = self[start * T : stop * T]
        out.lead_shape = (max(0, min(stop, self.lead_shape[0]) - start), T)
        return out

    def with_overlap(self, overlap: bool | None) -> "KeptSet":
        """This set (the same tensors) with ``overlap`` stated: True when neighbouring tokens' sets share most of their
        ids (the engine takes union tiles), False when they share few (the per-row plan), None to let it decide."""
        return KeptSet(self.ids, self.offsets, self.vocab_size, self.lead_shape, validate=False, width=self.width,
                       overlap=overlap)

    def describe_plan(self, host_sync: bool = True):
        """Which plan the kept-set engine runs for this set (``fastrl.ops.kept.build_plan``), what it computes and
        why: ``print(ks.describe_plan())``. ``host_sync=False``: the choice of the no-sync path and
        ``torch.compile``. Ignored tokens are planned too here (the ops drop them first where the host may be read)."""
        return choose_for(self.ids, self.offsets, self.vocab_size, self.width, self.overlap, host_sync, self.device,
                          count=True)  # (asked for: its logits are counted, a read of the set sizes)

    def padded(self, pad_id: int = -1) -> torch.Tensor:  # [N, K_max] int64
        """Dense ``[N, K_max]`` ids, ``pad_id`` after each token's last id."""
        n = len(self)
        sizes = self.sizes()
        k = int(sizes.max()) if n else 0
        out = torch.full((n, k), pad_id, dtype=torch.int64, device=self.device)
        if self.ids.numel():
            row_of = torch.repeat_interleave(torch.arange(n, device=self.device), sizes)
            col = torch.arange(self.ids.numel(), device=self.device) - self.offsets[:-1][row_of]
            out[row_of, col] = self.ids
        return out

    def to_mask(self) -> torch.Tensor:  # [N, V] bool: materialised, for references and tests only
        n = len(self)
        out = torch.zeros((n, self.vocab_size), dtype=torch.bool, device=self.device)
        if self.ids.numel():
            row_of = torch.repeat_interleave(torch.arange(n, device=self.device), self.sizes())
            out[row_of, self.ids] = True
        return out

    def contains(self, targets: torch.Tensor) -> torch.Tensor:  # [N] bool
        """Whether each token's ``targets`` id is in its set (False for an empty set)."""
        t = targets.reshape(-1).to(self.device, torch.int64)
        if t.numel() != len(self):
            raise ValueError(f"targets hold {t.numel()} tokens, the KeptSet {len(self)}")
        if self.ids.numel() == 0:
            return torch.zeros_like(t, dtype=torch.bool)
        row_of = torch.repeat_interleave(torch.arange(len(self), device=self.device), self.sizes())
        hit = torch.zeros(len(self), dtype=torch.int64, device=self.device)
        hit.index_add_(0, row_of, (self.ids == t[row_of]).to(torch.int64))
        return hit > 0

    def check_tokens(self, targets: torch.Tensor, ignore_index: int = -100, name: str = "support") -> None:
        """The checks an op makes before computing over this set: one row per token, a non-empty set at every
        counted token, and the target inside it. ``ValueError`` naming the token (the data is misaligned)."""
        N = targets.numel()
        lead = tuple(targets.shape)
        if len(self) != N:
            raise ValueError(f"{name} has {len(self)} tokens, expected one per target: targets of shape {lead} "
                             f"hold {N}")
        counted = targets.reshape(-1).to(self.device) != ignore_index
        empty = counted & (self.sizes() == 0)
        if bool(empty.any()):
            n = int(empty.nonzero()[0, 0])
            raise ValueError(f"{name} is empty at counted {token_name(n, lead)}: every token that is not "
                             f"ignore_index={ignore_index} must keep at least one id")
        outside = counted & ~self.contains(targets)
        if bool(outside.any()):
            n = int(outside.nonzero()[0, 0])
            raise ValueError(
                f"{name} does not contain the target at {token_name(n, lead)} (id {int(targets.reshape(-1)[n])}): "
                "a sampled token is always in the set it was drawn from, so the kept sets and the targets are "
                "misaligned"
            )

    def _validate(self) -> None:
        n = len(self)
        o = self.offsets
        if int(o[0]) != 0 or int(o[-1]) != self.ids.numel() or (n and bool((o[1:] < o[:-1]).any())):
            raise ValueError(f"KeptSet offsets must rise from 0 to len(ids)={self.ids.numel()}")
        if self.ids.numel() == 0:
            return
        row_of = torch.repeat_interleave(torch.arange(n, device=self.device), self.sizes())
        bad = (self.ids < 0) | (self.ids >= self.vocab_size)
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            raise ValueError(f"KeptSet: {token_name(int(row_of[k]), self.lead_shape)} keeps id {int(self.ids[k])}, "
                             f"expected ids in [0, {self.vocab_size})")
        same_row = row_of[1:] == row_of[:-1]
        if bool((same_row & (self.ids[1:] < self.ids[:-1])).any()):
            # unsorted rows (a hand-built CSR): sort them, stable per row
            key = row_of * self.vocab_size + self.ids
            self.ids = self.ids[key.argsort()]
        dup = same_row & (self.ids[1:] == self.ids[:-1])
        if bool(dup.any()):
            k = int(dup.nonzero()[0, 0])
            raise ValueError(f"KeptSet: {token_name(int(row_of[k]), self.lead_shape)} keeps id {int(self.ids[k])} "
                             "twice; each id may be kept once")

    def __repr__(self) -> str:
        sizes = self.sizes()
        mean = float(sizes.float().mean()) if len(self) else 0.0
        return (f"KeptSet(tokens={len(self)}, vocab_size={self.vocab_size}, kept={self.ids.numel()}, "
                f"mean_size={mean:.1f}, width={self.width}, device={self.device})")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


_ORDERS = ("vllm", "transformers")
_TIES = ("keep", "index")


@dataclass(frozen=True)
class SamplerRule:
    """A sampler's truncation rule, replayed on the training logits (after the op's temperature).

    - ``top_k`` (0 = off), ``top_p`` (1.0 = off), ``min_p`` (0.0 = off).
    - ``order="vllm"``: min_p (keep ``z >= z_max + log(min_p)``) -> top_k -> top_p over the renormalised
      survivors (keep an id iff the mass strictly above it is < top_p; the top id is always kept).
      ``order="transformers"``: top_k -> top_p -> min_p exactly as transformers' ``TopKLogitsWarper``,
      ``TopPLogitsWarper`` and ``MinPLogitsWarper`` compute them.
    - ``ties="keep"``: every id tied with the k-th value is kept (transformers, vLLM's PyTorch path); ``"index"``:
      exactly k, lowest ids first (at the top-p cut too).
    - ``min_tokens`` / ``stop_token_ids``: at completion positions < ``min_tokens`` the stop ids leave the support
      before the truncation rules (as generate's ``min_new_tokens`` and vLLM's ``min_tokens`` do). Column t of a
      ``[B, T]`` input is position t; a flat input with ``min_tokens > 0`` raises.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    order: str = "vllm"
    ties: str = "keep"

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplerRule.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplerRule.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplerRule.min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"SamplerRule.min_tokens must be an int >= 0, got {self.min_tokens!r}")
        stops = self.stop_token_ids
        if isinstance(stops, int) and not isinstance(stops, bool):
            stops = (stops,)
        try:
            stops = tuple(stops)
        except TypeError:
            raise ValueError(f"SamplerRule.stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in stops):
            raise ValueError(f"SamplerRule.stop_token_ids must be ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(sorted(set(stops))))
        if self.min_tokens > 0 and not self.stop_token_ids:
            raise ValueError("SamplerRule.min_tokens > 0 needs stop_token_ids (the ids it keeps out of the support)")
        if self.order not in _ORDERS:
            raise ValueError(f"SamplerRule.order must be one of {_ORDERS}, got {self.order!r}")
        if self.ties not in _TIES:
            raise ValueError(f"SamplerRule.ties must be one of {_TIES}, got {self.ties!r}")

    @property
    def is_identity(self) -> bool:
        """True when the rule keeps every id (nothing to replay)."""
        return self.top_k == 0 and self.top_p >= 1.0 and self.min_p == 0.0 and self.min_tokens == 0


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
