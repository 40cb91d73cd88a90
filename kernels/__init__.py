"""Triton kernels of fastrl, installed as ``fastrl.kernels``.

Kernel modules know nothing of autograd; ``fastrl.ops`` orchestrates them. Importing this package does
not import Triton: each kernel module does, so ``import fastrl`` works where Triton is absent.
"""
