"""A fix for one bug of Triton's interpreter (``TRITON_INTERPRET=1``), applied only where it shows.

Triton 3.6's interpreter turns a tensor into a Python int (``__index__``, which ``range(start, end, step)``
calls on runtime loop bounds) with ``int(handle.data)``, and ``handle.data`` is a 1-element 1-d numpy
array. numpy 2.4 made ``int()`` of any array that is not 0-d a ``TypeError`` ("only 0-dimensional arrays
can be converted to Python scalars"), so every kernel loop with a runtime bound fails under Triton 3.6 +
numpy >= 2.4. Triton 3.9 squeezes the array first. torch 2.11's CUDA wheels pin Triton 3.6, and numpy 2.4
is what pip installs today, so users of fastrl's supported range meet this pair; the compiled kernels on
a GPU are not affected.

``apply()`` detects the bug by behaviour (it runs a one-loop probe kernel under the interpreter), not by
version numbers, and only then wraps the interpreter's tensor patching so that ``__index__`` takes the
single element with ``.item()``. Where the probe passes (Triton 3.9, or numpy < 2.4) nothing is changed.
Compiled kernels are never touched: this module is imported only when ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

_BUG = "only 0-dimensional arrays can be converted to Python scalars"
_applied = False
_original_patch_lang_tensor = interpreter._patch_lang_tensor  # kept for the test that the bug is real


@triton.jit
def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    # The loop bound n is a runtime tensor: range() calls its __index__, which is what breaks.
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, offs.to(tl.float32), mask=offs < n)


def _interpreter_indexes_tensors() -> bool:
    """Whether a runtime ``range`` bound works under this Triton's interpreter with this numpy."""
    x = torch.zeros(8)
    try:
        _probe_kernel[(1,)](x, 8, BLOCK=4)
    except Exception as exc:  # the interpreter wraps the TypeError in an InterpreterError
        if _BUG in str(exc):
            return False
        raise
    return torch.equal(x, torch.arange(8, dtype=torch.float32))


def _index_of_one_element(self) -> int:
    # Same as Triton 3.9's int(data.squeeze()): the handle of a scalar holds exactly one element.
    return int(self.handle.data.item())


def apply() -> None:
    """Fix the interpreter's tensor ``__index__`` if (and only if) this Triton + numpy pair needs it."""
    global _applied
    if _applied or _interpreter_indexes_tensors():
        return

    def _patch_lang_tensor(tensor, scope):
        _original_patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _index_of_one_element)

    # _patch_lang looks this function up on every kernel launch, so replacing the module attribute is
    # enough; each launch still restores every attribute it set when it ends.
    interpreter._patch_lang_tensor = _patch_lang_tensor
    _applied = True
    if not _interpreter_indexes_tensors():
        raise RuntimeError(
            f"Triton {triton.__version__}'s interpreter cannot index tensors ({_BUG!r}) and fastrl's fix did "
            "not take; install numpy<2.4 or another Triton, or use backend='torch'"
        )
