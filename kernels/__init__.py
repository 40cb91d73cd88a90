"""Triton kernels of fastrl, installed as ``fastrl.kernels``.

Kernel modules know nothing of autograd; ``fastrl.ops`` orchestrates them. Importing this package does
not import Triton (each kernel module does, so ``import fastrl`` works where Triton is absent), except
under ``TRITON_INTERPRET=1``, where it first repairs a known interpreter bug if the installed Triton and
numpy have it (see ``_interpreter_compat``).
"""

import os

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    from ._interpreter_compat import apply as _fix_interpreter

    _fix_interpreter()
