"""A benchmark peer that refuses an input (a dtype, a shape) gives an "n/a" row with its reason, not an error.

Two ways in: a refusal the provider declares up front (``Provider.refuses``, decided in the parent, no process
started), and the peer's own error at run time when its message is one the provider names
(``Provider.refusal_messages``). Any other failure stays an "error". Runs in-process on CPU tensors.
"""

import pytest
import torch

from bench import providers as P
from bench import session_points
from bench.workloads import Workload

REFUSAL = "Backwards requires embeddings to be bf16 or fp16"


def _wl(kind="logprob", dtype="float32"):
    return Workload("tiny", kind, 8, 4, 16, dtype)


def test_cce_declares_its_float32_backward_refusal():
    cce = P.get("cce")
    status, reason = cce.unavailable(_wl("logprob", "float32"), "cuda")
    assert status == "n/a" and "float32" in reason and "bf16" in reason
    # its forward takes float32, and bf16 / fp16 backwards are fine: those are not refused
    for wl in (_wl("forward", "float32"), _wl("logprob", "bfloat16"), _wl("logprob", "float16")):
        assert cce.refuses(wl) is None, wl
    # a refusal is a property of the peer, so it is reported before "not installed here"
    assert cce.unavailable(_wl("logprob", "float32"), "cpu")[0] == "n/a"


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, message):
        ctx.message = message
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError(ctx.message)


def _fake_provider(message, refusal_messages=(REFUSAL,), fail_in="backward"):
    def build(wl, device, opts):
        if fail_in == "build":
            raise AssertionError(message)

        def fwd(st):
            i = st["inp"]
            loss = _FailingBackward.apply(i.hidden, message)
            return {"loss": loss, "logp": None, "entropy": None}

        return P.Op(fwd, lambda inp: {"inp": inp, "wrt": (inp.hidden,)}, needs_grad=True, has_entropy=False)

    return P.Provider("fake-peer", "a peer that fails", ("logprob",), build, refusal_messages=refusal_messages)


def _run(monkeypatch, provider):
    monkeypatch.setitem(P.PROVIDERS, provider.name, provider)
    spec = {"workload": _wl().to_dict(), "provider": provider.name, "device": "cpu", "reps": 1, "warmup": 0,
            "n_sets": 1, "seed": 0, "accuracy_rows": 8}
    return session_points.run_spec(spec)


@pytest.mark.parametrize("fail_in", ["backward", "build"])
def test_peer_refusal_at_run_time_is_not_applicable(monkeypatch, fail_in):
    res = _run(monkeypatch, _fake_provider(REFUSAL, fail_in=fail_in))
    assert res["status"] == "n/a", res
    assert REFUSAL in res["reason"]


def test_other_failures_stay_errors(monkeypatch):
    res = _run(monkeypatch, _fake_provider("index out of range in the kernel"))
    assert res["status"] == "error" and "index out of range" in res["reason"], res
    # the same message is an error for a peer that does not name it as a refusal
    res = _run(monkeypatch, _fake_provider(REFUSAL, refusal_messages=()))
    assert res["status"] == "error", res
    with pytest.raises(AssertionError, match="index out of range"):
        _run(monkeypatch, _fake_provider("index out of range in the kernel", fail_in="build"))
