"""``python -m bench sass``: compile every kernel at its default launch configuration for a GPU, without a GPU.

Triton compiles for any NVIDIA target on any machine (``triton.compile`` with a ``GPUTarget``), and the
``cuobjdump`` it ships reads the machine code back. Per kernel, variant and configuration this prints what
decides its speed before it ever runs: registers per thread, stack bytes and spill loads/stores (``LDL`` /
``STL``: registers that did not fit, each a round trip to local memory), shared memory (one tile per pipeline
stage when the H loop is software-pipelined), tensor-core instructions (``HGMMA``, Hopper's warpgroup MMA)
and TMA loads and stores (``UTMALDG`` / ``UTMASTG``); ``HMMA`` (``mma.sync``) before Hopper. A kernel whose
shared memory exceeds the 227 KB a block may have on sm_90 fails too (it would not launch).

It exits non-zero when a *checked* variant (the ones real models use) spills, or when a matmul kernel has no
HGMMA at bf16/fp16. The test-suite runs it for sm_90 (compile only, nothing is timed).

    python -m bench sass                 sm_90, every kernel and variant (about a minute on 2 cores)
    python -m bench sass --arch 80       another target (no check there: the table is tuned for sm_90)
    python -m bench sass --only stats    kernels whose name contains 'stats'
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

# Compiling, not interpreting: Triton decides at decoration time, so this must precede fastrl's kernel imports.
if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("python -m bench sass compiles kernels: run it with TRITON_INTERPRET unset (or 0)")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is what launches use

__all__ = ["Spec", "specs", "compile_spec", "main"]

_TY = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
MATMUL_KERNELS = ("stats", "grad", "sm90_stats", "sm90_grad", "sm90_div_stats", "sm90_div_jsd", "sm90_div_grad")
SMEM_LIMIT = 232448  # bytes of shared memory one block may have on sm_90 (227 KB)


@dataclass(frozen=True)
class Spec:
    kernel: str  # "stats", "grad" (fused matmul kernels), "sm90_stats", "sm90_grad" (persistent TMA matmul kernels),
    # "fold", "grad_tile", "div_*" (hybrid elementwise kernels), "sm90_exp_grad" (G from stored scaled exps)
    dtype: str = "bfloat16"
    tma: bool = True
    bias: bool = False
    softcap: bool = False
    entropy: bool = True
    store_exp: bool = False  # sm90_stats: also writes the scaled-exp tile (the one-pass loss)
    checked: bool = True  # a spill (or missing HGMMA) here fails the command
    note: str = field(default="", compare=False)

    @property
    def matmul(self) -> bool:
        return self.kernel in MATMUL_KERNELS

    @property
    def label(self) -> str:
        parts = [self.dtype, "tma" if self.tma else "pointers"] if self.matmul else [self.dtype]
        parts += [x for x, on in (("bias", self.bias), ("softcap", self.softcap)) if on]
        if not self.entropy:
            parts.append("no-entropy")
        if self.store_exp:
            parts.append("store-exp")
        return " ".join(parts)


def specs() -> list[Spec]:
    """The variants worth knowing about; ``checked`` ones are those real models and defaults use."""
    out = []
    for k in ("stats", "grad"):
        out += [
            Spec(k, note="Qwen2.5 / Llama heads: bf16, no bias, no softcap"),
            Spec(k, bias=True),
            Spec(k, softcap=True, note="Gemma-2 style final-logit softcap"),
            Spec(k, dtype="float16"),
            Spec(k, tma=False, note="unaligned tensors: pointer loads"),
            Spec(k, dtype="float32", note="fp32 heads: IEEE FMA dot, no tensor cores"),
        ]
    out.append(Spec("stats", entropy=False, note="forward-only log-probs (reference / old policy)"))
    # the triton-sm90 backend: persistent TMA kernels (TMA only: unaligned tensors are refused, not pointer-loaded)
    for k in ("sm90_stats", "sm90_grad"):
        out += [
            Spec(k, note="persistent, TMA, no logit stored"),
            Spec(k, bias=True),
            Spec(k, softcap=True),
            Spec(k, dtype="float16"),
            Spec(k, dtype="float32", note="fp32 heads: IEEE FMA dot, no tensor cores"),
        ]
    out += [Spec("sm90_stats", entropy=False, note="forward-only log-probs"),
            Spec("sm90_stats", store_exp=True, note="one-pass loss: also writes the bf16 scaled exps"),
            Spec("sm90_stats", store_exp=True, bias=True, softcap=True),
            Spec("sm90_exp_grad"), Spec("sm90_exp_grad", softcap=True), Spec("sm90_exp_grad", dtype="float32")]
    # fused_divergence on triton-sm90: both heads' tiles in registers (statistics, the JSD pass, the student's G)
    for k in ("sm90_div_stats", "sm90_div_jsd", "sm90_div_grad"):
        out += [Spec(k, note="student + teacher tiles"), Spec(k, bias=True, softcap=True)]
    out += [Spec("fold"), Spec("fold", bias=True, softcap=True), Spec("grad_tile"), Spec("grad_tile", bias=True, softcap=True),
            Spec("grad_tile", dtype="float32")]
    # per-row kept sets (kernels/kept_rows.py): gather + multiply-reduce, no tensor cores by design (a matvec per
    # token); "kept_grad" scatter-adds dW (and db with bias) with atomics ("_rows": into rows weight_rows names),
    # "kept_grad_dh" is the deterministic
    # path's dH half, "kept_segment_dw" its sorted fixed-order dW
    out += [Spec("kept_logits", note="bf16 head, gathered rows"), Spec("kept_logits", bias=True),
            Spec("kept_logits", dtype="float16"), Spec("kept_logits", dtype="float32"),
            Spec("kept_grad", note="dH + atomic dW"), Spec("kept_grad", bias=True), Spec("kept_grad", dtype="float32"),
            Spec("kept_grad_rows", note="atomic dW into a compact [R, H] buffer (weight_rows)"),
            Spec("kept_grad_dh"), Spec("kept_segment_dw", note="deterministic dW"), Spec("kept_segment_dw", bias=True),
            Spec("kept_segment_dw", dtype="float32")]
    # fused_divergence's hybrid kernels: both heads' float32 tiles in one pass (kernels/divergence_fold.py)
    out += [Spec("div_stats"), Spec("div_stats", bias=True, softcap=True), Spec("div_jsd"),
            Spec("div_jsd", bias=True, softcap=True), Spec("div_grad"), Spec("div_grad", bias=True, softcap=True),
            Spec("div_grad", dtype="float32")]
    return out


def _signature(fn, types: dict, consts: dict) -> dict:
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in types:
            sig[a] = types[a]
        elif a in ("logit_scale", "softcap", "inv_temp", "s_scale", "s_softcap", "t_scale", "t_softcap", "beta"):
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    return sig


def _divisible(fn, types: dict) -> dict:
    """``tt.divisibility`` 16 on every pointer and size, as Triton specialises them at a launch with real
    shapes (H = 896 / 4096, V = 151936, 16-byte aligned tensors)."""
    attrs = {}
    for i, a in enumerate(fn.arg_names):
        t = types.get(a, "i32")
        if (t.startswith("*") or a in ("H", "stride_hn", "stride_wv", "stride_gn", "stride_yr", "stride_gr", "V",
                                        "N", "C", "V_blk", "stride_ys", "stride_yt", "stride_g", "stride_er",
                                        "v_per_split")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_spec(spec: Spec, arch: int):
    """(compiled kernel, config label) for one spec at its default launch configuration."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ty = _TY[spec.dtype]
    if spec.matmul:
        fn, types, consts, label, warps, stages = _matmul(spec, arch, ty)
    elif spec.kernel == "sm90_exp_grad":
        fn, types, consts, label, warps, stages = _exp_grad(spec, ty)
    elif spec.kernel.startswith("kept_"):
        fn, types, consts, cfg = _kept_rows(spec, ty)
        label, warps, stages = str(cfg), cfg.num_warps, cfg.num_stages
    elif spec.kernel.startswith("div_"):
        fn, types, consts, label, warps, stages = _divergence_fold(spec, ty)
    else:
        fn, types, consts, label, warps, stages = _logits_fold(spec, ty)
    src = ASTSource(fn, _signature(fn, types, consts), consts, _divisible(fn, types))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    return compiled, label


def _matmul(spec: Spec, arch: int, ty: str):
    """(kernel, argument types, constexprs, label, warps, stages) of a tl.dot kernel at its tuned configuration."""
    import torch

    from fastrl.kernels import linear_logprob as K
    from fastrl.kernels.tuning import CONFIGS, variant_of

    dtype = getattr(torch, spec.dtype)
    key = "sm90_exp_stats" if spec.store_exp else "sm90_div" if spec.kernel.startswith("sm90_div") else spec.kernel
    cfg = CONFIGS[(key, "sm90" if arch >= 90 else "other", spec.tma, variant_of(dtype, spec.softcap, spec.bias))]
    hsrc = f"tensordesc<{ty}[{cfg.block_n},{cfg.block_h}]>" if spec.tma else f"*{ty}"
    wsrc = f"tensordesc<{ty}[{cfg.block_v},{cfg.block_h}]>" if spec.tma else f"*{ty}"
    common = dict(HAS_BIAS=spec.bias, HAS_SOFTCAP=spec.softcap, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v,
                  BLOCK_H=cfg.block_h, USE_TMA=spec.tma, DOT_PRECISION=K.dot_precision(dtype), INTERP_BF16=False)
    if spec.kernel.startswith("sm90_"):
        fn, types, consts = _sm90_matmul(spec, cfg, ty, common)
    elif spec.kernel == "stats":
        fn = K.stats_fwd_kernel
        types = dict(h_src=hsrc, w_src=wsrc, h_ptr=f"*{ty}", w_ptr=f"*{ty}", b_ptr=f"*{ty}", t_ptr="*i64",
                     m_ptr="*fp32", s_ptr="*fp32", u_ptr="*fp32", zt_ptr="*fp32")
        consts = dict(common, HAS_ENTROPY=spec.entropy)
    else:
        fn = K.grad_block_kernel
        gdst = f"tensordesc<{ty}[{cfg.block_n},{cfg.block_v}]>" if spec.tma else f"*{ty}"
        types = dict(h_src=hsrc, w_src=wsrc, b_ptr=f"*{ty}", t_ptr="*i64", lse_ptr="*fp32", ent_ptr="*fp32",
                     glogp_ptr="*fp32", gent_ptr="*fp32", g_dst=gdst)
        consts = dict(common, HAS_GLOGP=True, HAS_GENT=spec.entropy)
    return fn, types, consts, str(cfg), cfg.num_warps, cfg.num_stages


def _exp_grad(spec: Spec, ty: str):
    from fastrl.kernels import persistent_grad as PG

    types = dict(e_ptr=f"*{ty}", k_ptr="*fp32", t_ptr="*i64", zt_ptr="*fp32",
                 **{p: "*fp32" for p in ("lse_ptr", "ent_ptr", "glogp_ptr", "gent_ptr")})
    consts = dict(HAS_SOFTCAP=spec.softcap, HAS_GLOGP=True, HAS_GENT=spec.entropy, BLOCK_V=256,
                  BLOCK_C=PG.BLOCK_C, EMULATE_RNE=False)
    return PG.scaled_exp_grad_kernel, types, consts, f"BLOCK_C={PG.BLOCK_C} w{PG.NUM_WARPS}", PG.NUM_WARPS, 3


def _divergence_fold(spec: Spec, ty: str):
    from fastrl.kernels import divergence_fold as D

    base = dict(HAS_BS=spec.bias, HAS_BT=spec.bias, S_SOFTCAP=spec.softcap, T_SOFTCAP=spec.softcap,
                BLOCK_C=D.BLOCK_C)
    heads = dict(ys_ptr="*fp32", yt_ptr="*fp32", bs_ptr=f"*{ty}", bt_ptr=f"*{ty}")
    if spec.kernel == "div_stats":
        fn = D.stats_kernel
        types = dict(heads, **{p: "*fp32" for p in ("ms_ptr", "ss_ptr", "us_ptr", "c_ptr", "mt_ptr", "st_ptr")})
        consts = dict(base, MODE=D.REVERSE_KL, HAS_ENTROPY=spec.entropy, FIRST=False)
    elif spec.kernel == "div_jsd":
        fn = D.jsd_kernel
        types = dict(heads, **{p: "*fp32" for p in ("lse_s_ptr", "lse_t_ptr", "jsd_ptr", "aux_ptr")})
        consts = base
    else:
        fn = D.grad_kernel
        gty = "fp32" if spec.dtype == "float32" else ty
        types = dict(heads, g_ptr=f"*{gty}",
                     **{p: "*fp32" for p in ("lse_s_ptr", "lse_t_ptr", "aux_ptr", "ent_ptr", "gd_ptr", "ge_ptr")})
        consts = dict(base, MODE=D.JSD, HAS_GD=True, HAS_GE=spec.entropy, IN_PLACE=spec.dtype != "float32",
                      EMULATE_RNE=False)
    return fn, types, consts, f"BLOCK_C={D.BLOCK_C} w{D.NUM_WARPS}", D.NUM_WARPS, 3


def _logits_fold(spec: Spec, ty: str):
    from fastrl.kernels import logits_fold as F

    base = dict(HAS_BIAS=spec.bias, HAS_SOFTCAP=spec.softcap, BLOCK_C=F.BLOCK_C)
    if spec.kernel == "fold":
        fn = F.fold_kernel
        types = dict(y_ptr="*fp32", b_ptr=f"*{ty}", t_ptr="*i64", m_ptr="*fp32", s_ptr="*fp32", u_ptr="*fp32",
                     zt_ptr="*fp32")
        consts = dict(base, HAS_ENTROPY=spec.entropy, FIRST=False)
    else:
        fn = F.grad_kernel
        gty = "fp32" if spec.dtype == "float32" else ty
        types = dict(y_ptr="*fp32", g_ptr=f"*{gty}", b_ptr=f"*{ty}", t_ptr="*i64", lse_ptr="*fp32",
                     ent_ptr="*fp32", glogp_ptr="*fp32", gent_ptr="*fp32")
        consts = dict(base, HAS_GLOGP=True, HAS_GENT=spec.entropy, IN_PLACE=spec.dtype != "float32",
                      EMULATE_RNE=False)
    return fn, types, consts, f"BLOCK_C={F.BLOCK_C} w{F.NUM_WARPS}", F.NUM_WARPS, 3


def _sm90_matmul(spec: Spec, cfg, ty: str, common: dict):
    """(kernel, argument types, constexprs) of a persistent TMA kernel of the triton-sm90 backend."""
    from fastrl.kernels import persistent_grad as PG
    from fastrl.kernels import persistent_stats as PS

    consts = {k: v for k, v in common.items() if k != "USE_TMA"}
    consts["NUM_PROGS"] = 132  # an H100 SXM's SMs (the H200 has as many)
    hdesc = f"tensordesc<{ty}[{cfg.block_n},{cfg.block_h}]>"
    wdesc = f"tensordesc<{ty}[{cfg.block_v},{cfg.block_h}]>"
    half = f"tensordesc<{ty}[{cfg.block_n},{cfg.block_v // 2}]>"  # the epilogue stores column halves
    if spec.kernel.startswith("sm90_div"):
        return _sm90_divergence(spec, cfg, ty, consts, hdesc, wdesc)
    if spec.kernel == "sm90_stats":
        types = dict(h_desc=hdesc, w_desc=wdesc, h_ptr=f"*{ty}", w_ptr=f"*{ty}", b_ptr=f"*{ty}", t_ptr="*i64",
                     part_ptr="*fp32", zt_ptr="*fp32", e_desc=half if spec.store_exp else hdesc, k_ptr="*fp32")
        return PS.persistent_stats_kernel, types, dict(consts, HAS_ENTROPY=spec.entropy, STORE_EXP=spec.store_exp)
    types = dict(h_desc=hdesc, w_desc=wdesc, b_ptr=f"*{ty}", t_ptr="*i64", lse_ptr="*fp32", ent_ptr="*fp32",
                 glogp_ptr="*fp32", gent_ptr="*fp32", g_desc=half)
    return PG.persistent_grad_kernel, types, dict(consts, HAS_GLOGP=True, HAS_GENT=spec.entropy)


def _sm90_divergence(spec: Spec, cfg, ty: str, consts: dict, hdesc: str, wdesc: str):
    from fastrl.kernels import divergence_fold as D
    from fastrl.kernels import persistent_divergence as PD

    base = {k: v for k, v in consts.items() if k not in ("HAS_BIAS", "HAS_SOFTCAP")}
    base.update(HAS_BS=spec.bias, HAS_BT=spec.bias, S_SOFTCAP=spec.softcap, T_SOFTCAP=spec.softcap)
    types = dict(hs_desc=hdesc, ws_desc=wdesc, ht_desc=hdesc, wt_desc=wdesc, bs_ptr=f"*{ty}", bt_ptr=f"*{ty}")
    if spec.kernel == "sm90_div_stats":
        return PD.div_stats_kernel, dict(types, part_ptr="*fp32"), dict(base, MODE=D.FORWARD_KL,
                                                                          HAS_ENTROPY=spec.entropy)
    if spec.kernel == "sm90_div_jsd":
        return PD.div_jsd_kernel, dict(types, lse_s_ptr="*fp32", lse_t_ptr="*fp32", part_ptr="*fp32"), base
    types.update({p: "*fp32" for p in ("lse_s_ptr", "lse_t_ptr", "aux_ptr", "ent_ptr", "gd_ptr", "ge_ptr")},
                 g_desc=f"tensordesc<{ty}[{cfg.block_n},{cfg.block_v}]>")
    return PD.div_grad_kernel, types, dict(base, MODE=D.JSD, HAS_GD=True, HAS_GE=spec.entropy)


def _kept_rows(spec: Spec, ty: str):
    """(kernel, argument types, constexprs, config) of a per-row kept-set kernel at its default configuration; the
    unit strides are constants, as a launch with contiguous ids, logits and grad specialises them."""
    from fastrl.kernels import kept_rows as KR

    fp32 = {p: "*fp32" for p in ("y_ptr", "g_ptr", "gh_ptr", "gw_ptr", "gb_ptr")}
    types = dict(fp32, h_ptr=f"*{ty}", w_ptr=f"*{ty}", b_ptr=f"*{ty}", ids_ptr="*i64", rows_ptr="*i64",
                 order_ptr="*i64", sid_ptr="*i64", end_ptr="*i64")
    if spec.kernel == "kept_logits":
        cfg = KR.DEFAULT_CONFIGS["kept_logits"]
        consts = dict(stride_ik=1, stride_yk=1, HAS_BIAS=spec.bias, BLOCK_K=cfg.block_v, BLOCK_H=cfg.block_h)
        return KR.logits_kernel, types, consts, cfg
    if spec.kernel == "kept_segment_dw":
        cfg = KR.DEFAULT_CONFIGS["kept_segment_dw"]
        consts = dict(stride_gk=1, HAS_GW=True, HAS_GB=spec.bias, BLOCK_E=cfg.block_n, BLOCK_H=cfg.block_h)
        return KR.segment_dw_kernel, types, consts, cfg
    cfg = KR.DEFAULT_CONFIGS["kept_backward"]
    atomic = spec.kernel in ("kept_grad", "kept_grad_rows")
    consts = dict(stride_gk=1, stride_ik=1, stride_rk=1, ATOMIC_GW=atomic, ATOMIC_GB=atomic and spec.bias,
                  HAS_ROWS=spec.kernel == "kept_grad_rows", BLOCK_K=cfg.block_v, BLOCK_H=cfg.block_h)
    return KR.backward_kernel, types, consts, cfg


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise SystemExit(f"cuobjdump not found at {path}: this Triton wheel does not ship it")
    return path


def inspect(compiled) -> dict:
    """Registers, stack, spills, shared memory and instruction counts of a compiled kernel's cubin."""
    with tempfile.TemporaryDirectory(prefix="fastrl-sass-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = _cuobjdump()
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return dict(
        registers=int(m.group(1)), stack=int(m.group(2)),
        spill_loads=len(re.findall(r"\bLDL\b", sass)), spill_stores=len(re.findall(r"\bSTL\b", sass)),
        shared=int(compiled.metadata.shared),
        tensor_core=len(re.findall(r"\bHGMMA\b", sass)) or len(re.findall(r"\bHMMA\b", sass)),
        tma_loads=len(re.findall(r"\bUTMALDG\b", sass)),
        tma_stores=len(re.findall(r"\bUTMASTG\b", sass)),
        ctas_per_sm=ctas_per_sm(int(m.group(1)), int(compiled.metadata.shared), int(compiled.metadata.num_warps)),
    )


def ctas_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Blocks one Hopper SM holds at once: 64K registers (allocated per warp in units of 256), 228 KB of shared
    memory (1 KB of it reserved per block), 2048 threads, 32 blocks."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = 65536 // (per_warp * num_warps)
    by_smem = 233472 // (shared + 1024)
    return min(by_regs, by_smem, 2048 // (32 * num_warps), 32)


def verdict(spec: Spec, r: dict, arch: int) -> str:
    """'' when fine, else why this row fails the check."""
    if not spec.checked or arch < 90:
        return ""
    why = []
    if r["spill_loads"] or r["spill_stores"] or r["stack"]:
        why.append(f"spills ({r['stack']} B stack, {r['spill_loads']} LDL / {r['spill_stores']} STL)")
    if r["shared"] > SMEM_LIMIT:
        why.append(f"{r['shared']} B of shared memory, over the {SMEM_LIMIT} B a block may have on sm_90 (no launch)")
    if spec.matmul and spec.tma and not r["tma_loads"]:
        why.append("no TMA loads (UTMALDG) in a kernel fed by tensor descriptors")
    if spec.matmul and spec.dtype in ("bfloat16", "float16") and not r["tensor_core"]:
        why.append("no HGMMA (tensor cores unused)")
    return "; ".join(why)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench sass", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100 / H200)")
    ap.add_argument("--only", help="only kernels whose name contains this")
    ap.add_argument("--checked-only", action="store_true", help="only the variants the check covers")
    return command(ap.parse_args(argv))


def command(args, con=None) -> int:
    """``python -m bench sass``: compile for a GPU target (no GPU, no provider needed); 1 on a failed check."""
    rows, failures, seen = [], [], set()
    for spec in specs():
        if args.arch < 90 and spec.kernel.startswith("sm90_"):
            continue  # TMA kernels: the triton-sm90 backend refuses GPUs before Hopper
        if args.arch < 90 and spec.tma:
            spec = replace(spec, tma=False)  # no TMA before Hopper: every launch there loads with pointers
        if spec in seen:
            continue
        seen.add(spec)
        if args.only and args.only not in spec.kernel:
            continue
        if args.checked_only and not spec.checked:
            continue
        t0 = time.perf_counter()
        compiled, cfg = compile_spec(spec, args.arch)
        r = inspect(compiled)
        bad = verdict(spec, r, args.arch)
        rows.append((spec, cfg, r, bad, time.perf_counter() - t0))
        if bad:
            failures.append(f"{spec.kernel} [{spec.label}] {cfg}: {bad}")
    _print(rows, args.arch)
    if failures:
        print(f"\nFAIL: {len(failures)} checked kernel(s) at their default configuration:", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    if args.arch >= 90:
        print(f"\nOK: no spills in the checked kernels, HGMMA in every bf16/fp16 matmul kernel (sm_{args.arch}).")
    else:
        print(f"\nsm_{args.arch}: listed only (the launch table is tuned and checked for sm_90).")
    return 0


def _print(rows, arch: int) -> None:
    from bench.roofline import print_columns

    mma = "HGMMA" if arch >= 90 else "HMMA"
    head = ("kernel", "variant", "config", "regs", "stack", "LDL", "STL", "smem KB", mma, "TMA ld", "TMA st", "CTA/SM",
            "check")
    table = [head]
    for spec, cfg, r, bad, _ in rows:
        check = "FAIL" if bad else ("ok" if spec.checked and arch >= 90 else "-")
        table.append((spec.kernel, spec.label, cfg, str(r["registers"]), str(r["stack"]), str(r["spill_loads"]),
                      str(r["spill_stores"]), f"{r['shared'] / 1024:.0f}", str(r["tensor_core"]), str(r["tma_loads"]),
                      str(r["tma_stores"]), str(r["ctas_per_sm"]), check))
    print(f"Kernels compiled for sm_{arch} at their default launch configurations (no GPU needed):")
    print_columns(table)


if __name__ == "__main__":
    sys.exit(main())
