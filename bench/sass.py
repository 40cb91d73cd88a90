"""``python -m bench sass``: compile every kernel at its default launch configuration for a GPU, without a GPU, and
report per variant registers, spills, shared memory, tensor-core and TMA instruction counts (``cuobjdump``); exits 1
when a checked variant spills or a bf16/fp16 matmul kernel has no HGMMA (docs/design.md, "On the GPU")."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace

# Compiling, not interpreting: Triton decides at decoration time, so this must precede fastrl's kernel imports.
if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("python -m bench sass compiles kernels: run it with TRITON_INTERPRET unset (or 0)")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is what launches use

__all__ = ["Spec", "specs", "compile_spec"]

_TY = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
MATMUL_KERNELS = ("stats", "grad", "sm90_stats", "sm90_grad", "sm90_div_stats", "sm90_div_jsd", "sm90_div_grad")
_SIZES = ("H", "stride_hn", "stride_wv", "stride_gn", "stride_yr", "stride_gr", "V", "N", "C", "V_blk", "stride_ys",
          "stride_yt", "stride_g", "stride_er", "v_per_split")
SMEM_LIMIT = 232448  # bytes of shared memory one block may have on sm_90 (227 KB)

# spec.kernel -> (module of fastrl.kernels, kernel, its MODE constexpr: a divergence_fold mode or None)
KERNELS = {
    "stats": ("linear_logprob", "stats_fwd_kernel", None),  # fused tl.dot kernels (triton-fused)
    "grad": ("linear_logprob", "grad_block_kernel", None),
    "sm90_stats": ("persistent_stats", "persistent_stats_kernel", None),  # persistent TMA kernels (triton-sm90)
    "sm90_grad": ("persistent_grad", "persistent_grad_kernel", None),
    "sm90_exp_grad": ("persistent_grad", "scaled_exp_grad_kernel", None),  # G from the stored scaled exps
    "sm90_div_stats": ("persistent_divergence", "div_stats_kernel", "FORWARD_KL"),  # both heads' tiles in registers
    "sm90_div_jsd": ("persistent_divergence", "div_jsd_kernel", None),
    "sm90_div_grad": ("persistent_divergence", "div_grad_kernel", "JSD"),
    "fold": ("logits_fold", "fold_kernel", None),  # hybrid elementwise kernels on cuBLAS tiles
    "grad_tile": ("logits_fold", "grad_kernel", None),
    "div_stats": ("divergence_fold", "stats_kernel", "REVERSE_KL"),
    "div_jsd": ("divergence_fold", "jsd_kernel", None),
    "div_grad": ("divergence_fold", "grad_kernel", "JSD"),
    # per-row kept sets: gather + multiply-reduce, no tensor cores by design (a matvec per token); "kept_grad_dh" is
    # the backward's dH (no atomics, no bias), "kept_segment_dw" the sorted fixed-order dW and db
    "kept_logits": ("kept_rows", "logits_kernel", None),
    "kept_grad_dh": ("kept_rows", "backward_kernel", None),
    "kept_segment_dw": ("kept_rows", "segment_dw_kernel", None),
}

# The variants worth knowing about, per kernel: words of Spec.label ("" is bf16, TMA, no bias, no softcap)
VARIANTS = (
    (("stats", "grad"), ("", "bias", "softcap", "float16", "pointers", "float32")),
    (("stats",), ("no-entropy",)),
    (("sm90_stats", "sm90_grad"), ("", "bias", "softcap", "float16", "float32")),
    (("sm90_stats",), ("no-entropy", "store-exp", "bias softcap store-exp")),
    (("sm90_exp_grad",), ("", "softcap", "float32")),
    (("sm90_div_stats", "sm90_div_jsd", "sm90_div_grad"), ("", "bias softcap")),
    (("fold",), ("", "bias softcap")),
    (("grad_tile",), ("", "bias softcap", "float32")),
    (("kept_logits",), ("", "bias", "float16", "float32")),
    (("kept_grad_dh",), ("", "float32")),
    (("kept_segment_dw",), ("", "bias", "float32")),
    (("div_stats", "div_jsd"), ("", "bias softcap")),
    (("div_grad",), ("", "bias softcap", "float32")),
)


@dataclass(frozen=True)
class Spec:
    kernel: str  # a key of KERNELS
    dtype: str = "bfloat16"
    tma: bool = True
    bias: bool = False
    softcap: bool = False
    entropy: bool = True
    store_exp: bool = False  # sm90_stats: also writes the scaled-exp tile (the one-pass loss)

    @property
    def matmul(self) -> bool:
        return self.kernel in MATMUL_KERNELS

    @property
    def label(self) -> str:
        parts = [self.dtype, "tma" if self.tma else "pointers"] if self.matmul else [self.dtype]
        flags = (("bias", self.bias), ("softcap", self.softcap), ("no-entropy", not self.entropy),
                 ("store-exp", self.store_exp))
        return " ".join(parts + [x for x, on in flags if on])


def specs() -> list[Spec]:
    """Every kernel's variants (``VARIANTS``), each checked on sm_90."""
    out = []
    for kernels, variants in VARIANTS:
        for k in kernels:
            for v in variants:
                w = v.split()
                out.append(Spec(k, dtype=next((x for x in w if x.startswith("float")), "bfloat16"),
                                tma="pointers" not in w, bias="bias" in w, softcap="softcap" in w,
                                entropy="no-entropy" not in w, store_exp="store-exp" in w))
    return out


def _launch(spec: Spec, arch: int):
    """(kernel, constexprs by name, config with block sizes or None, config label, warps, stages)."""
    import torch

    from fastrl.kernels import divergence_fold, kept_rows, linear_logprob
    from fastrl.kernels.tuning import CONFIGS, variant_of

    module, name, mode = KERNELS[spec.kernel]
    mod = importlib.import_module(f"fastrl.kernels.{module}")
    dtype = getattr(torch, spec.dtype)
    if spec.matmul:
        key = "sm90_exp_stats" if spec.store_exp else "sm90_div" if spec.kernel.startswith("sm90_div") else spec.kernel
        cfg = CONFIGS[(key, "sm90" if arch >= 90 else "other", spec.tma, variant_of(dtype, spec.softcap, spec.bias))]
    elif module == "kept_rows":
        cfg = kept_rows.DEFAULT_CONFIGS[spec.kernel if spec.kernel in ("kept_logits", "kept_segment_dw")
                                        else "kept_backward"]
    else:  # elementwise: the module's column block and warps, 3 stages
        cfg = None
    b, c, e = spec.bias, spec.softcap, spec.entropy
    # every constexpr by name (a kernel takes those it has), and the unit strides a contiguous launch specialises
    values = dict(
        HAS_BIAS=b, HAS_BS=b, HAS_BT=b, HAS_GB=b, HAS_SOFTCAP=c, S_SOFTCAP=c, T_SOFTCAP=c,
        HAS_ENTROPY=e, HAS_GENT=e, HAS_GE=e, HAS_GLOGP=True, HAS_GD=True, HAS_GW=True, STORE_EXP=spec.store_exp,
        USE_TMA=spec.tma, IN_PLACE=spec.dtype != "float32", FIRST=False, EMULATE_RNE=False, INTERP_BF16=False,
        NUM_PROGS=132, HAS_COUNT=False,  # an H100 SXM's SMs (the H200 has as many)
        MODE=mode and getattr(divergence_fold, mode), DOT_PRECISION=linear_logprob.dot_precision(dtype),
        BLOCK_C=getattr(mod, "BLOCK_C", None), stride_ik=1, stride_yk=1, stride_gk=1,
    )
    if cfg is None:
        values["BLOCK_V"] = 256
        label, warps, stages = f"BLOCK_C={mod.BLOCK_C} w{mod.NUM_WARPS}", mod.NUM_WARPS, 3
    else:
        values.update(BLOCK_N=cfg.block_n, BLOCK_E=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_v,
                      BLOCK_H=cfg.block_h)
        label, warps, stages = str(cfg), cfg.num_warps, cfg.num_stages
    fn = getattr(mod, name)
    constexpr = {p.name for p in fn.params if p.is_constexpr} | {"stride_ik", "stride_yk", "stride_gk"}
    return fn, {a: values[a] for a in fn.arg_names if a in constexpr}, cfg, label, warps, stages


def _arg_type(a: str, spec: Spec, cfg) -> str:
    """A kernel argument's type by its name: tensor descriptors (pointers without TMA), pointers, fp32 scalars, i32."""
    ty = _TY[spec.dtype]
    if a.endswith(("_desc", "_src", "_dst")):
        if not spec.tma:
            return f"*{ty}"
        n, v, h = cfg.block_n, cfg.block_v, cfg.block_h
        half = (n, v // 2)  # the persistent epilogues store column halves
        rows, cols = {"h": (n, h), "w": (v, h), "g": half if spec.kernel == "sm90_grad" else (n, v),
                      "e": half if spec.store_exp else (n, h)}[a[0]]
        return f"tensordesc<{ty}[{rows},{cols}]>"
    if a in ("t_ptr", "ids_ptr", "order_ptr", "sid_ptr", "end_ptr"):
        return "*i64"
    if a in ("h_ptr", "w_ptr", "b_ptr", "bs_ptr", "bt_ptr", "e_ptr") or (
            a == "g_ptr" and not spec.kernel.startswith("kept_")):  # G in place: the input dtype (float32 heads too)
        return f"*{ty}"
    if a.endswith("_ptr"):
        return "*fp32"
    return "fp32" if a in ("logit_scale", "softcap", "inv_temp", "s_scale", "s_softcap", "t_scale", "t_softcap",
                           "beta") else "i32"


def compile_spec(spec: Spec, arch: int):
    """(compiled kernel, config label) for one spec at its default launch configuration."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, consts, cfg, label, warps, stages = _launch(spec, arch)
    sig = {a: "constexpr" if a in consts else _arg_type(a, spec, cfg) for a in fn.arg_names}
    # tt.divisibility 16 on every pointer and size, as a launch with real shapes (H = 896 / 4096, V = 151936, 16-byte
    # aligned tensors) specialises them
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or a in _SIZES}
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    return compiled, label


def inspect(compiled) -> dict:
    """Registers, stack, spills, shared memory and instruction counts of a compiled kernel's cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        raise SystemExit(f"cuobjdump not found at {tool}: this Triton wheel does not ship it")
    with tempfile.TemporaryDirectory(prefix="fastrl-sass-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage, sass = (subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout
                       for flag in ("--dump-resource-usage", "--dump-sass"))

    def count(instruction: str) -> int:
        return len(re.findall(rf"\b{instruction}\b", sass))
    registers, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    shared, warps = int(compiled.metadata.shared), int(compiled.metadata.num_warps)
    return dict(registers=registers, stack=stack, spill_loads=count("LDL"), spill_stores=count("STL"), shared=shared,
                tensor_core=count("HGMMA") or count("HMMA"), tma_loads=count("UTMALDG"), tma_stores=count("UTMASTG"),
                ctas_per_sm=ctas_per_sm(registers, shared, warps))


def ctas_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Blocks one Hopper SM holds at once: 64K registers (allocated per warp in units of 256), 228 KB of shared
    memory (1 KB of it reserved per block), 2048 threads, 32 blocks."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = 65536 // (per_warp * num_warps)
    by_smem = 233472 // (shared + 1024)
    return min(by_regs, by_smem, 2048 // (32 * num_warps), 32)


def verdict(spec: Spec, r: dict, arch: int) -> str:
    """'' when fine, else why this row fails the check (sm_90 and later)."""
    checks = (
        (r["spill_loads"] or r["spill_stores"] or r["stack"],
         f"spills ({r['stack']} B stack, {r['spill_loads']} LDL / {r['spill_stores']} STL)"),
        (r["shared"] > SMEM_LIMIT,
         f"{r['shared']} B of shared memory, over the {SMEM_LIMIT} B a block may have on sm_90 (no launch)"),
        (spec.matmul and spec.tma and not r["tma_loads"],
         "no TMA loads (UTMALDG) in a kernel fed by tensor descriptors"),
        (spec.matmul and spec.dtype in ("bfloat16", "float16") and not r["tensor_core"],
         "no HGMMA (tensor cores unused)"),
    )
    return "; ".join(why for bad, why in checks if bad and arch >= 90)


def command(args, con=None) -> int:
    """``python -m bench sass``: compile for a GPU target (no GPU, no provider needed); 1 on a failed check."""
    from bench.roofline import print_columns

    hopper = args.arch >= 90
    # before Hopper the triton-sm90 backend refuses the GPU, and every launch loads with pointers
    todo = [s if hopper else replace(s, tma=False) for s in specs() if hopper or not s.kernel.startswith("sm90_")]
    table = [("kernel", "variant", "config", "regs", "stack", "LDL", "STL", "smem KB", "HGMMA" if hopper else "HMMA",
              "TMA ld", "TMA st", "CTA/SM", "check")]
    failures = []
    for spec in dict.fromkeys(s for s in todo if not args.only or args.only in s.kernel):
        compiled, cfg = compile_spec(spec, args.arch)
        r = inspect(compiled)
        bad = verdict(spec, r, args.arch)
        if bad:
            failures.append(f"{spec.kernel} [{spec.label}] {cfg}: {bad}")
        cells = [f"{v / 1024:.0f}" if k == "shared" else str(v) for k, v in r.items()]  # inspect's order
        table.append((spec.kernel, spec.label, cfg, *cells, "FAIL" if bad else "ok" if hopper else "-"))
    print(f"Kernels compiled for sm_{args.arch} at their default launch configurations (no GPU needed):")
    print_columns(table)
    if failures:
        print(f"\nFAIL: {len(failures)} checked kernel(s) at their default configuration:", *failures,
              sep="\n  ", file=sys.stderr)
        return 1
    print(f"\nOK: no spills in the checked kernels, HGMMA in every bf16/fp16 matmul kernel (sm_{args.arch})." if hopper
          else f"\nsm_{args.arch}: listed only (the launch table is tuned and checked for sm_90).")
    return 0
