"""Input validation shared by the public ops (every error says what was expected and what came), and the layout the
ops normalise checked inputs to (unit-stride rows, a dense bias, the live rows)."""

from __future__ import annotations

import torch

from fastrl.ops.backend import is_triton

_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TARGET_DTYPES = (torch.int32, torch.int64)


def autocast_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under ``torch.autocast``, cast the LM-head inputs to the autocast dtype, as autocast would cast them
    for the LM-head matmul. The op itself then runs with autocast off, so its float32 statistics, logits
    and gradient GEMMs are not silently demoted to bf16.

    As in autocast itself, only float32/bf16/fp16 tensors are eligible: float64 ones are left alone (so
    float64 inputs still give float64 results), and so are non-tensors and integer tensors, which the
    type checks then report.
    """
    if not isinstance(hidden, torch.Tensor):
        return hidden, weight, bias
    dev = hidden.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return hidden, weight, bias
    dt = torch.get_autocast_dtype(dev)

    def cast(t):
        eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dt) if eligible else t

    return cast(hidden), cast(weight), cast(bias)


def dense_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the kernels index it: a dense vector (``b_ptr + v``, no stride argument).

    A strided view (``b[::2]``, a column of a matrix) is copied to a contiguous one before any launch;
    autograd carries the gradient of the copy back to the view. A contiguous bias is returned as is.
    Hidden states and the weight keep any row stride (the kernels and GEMMs take it); one whose last
    dimension is strided (a transposed view) is copied by ``fastrl.ops.linear_logprob.unit_stride``.
    """
    return None if bias is None else bias.contiguous()


def check_linear_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None
) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    H = hidden.shape[-1]
    if weight.shape[1] != H:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {H}, got weight shape {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary (V = 0)")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if targets.dtype not in _TARGET_DTYPES:
        # int8/uint8/int16 cannot hold ignore_index=-100 (uint8 wraps it to 156, a valid id in a large vocabulary)
        raise TypeError(
            f"targets must be int32 or int64 (a dtype that holds the token ids and ignore_index), got {targets.dtype}"
        )
    if hidden.dtype not in _FLOAT:
        raise TypeError(f"hidden must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight and hidden must share a dtype, got hidden {hidden.dtype} and weight {weight.dtype} "
            "(cast one of them, e.g. both to float32 for an fp32 LM head)"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
    devices = {("hidden", hidden.device), ("weight", weight.device), ("targets", targets.device)}
    if bias is not None:
        devices.add(("bias", bias.device))
    if len({d for _, d in devices}) > 1:
        where = ", ".join(f"{n} on {d}" for n, d in sorted(devices, key=lambda x: x[0]))
        raise ValueError(f"all inputs must be on one device, got {where}")


def check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Targets must be in [0, V) or equal ignore_index; name the first bad position."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"target id out of range at position {idx}: got {int(targets[idx])}, expected an id in "
            f"[0, {vocab}) or ignore_index={ignore_index}"
        )


def first_non_finite(value: torch.Tensor, entropy: torch.Tensor | None, active: torch.Tensor) -> int | None:
    """The first counted token (``active`` [N] bool) whose value [N] or entropy [N] is not finite, None if none (one
    host read): the search the output checks below share."""
    bad = ~torch.isfinite(value)
    if entropy is not None:
        bad |= ~torch.isfinite(entropy)
    bad &= active
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def check_triton_dtypes(backend: str, *dtypes: torch.dtype) -> None:
    """The Triton backends compute from float32, bfloat16 or float16 inputs: float64 ones need the torch backend."""
    if is_triton(backend) and torch.float64 in dtypes:
        raise TypeError("the triton backends compute from float32, bfloat16 or float16 inputs; use backend='torch' "
                        "for float64")


def check_finite_outputs(
    logp: torch.Tensor,  # [N]
    entropy: torch.Tensor | None,  # [N]
    active: torch.Tensor,  # [N] bool
    hidden: torch.Tensor,  # [N, H]
    lead_shape: tuple[int, ...],
) -> None:
    """Raise if a non-ignored token's log-prob or entropy is not finite, saying which input holds inf/nan.

    Checked on the O(N) outputs; only the offending hidden row is inspected to tell hidden from weight.
    """
    n = first_non_finite(logp, entropy, active)
    if n is None:
        return
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(n), lead_shape)) if len(lead_shape) > 1 else (n,)
    what = "log-prob" if not torch.isfinite(logp[n]) else "entropy"
    if not bool(torch.isfinite(hidden[n]).all()):
        culprit = f"hidden{list(pos)} holds inf/nan"
    else:
        culprit = "hidden at that token is finite, so weight (or bias) holds inf/nan, or the logits overflow"
    raise FloatingPointError(
        f"non-finite {what} at token {pos} (value {float(logp[n] if what == 'log-prob' else entropy[n])}): "
        f"{culprit}. Pass check_finite=False to skip this check."
    )


def check_head(hidden, weight, bias, *, hidden_name: str, weight_name: str, bias_name: str) -> None:
    """One LM head's inputs, named as the caller's arguments are: types, ``[..., H]`` / ``[V, H]`` / ``[V]``
    shapes, float dtypes shared by the three, one device (``fused_divergence`` checks two heads this way)."""
    for name, t in ((hidden_name, hidden), (weight_name, weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"{hidden_name} must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{weight_name} must be [V, H] with H = {hidden_name}.shape[-1] = {hidden.shape[-1]}, "
                         f"got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError(f"{weight_name} has an empty vocabulary (V = 0)")
    if hidden.dtype not in _FLOAT:
        raise TypeError(f"{hidden_name} must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} and {hidden_name} must share a dtype, got {hidden_name} {hidden.dtype} and "
                        f"{weight_name} {weight.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{bias_name} must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{bias_name} must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"{bias_name} must have {hidden_name}'s dtype {hidden.dtype}, got {bias.dtype}")
    where = {(hidden_name, hidden.device), (weight_name, weight.device)}
    if bias is not None:
        where.add((bias_name, bias.device))
    if len({d for _, d in where}) > 1:
        said = ", ".join(f"{n} on {d}" for n, d in sorted(where, key=lambda x: x[0]))
        raise ValueError(f"all inputs must be on one device, got {said}")


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is contiguous (the kernels and GEMMs honour the row stride), else
    a contiguous copy (e.g. a transposed weight)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def compact_rows(active: torch.Tensor) -> torch.Tensor | None:  # [N] bool -> [A] int64 row ids, or None
    """Ids of the live rows when some rows are ignored (one host sync), None when every row is live.

    Ignored rows are then left out of every kernel and GEMM: padding costs nothing, and whatever an ignored
    row of ``hidden`` holds (even inf/NaN) cannot reach the weight gradient through ``0 * nan``.
    """
    if active.numel() == 0 or bool(active.all()):
        return None
    return active.nonzero().squeeze(1)


def token_name(n: int, lead_shape: tuple[int, ...] | None) -> str:
    if lead_shape is None or len(lead_shape) <= 1:
        return f"token {n}"
    pos = []
    for size in reversed(lead_shape):
        pos.append(n % size)
        n //= size
    return f"token {tuple(reversed(pos))}"


def check_divergence_finite(div, ent, active, hidden, teacher_hidden, lead, *, name: str = "divergence",
                            teacher: str = "teacher_") -> None:
    """Raise ``FloatingPointError`` if a counted token's divergence [N] or entropy [N] is not finite, naming the token
    (by its position in ``lead``) and the input at fault (``hidden`` [N, H] / ``teacher_hidden`` [N, H_t] rows).
    ``name`` and ``teacher``: what the caller calls the value and the teacher's inputs (the exact KL of a policy
    loss: "exact KL" and "ref_")."""
    n = first_non_finite(div, ent, active)
    if n is None:
        return
    what, value = (name, div[n]) if not torch.isfinite(div[n]) else ("entropy", ent[n])
    if not bool(torch.isfinite(hidden[n]).all()):
        culprit = "hidden holds inf/nan there"
    elif not bool(torch.isfinite(teacher_hidden[n]).all()):
        culprit = f"{teacher}hidden holds inf/nan there"
    else:
        culprit = (f"both hidden states are finite there, so weight, {teacher}weight or a bias holds inf/nan, or "
                   "the logits overflow")
    raise FloatingPointError(f"non-finite {what} at {token_name(n, lead)} (value {float(value)}): {culprit}. "
                             "Pass check_finite=False to skip this check.")
