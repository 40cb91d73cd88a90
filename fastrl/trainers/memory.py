"""Long completions on limited memory: the two options of fastrl's trainers that shrink the rest of the step.

Once the LM head keeps the ``[tokens, vocab]`` logits out of memory (fastrl's fused head; TRL 1.16's chunked one on
a GPU), what decides the longest completion that fits is the body of the model (DESIGN.md, "Long completions"):

* the activations saved for backward: with activation checkpointing, one ``[tokens, hidden]`` tensor per decoder
  layer. ``activation_offloading=True`` moves every saved tensor to CPU memory in the forward and brings it back
  in the backward: TRL's ``OffloadActivations`` (``trl.models.activation_offloading``), entered the way TRL's
  ``SFTTrainer`` does (around each training step, output-head hooks from ``get_act_offloading_ctx_manager``).
* the decoder MLP's ``[tokens, intermediate]`` tensors (4-6x the hidden width, several of them) while one layer is
  recomputed and differentiated. ``tiled_mlp=n`` runs every decoder MLP over ``n`` chunks of the tokens, each
  chunk under ``torch.utils.checkpoint`` (non-reentrant), so the forward keeps only each chunk's input and the
  backward recomputes and differentiates one chunk at a time: one chunk's intermediates live at once.
  The MLP is applied token by token, so the result is the same function of the same weights; only the order of
  the weight-gradient sums changes (float32: last-bit differences).

Both leave the loss and the gradients unchanged and compose with activation checkpointing (nested checkpoints),
PEFT / LoRA (the MLP's own forward runs, LoRA layers included) and fastrl's fused head. Without gradients
(rollout, reference and old log-probs) nothing is saved, so offloading has no effect there; the tiled MLP still
runs in chunks of at least ``NO_GRAD_MIN_CHUNK_TOKENS`` tokens, which bounds the forward's transient
``[tokens, intermediate]`` tensors (decoding steps of ``generate``, a few tokens each, run whole).

``MemoryOptions`` applies both to a trainer's models and undoes them (``undo()``; the trainers call it when
``train()`` returns): the tiled MLPs get their original ``forward`` back (the modules themselves are never
replaced, so parameter names, ``state_dict`` keys and optimizer state are untouched) and the output-head hooks
that ``get_act_offloading_ctx_manager`` registered are removed.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["MemoryOptions", "MemoryStepsMixin", "TiledMLP", "tile_mlp", "find_decoder_mlps", "check_memory_options",
           "trl_alias_warnings_silenced", "NO_GRAD_MIN_CHUNK_TOKENS"]

# without gradients a chunk only bounds transient memory: smaller chunks cost GEMM efficiency for nothing
NO_GRAD_MIN_CHUNK_TOKENS = 256
_MISSING = object()


def check_memory_options(activation_offloading, tiled_mlp) -> None:
    """Config validation shared by ``GRPOConfig`` and ``PPOConfig``."""
    if not isinstance(activation_offloading, bool):
        raise ValueError(f"activation_offloading must be True or False, got {activation_offloading!r}")
    if not isinstance(tiled_mlp, int) or isinstance(tiled_mlp, bool) or tiled_mlp < 0:
        raise ValueError(
            f"tiled_mlp must be an int >= 0 (0: off; n: each decoder MLP over n sequence chunks), got {tiled_mlp!r}"
        )


# ---------------------------------------------------------------------------------------------------------------
# Tiled MLP
# ---------------------------------------------------------------------------------------------------------------


def find_decoder_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, mlp)`` for every layer of an ``nn.ModuleList`` (a decoder's layers) that has an ``mlp`` module."""
    found, seen = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        for i, layer in enumerate(module):
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, nn.Module) and id(mlp) not in seen:
                seen.add(id(mlp))
                found.append((f"{name}.{i}.mlp" if name else f"{i}.mlp", mlp))
    return found


def _tiled_call(fn, module: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    """``fn(x)`` (a token-wise map ``[..., W] -> [..., W']``) over ``n`` chunks of the tokens."""
    width = x.shape[-1]
    tokens = x.numel() // width if width else 0
    grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))
    chunks = min(n, tokens) if grad else min(n, tokens // NO_GRAD_MIN_CHUNK_TOKENS)
    if chunks < 1 or (chunks == 1 and not grad):
        return fn(x)
    flat = x.reshape(1, tokens, width)  # [1, N, W]: chunks along dim 1 stay contiguous and 3-D
    if grad:
        # each chunk keeps only its input; its intermediates are recomputed when its gradient is needed
        outs = [checkpoint(fn, part, use_reentrant=False) for part in flat.chunk(chunks, dim=1)]
    else:
        outs = [fn(part) for part in flat.chunk(chunks, dim=1)]
    out = torch.cat(outs, dim=1)  # [1, N, W']
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _input_width(mlp: nn.Module) -> int | None:
    for m in mlp.modules():
        for attr in ("in_features", "nx"):  # nn.Linear (and PEFT / bitsandbytes layers), transformers' Conv1D
            w = getattr(m, attr, None)
            if isinstance(w, int) and w > 0:
                return w
    return None


def _refusal(name: str, mlp: nn.Module) -> str | None:
    """Why ``mlp`` cannot be tiled (None: it can); runs it once on a few random tokens to check it is token-wise."""
    kind = type(mlp).__name__
    if "forward" in vars(mlp) and getattr(vars(mlp)["forward"], "_fastrl_tiled", False):
        return f"{name} ({kind}) is tiled already (another MemoryOptions holds it; undo that one first)"
    if any(isinstance(getattr(m, "experts", None), nn.Module) for m in mlp.modules()):
        return (f"{name} ({kind}) is a mixture-of-experts block: its router outputs are recorded per call, so running "
                "it in chunks would change the auxiliary loss; tiled_mlp supports dense MLPs")
    width = _input_width(mlp)
    if width is None:
        return f"{name} ({kind}) has no linear layer that tells its input width"
    p = next((p for p in mlp.parameters() if p.is_floating_point()), None)
    if p is None or p.device.type == "meta" or p.numel() == 0:
        return f"{name} ({kind}) has no materialised floating-point weights (meta device or sharded)"
    x = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0)).to(p.device, p.dtype)
    modes = [(m, m.training) for m in mlp.modules()]
    mlp.eval()  # dropout off: the two runs must see the same function
    try:
        with torch.no_grad():
            whole = mlp.forward(x)
            if not isinstance(whole, torch.Tensor) or whole.shape[:-1] != x.shape[:-1]:
                got = type(whole).__name__ if not isinstance(whole, torch.Tensor) else tuple(whole.shape)
                return f"{name} ({kind}) maps [2, 3, {width}] to {got}, not one tensor per token"
            # chunks of 4 and 2 tokens that cross the sequence boundary, as the tiled forward's chunks do
            parts = torch.cat([mlp.forward(x.reshape(1, 6, width)[:, a:b]) for a, b in ((0, 4), (4, 6))], dim=1)
    except Exception as e:  # noqa: BLE001 - any failure of the check is a refusal that says what happened
        return f"{name} ({kind}) failed on 6 random {p.dtype} tokens of width {width}: {type(e).__name__}: {e}"
    finally:
        for m, training in modes:
            m.training = training
    tol = (1e-4 if p.dtype in (torch.float32, torch.float64) else 5e-2) * whole.abs().max().clamp(min=1e-6).item()
    err = (parts.reshape(whole.shape) - whole).abs().max().item()
    if not err <= tol:
        return (f"{name} ({kind}) is not token-wise: on 6 random tokens, running them in 2 chunks changed its output "
                f"by {err:.3g} (allowed {tol:.3g})")
    return None


class TiledMLP:
    """The decoder MLPs of one model, each running over ``n`` token chunks until ``undo()``; see ``tile_mlp``."""

    def __init__(self, model: nn.Module, n: int, mlps: list[tuple[str, nn.Module]]):
        self.model, self.n = model, n
        self.mlps = mlps
        self._saved: list[tuple[nn.Module, object]] = []
        for _, mlp in mlps:
            saved = vars(mlp).get("forward", _MISSING)  # an instance forward (e.g. accelerate's hooks) stays under us
            inner = mlp.forward

            def forward(hidden_states, *args, _inner=inner, _mlp=mlp, **kwargs):
                if args or kwargs:
                    raise TypeError(f"fastrl's tiled MLP passes only the hidden states to {type(_mlp).__name__}; "
                                    f"it was called with {len(args)} more positional and {sorted(kwargs)} keyword "
                                    "arguments (set tiled_mlp=0 for this model)")
                return _tiled_call(_inner, _mlp, hidden_states, self.n)

            forward._fastrl_tiled = True
            mlp.forward = forward
            self._saved.append((mlp, saved))

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def undo(self) -> None:
        """Give every MLP its own ``forward`` back (the instance attribute it had, or none). Idempotent.

        An MLP whose ``forward`` someone replaced after tiling (a hook wrapping ours) is left as it is, with a
        warning: removing ours would remove theirs too.
        """
        while self._saved:
            mlp, saved = self._saved.pop()
            current = vars(mlp).get("forward")
            if not getattr(current, "_fastrl_tiled", False):
                warnings.warn(f"tiled_mlp: the forward of {type(mlp).__name__} was replaced after it was tiled; "
                              "left as it is (it may still run in chunks)", stacklevel=2)
            elif saved is _MISSING:
                del vars(mlp)["forward"]
            else:
                mlp.forward = saved


def tile_mlp(model: nn.Module, n: int, *, what: str = "model") -> TiledMLP:
    """Run every decoder MLP of ``model`` over ``n`` token chunks, each recomputed in backward; ``.undo()`` reverts.

    Refuses (``ValueError``, nothing patched) where it cannot apply: ``n`` not an int >= 1, DeepSpeed ZeRO-3
    (partitioned weights), no decoder layers with an ``mlp`` module, a mixture-of-experts block, an MLP that is not
    token-wise or does not map each token to one output.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tiled_mlp must be an int >= 1 to tile ({what}), got {n!r}")
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ValueError(f"tiled_mlp={n}: not supported under DeepSpeed ZeRO-3 (the {what}'s MLP weights are "
                         "partitioned); use tiled_mlp=0 with ZeRO-3, or ZeRO-2")
    mlps = find_decoder_mlps(model)
    if not mlps:
        raise ValueError(
            f"tiled_mlp={n}: the {what} ({type(model).__name__}) has no decoder layers with an `mlp` module; "
            "tiled_mlp needs a decoder whose layers (an nn.ModuleList) each have an `mlp`, as Llama, Qwen2, Mistral, "
            "Gemma or GPT-2 do. Set tiled_mlp=0 for this model."
        )
    for name, mlp in mlps:
        why = _refusal(name, mlp)
        if why is not None:
            raise ValueError(f"tiled_mlp={n}: cannot tile the {what}'s MLPs: {why}. Set tiled_mlp=0 for this model.")
    return TiledMLP(model, n, mlps)


# ---------------------------------------------------------------------------------------------------------------
# Activation offloading (TRL's)
# ---------------------------------------------------------------------------------------------------------------


def _hook_keys(model: nn.Module) -> dict[int, tuple[nn.Module, set, set]]:
    return {id(m): (m, set(m._forward_pre_hooks), set(m._forward_hooks)) for m in model.modules()}


def _offload_context(model: nn.Module):
    """TRL's activation-offloading context for ``model`` and an undo for the hooks it registered; (None, None) on CPU.

    ``SFTTrainer`` calls ``get_act_offloading_ctx_manager(model)``: pinned host memory and a side stream. On a
    host "accelerator" (only where ``torch.accelerator`` reports the CPU) there is no pinning and no stream.
    """
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if acc is None or device.type != acc.type:
        return None, None
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    before = _hook_keys(model)
    host = acc.type == "cpu"
    ctx = get_act_offloading_ctx_manager(model, use_pin_memory=not host, use_streams=not host, warn_if_no_head=False)
    added = [(m, set(m._forward_pre_hooks) - pre, set(m._forward_hooks) - fwd) for m, pre, fwd in before.values()]

    def remove_hooks():
        for m, pre, fwd in added:
            for k in pre:
                m._forward_pre_hooks.pop(k, None)
            for k in fwd:
                m._forward_hooks.pop(k, None)
                getattr(m, "_forward_hooks_always_called", {}).pop(k, None)

    return ctx, remove_hooks


# ---------------------------------------------------------------------------------------------------------------
# Both, on a trainer's models
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Applied:
    tiled: list[TiledMLP]
    offload: object | None = None  # TRL's OffloadActivations, built at the first step (the model is on its device)
    offload_checked: bool = False
    remove_hooks: object | None = None


class MemoryOptions:
    """``activation_offloading`` and ``tiled_mlp`` on a trainer's models.

    Args:
        trained: the model the optimizer trains (its saved activations are offloaded in ``step_context()``).
        models: every model whose MLPs are tiled, as ``{"what": model}`` (the trained one, reference, value and
            reward models; None entries are skipped).
        activation_offloading, tiled_mlp: the config options.

    ``apply()`` (done on construction, so a model that cannot be tiled is refused there; idempotent) patches,
    ``undo()`` restores; ``step_context()`` is the context a training step (forward + backward) runs in: TRL's
    ``OffloadActivations`` with offloading on an accelerator, else a null context. The offloading context is
    built at the first step, when the trainer has put the model on its device. With offloading asked for on a
    CPU-only model there is nothing to move (activations are already in host memory): a warning says so and the
    step runs as without it.
    """

    def __init__(self, trained: nn.Module, models: dict, *, activation_offloading: bool = False, tiled_mlp: int = 0):
        check_memory_options(activation_offloading, tiled_mlp)
        self.trained = trained
        self.models, seen = {}, set()
        for what, model in models.items():
            if model is not None and id(model) not in seen:  # e.g. one model passed as both value and reward model
                seen.add(id(model))
                self.models[what] = model
        self.activation_offloading, self.tiled_mlp = activation_offloading, tiled_mlp
        self._applied: _Applied | None = None
        self._warned = False
        self.apply()

    @property
    def enabled(self) -> bool:
        return self.activation_offloading or self.tiled_mlp > 0

    @property
    def applied(self) -> bool:
        return self._applied is not None

    def apply(self) -> None:
        if self._applied is not None or not self.enabled:
            return
        tiled: list[TiledMLP] = []
        try:
            if self.tiled_mlp:
                for what, model in self.models.items():
                    tiled.append(tile_mlp(model, self.tiled_mlp, what=what))
        except Exception:
            for t in tiled:
                t.undo()
            raise
        self._applied = _Applied(tiled)

    def undo(self) -> None:
        """Restore every model as it was before ``apply()``. Idempotent."""
        applied, self._applied = self._applied, None
        if applied is None:
            return
        for t in applied.tiled:
            t.undo()
        if applied.remove_hooks is not None:
            applied.remove_hooks()

    def step_context(self):
        """The context one training step's forward + backward runs in (offloading, or nothing)."""
        a = self._applied
        if a is None or not self.activation_offloading:
            return contextlib.nullcontext()
        if not a.offload_checked:
            a.offload_checked = True
            a.offload, a.remove_hooks = _offload_context(self.trained)
            if a.offload is None and not self._warned:
                self._warned = True
                warnings.warn("activation_offloading=True has no effect here: the model is not on an accelerator, "
                              "so its activations already live in host memory", stacklevel=3)
        return a.offload if a.offload is not None else contextlib.nullcontext()

    @property
    def offload_context(self):
        """TRL's ``OffloadActivations`` in use (built at the first ``step_context()``), or None."""
        return self._applied.offload if self._applied is not None else None


def during_training(train):
    """Decorator for a trainer's ``train``: the memory options applied while it runs, undone when it returns."""
    @functools.wraps(train)
    def wrapper(self, *args, **kwargs):
        memory = getattr(self, "_fastrl_memory", None)
        if memory is None:
            return train(self, *args, **kwargs)
        memory.apply()
        try:
            return train(self, *args, **kwargs)
        finally:
            memory.undo()

    return wrapper


class MemoryStepsMixin:
    """The memory options of a TRL trainer subclass that sets ``self._fastrl_memory`` (a ``MemoryOptions``):
    applied while ``train()`` runs, and each training step inside ``step_context()``. Put it before the TRL class
    in the bases (``class GRPOTrainer(MemoryStepsMixin, trl.GRPOTrainer)``)."""

    @during_training
    def train(self, *args, **kwargs):
        return super().train(*args, **kwargs)

    def training_step(self, *args, **kwargs):
        with self._fastrl_memory.step_context():
            return super().training_step(*args, **kwargs)


# transformers 5's deprecation messages for the aliases TRL 1.16 still calls during generation
_TRL_ALIAS_WARNINGS = (r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)`"
                       r" is deprecated")


@contextlib.contextmanager
def trl_alias_warnings_silenced():
    """TRL 1.16 wraps generation in ``trl.models.utils.disable_gradient_checkpointing``, which reads
    ``model.is_gradient_checkpointing`` and calls ``gradient_checkpointing_disable/enable``: transformers 5's
    deprecated aliases, a FutureWarning each that no user setting avoids and that changes nothing. Silences exactly
    those three messages, inside this context only; any other warning passes through."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRL_ALIAS_WARNINGS, category=FutureWarning)
        yield
