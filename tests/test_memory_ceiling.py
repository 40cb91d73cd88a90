"""The memory ceiling (issue 44): a default never holds more memory than what it replaces; more is an opt-in budget.

* ``budget.ceiling`` is what TRL 1.16's chunked log-prob held on the GPU (its rows in the committed H200 session);
* the budget knob (``fastrl.set_memory_budget`` / ``FASTRL_MEMORY_BUDGET``) parses fractions and bytes, refuses the
  rest naming what came, and a raised budget gives back each path's speed choice;
* every default path's planned memory (the one-pass loss on both Triton implementations, path A's tiles and G slices,
  the forward's tile) is within the ceiling at W1 / W2 / W1-lp / W2-lp / W3 on 24, 80 and 141 GiB devices;
* the plan is what runs: the one-pass loss's peak memory on the CPU (forward + backward, a budget in bytes forcing
  several chunks) is within ``budget.one_pass_bytes`` and the budget, counted from the allocator's own events;
* the compensated bf16 weight-gradient sum is as accurate as the float32 accumulator it replaces (against float64),
  its Triton kernel equal to the torch combine bit for bit;
* the backward scales the one-pass gradients in place: no second [V, H] gradient at the peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastrl
from fastrl import PolicyLossConfig
from fastrl.ops import budget, hybrid, one_pass
from fastrl.ops._gemm import compensated_addmm_
from test_budget import _peak_allocated

REPO = Path(__file__).resolve().parent.parent
SESSION = REPO / "bench" / "results" / "nvidia-h200" / "2026-11-28-e173782" / "session.json"
GiB, MiB = 1 << 30, 1 << 20
W_V, N16 = 151936, 16384
CUDA = torch.device("cuda")  # a device name: nothing here runs on it


@pytest.fixture
def knob():
    """Restores the budget a test sets."""
    before = budget.get_memory_budget()
    yield budget.set_memory_budget
    budget.set_memory_budget(before)


# ------------------------------------------------------------------------------------------ the ceiling and the knob

def test_ceiling_is_what_trl_held_on_the_gpu():
    """The formula against TRL's rows of the committed H200 session (extra MiB, same process as fastrl's rows)."""
    rows = {r["workload"]: r["extra_mb"] for r in json.loads(SESSION.read_text())["rows"]
            if r.get("section") == "tournament" and r.get("provider") == "trl"}
    for workload, H, grads in (("W1-lp", 4096, True), ("W2-lp", 896, True), ("W3", 4096, False)):
        model = budget.ceiling(N16, W_V, H, torch.bfloat16, need_weight=grads, need_hidden=grads) / MiB
        assert abs(model - rows[workload]) <= 0.005 * rows[workload], (workload, model, rows[workload])


@pytest.mark.parametrize("value, parsed", [(None, None), ("auto", None), ("", None), (0.0625, 0.0625), ("0.5", 0.5),
                                           ("8GiB", 8 * GiB), ("512MiB", 512 * MiB), ("3000000000", 3_000_000_000),
                                           (GiB, GiB), ("2e9", None), ("2.5GB", 2_500_000_000)])
def test_budget_values(value, parsed):
    if value == "2e9":  # a float string above 1 is neither a fraction nor an int of bytes
        with pytest.raises(ValueError, match=r"fraction of device memory must be in \(0, 1\], got 2000000000.0"):
            budget.parse_budget(value)
        return
    assert budget.parse_budget(value) == parsed


@pytest.mark.parametrize("value, error, match", [
    (1.5, ValueError, r"must be in \(0, 1\], got 1.5"),
    (0.0, ValueError, r"must be in \(0, 1\], got 0.0"),
    (100, ValueError, r"in bytes must be at least 1 MiB \(1048576\), got 100"),
    ("8 gigs", ValueError, r"must be a fraction .* got '8 gigs'"),
    (True, TypeError, r"must be None, a float fraction .* got bool"),
    ([1], TypeError, r"got list"),
])
def test_bad_budgets_are_named(value, error, match, knob):
    with pytest.raises(error, match=match):
        knob(value)
    assert budget.get_memory_budget() is None  # a refused value changes nothing


def test_env_budget_is_read_at_import():
    code = "import fastrl; from fastrl.ops import budget; print(budget.get_memory_budget())"
    env = {**os.environ, "FASTRL_MEMORY_BUDGET": "8GiB"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == str(8 * GiB), out.stderr
    env["FASTRL_MEMORY_BUDGET"] = "lots"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "FASTRL_MEMORY_BUDGET must be a fraction" in out.stderr and "'lots'" in out.stderr


def test_public_knob(knob):
    assert fastrl.set_memory_budget is budget.set_memory_budget and "set_memory_budget" in fastrl.__all__
    assert knob(0.25) is None and fastrl.get_memory_budget() == 0.25 and knob(None) == 0.25


# ------------------------------------------------------------------------ every default path within the ceiling

WORK = {  # workload -> (hidden width, live tokens of the 16384 rows, gradients)
    "W1": (4096, 12288, True), "W2": (896, 12288, True), "W1-lp": (4096, N16, True), "W2-lp": (896, N16, True),
    "W3": (4096, N16, False),
}


def _one_pass(monkeypatch, memory_gib, backend, H, live):
    monkeypatch.setattr(budget, "device_memory", lambda device: memory_gib * GiB)
    rows = one_pass.chunk_budget(W_V, CUDA, True, None, backend, torch.bfloat16, live, H, N16)
    return rows, budget.one_pass_bytes(rows, live, W_V, H, torch.bfloat16, backend, True)


@pytest.mark.parametrize("memory_gib", [24, 80, 141])
@pytest.mark.parametrize("workload", ["W1", "W2"])
@pytest.mark.parametrize("backend", ["triton-sm90", "triton-hybrid"])
def test_one_pass_loss_within_the_ceiling(monkeypatch, memory_gib, workload, backend):
    """The one-pass chunk plan holds at most TRL's memory, as long a chunk as fits (one more block would not)."""
    H, live, _ = WORK[workload]
    cap = budget.ceiling(N16, W_V, H, torch.bfloat16, True, True)
    rows, planned = _one_pass(monkeypatch, memory_gib, backend, H, live)
    assert 128 <= rows < live and planned <= cap, (rows, planned / MiB, cap / MiB)
    speed = budget.one_pass_rows(W_V, H, live, torch.bfloat16, total_memory=memory_gib * GiB,
                                 row_bytes=None if backend == "triton-sm90" else 4 * W_V)
    more = budget.one_pass_bytes(rows + 128, live, W_V, H, torch.bfloat16, backend, True)
    assert rows == speed or more > cap, f"{rows} rows leave room for another block ({more / MiB:.0f} MiB)"


@pytest.mark.parametrize("memory_gib, H, rows", [(80, 4096, N16), (141, 896, N16), (80, 4096, 8192)])
def test_a_raised_budget_gives_the_speed_choice_back(monkeypatch, knob, memory_gib, H, rows):
    """1/16 of the device: the sm90 one-pass row's own choice (W1 / W2 in one chunk on 80 GB: no accumulator)."""
    knob(1 / 16)
    got, planned = _one_pass(monkeypatch, memory_gib, "triton-sm90", H, N16 if rows == N16 else 24576)
    speed = budget.one_pass_rows(W_V, H, N16 if rows == N16 else 24576, torch.bfloat16, total_memory=memory_gib * GiB)
    assert got == speed == rows and planned <= memory_gib * GiB / 16


@pytest.mark.parametrize("memory_gib", [24, 80, 141])
@pytest.mark.parametrize("workload", ["W1-lp", "W2-lp", "W3"])
def test_path_a_and_forward_tiles_within_the_ceiling(monkeypatch, memory_gib, workload):
    """Path A's G slices (sm90, in the input dtype) and float32 tiles (hybrid), and the forward's tile, beside the
    float32 [N, H] hidden-gradient accumulator and the O(N) vectors."""
    monkeypatch.setattr(budget, "device_memory", lambda device: memory_gib * GiB)
    H, _, grads = WORK[workload]
    need = (grads, grads, False)
    cap = budget.ceiling(N16, W_V, H, torch.bfloat16, grads, grads)
    besides = budget.O_N_BYTES * N16 + (4 * N16 * H if grads else 0)
    room = budget.memory_budget(N16, W_V, H, torch.bfloat16, CUDA, grads, grads) - besides
    rows = N16 if grads else hybrid.ROWS
    assert rows * hybrid.tile_columns(rows, W_V, None, room) * 4 + besides <= cap
    if grads:  # sm90's G slices: the device's share (1/128), cut to the ceiling
        cols = budget.grad_columns(N16, W_V, torch.bfloat16, CUDA, budget=cap, H=H)
        speed = budget.grad_columns(N16, W_V, torch.bfloat16, CUDA)
        assert N16 * cols * 2 + besides <= cap and (cols == speed or N16 * (cols + 256) * 2 + besides > cap)


# ------------------------------------------------------------------------------ the plan is what runs (CPU)

def _loss_inputs(B, T, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g) / 2).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    old = (torch.randn(B, T, generator=g) * 0.05 - 8.0)
    return h, w, t, adv, mask, old


def test_one_pass_memory_measured_within_the_plan(knob):
    """A budget in bytes that leaves room for ~1/4 of the tokens per chunk: the chunks, the compensated bf16
    accumulator and the in-place backward scaling, measured as the allocator saw them."""
    B, T, H, V = 4, 128, 64, 8192
    h, w, t, adv, mask, old = _loss_inputs(B, T, H, V, torch.bfloat16)
    N = B * T
    full = budget.one_pass_bytes(N, N, V, H, torch.bfloat16, "torch", True)
    knob(int(full * 0.45))
    rows = one_pass.chunk_budget(V, torch.device("cpu"), True, None, "torch", torch.bfloat16, N, H, N)
    assert 1 < -(-N // rows) <= 8, rows
    planned = budget.one_pass_bytes(rows, N, V, H, torch.bfloat16, "torch", True)
    assert planned <= budget.get_memory_budget()

    def step():
        loss, _ = fastrl.policy_loss(h, w, t, adv, mask, config=PolicyLossConfig(), old_logprobs=old,
                                     backend="torch")
        step.grads = torch.autograd.grad(loss, (h, w))

    step()  # warm
    peak, end = _peak_allocated(step)
    outputs = sum(x.numel() * x.element_size() for x in step.grads)
    assert end == outputs, f"the step left {end - outputs} bytes allocated besides its gradients"
    assert peak - outputs <= planned, f"peak {(peak - outputs) / MiB:.2f} MiB besides the gradients > plan " \
                                      f"{planned / MiB:.2f} MiB ({rows} rows per chunk)"


def test_backward_scales_in_place():
    """One chunk: the forward formed the gradients; the backward adds no [V, H] or [N, H] copy to scale them."""
    B, T, H, V = 2, 64, 64, 4096
    h, w, t, adv, mask, old = _loss_inputs(B, T, H, V, torch.float32, seed=1)
    loss, _ = fastrl.policy_loss(h, w, t, adv, mask, config=PolicyLossConfig(), old_logprobs=old, backend="torch")
    peak, _ = _peak_allocated(lambda: torch.autograd.grad(2.0 * loss, (h, w)))
    assert peak < V * H * 4 // 4, f"the backward allocated {peak / MiB:.2f} MiB"


@pytest.mark.parametrize("backend", ["torch", "triton-hybrid"])
def test_compensated_weight_gradient_is_as_accurate_as_float32(knob, backend):
    """Several chunks with a bf16 head: grad_W from the compensated pair against float64 is as close as one chunk's
    (a float32 GEMM rounded once), and within one bf16 rounding of it everywhere."""
    B, T, H, V = 4, 64, 32, 2048
    h, w, t, adv, mask, old = _loss_inputs(B, T, H, V, torch.bfloat16, seed=2)

    def grad_w(hh, ww, chunk):
        loss, _ = fastrl.policy_loss(hh, ww, t, adv, mask, config=PolicyLossConfig(), old_logprobs=old,
                                     backend=backend if hh.dtype != torch.float64 else "torch", chunk_tokens=chunk)
        return torch.autograd.grad(loss, ww)[0]

    truth = grad_w(h.detach().double().requires_grad_(), w.detach().double().requires_grad_(), None)
    one = grad_w(h, w, B * T).double()
    many = grad_w(h, w, 32).double()  # 8 chunks
    scale = truth.abs().max()
    err_one, err_many = ((one - truth).abs().max() / scale).item(), ((many - truth).abs().max() / scale).item()
    assert err_many <= 1.05 * err_one + 1e-6, (err_many, err_one)
    # one bf16 rounding apart, or the compensation's 2^-16 of the largest partial sum where a sum cancels
    assert ((many - one).abs() <= torch.finfo(torch.bfloat16).eps * one.abs() + 2.0**-14 * scale).all()


def test_compensated_kernel_equals_the_torch_combine():
    """The Triton combine (under the interpreter here) and the torch one give the same halves bit for bit, and their
    sum is the float32 running sum to within lo's rounding."""
    g = torch.Generator().manual_seed(3)
    V, K, H = 300, 40, 24
    sums = []
    for triton in (False, True):
        hi, lo = torch.zeros(V, H, dtype=torch.bfloat16), torch.zeros(V, H, dtype=torch.bfloat16)
        ref = torch.zeros(V, H, dtype=torch.float64)
        peak = torch.zeros(V, H, dtype=torch.float64)  # the largest partial sum: what lo's rounding is relative to
        g.manual_seed(3)
        for _ in range(6):
            a = torch.randn(V, K, generator=g).to(torch.bfloat16)
            b = torch.randn(K, H, generator=g).to(torch.bfloat16)
            compensated_addmm_(hi, lo, a, b, triton)
            ref += a.double() @ b.double()
            peak = torch.maximum(peak, ref.abs())
        sums.append((hi, lo))
        err = (hi.double() + lo.double() - ref).abs()
        assert (err <= 6 * 2.0**-16 * peak + 1e-5).all(), err.max()
    assert torch.equal(sums[0][0], sums[1][0]) and torch.equal(sums[0][1], sums[1][1])
