"""How far two floating-point evaluations of the same sum may differ, from the arithmetic rather than from
one machine's last digits: kernels block, vectorise (AVX2, AVX-512), fuse multiply-adds and split work over
threads differently, so the same dot product comes out summed in a different order on another CPU."""

from __future__ import annotations

import torch


def reduction_bound(n: int, magnitude: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per element, how far two evaluations in ``dtype``, in any order, of a dot product of length ``n`` may
    differ, where ``magnitude`` holds each element's ``sum_i |a_i b_i|`` (compute it in float64 from the
    formula; an element whose terms are all zero gets a zero bound: it must match exactly).

    Higham (Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5): whatever the order, blocking
    or fused multiply-adds, a computed dot product is within ``gamma_n * sum_i |a_i b_i|`` of the exact one,
    where ``gamma_n = n u / (1 - n u)`` and ``u = eps / 2`` is the unit roundoff (the product's rounding and
    the ``n - 1`` additions' each contribute at most ``u`` of a partial sum no larger than that total). Two
    evaluations are each that close to the exact value, so they differ by at most twice it. This is a proof,
    not a fit: it holds on every CPU, instruction set and thread count. It is also tight where it matters:
    relative to the terms it is ``2 n u`` (1.3e-4 for a thousand float32 terms), so an error that changes a
    term's worth of the sum (a head read from the wrong group, a query dropped from a key's gradient) stands
    far above it. When the terms themselves are computed differently on the two sides (a softmax, a score
    gradient), they carry their own rounding and this bound alone does not cover them.
    """
    if n < 1:
        raise ValueError(f"a reduction has at least one term, got n={n}")
    unit_roundoff = torch.finfo(dtype).eps / 2
    if n * unit_roundoff >= 1:
        raise ValueError(f"n={n} terms in {dtype}: the bound n*u/(1-n*u) needs n*u < 1")
    gamma = n * unit_roundoff / (1 - n * unit_roundoff)
    return 2 * gamma * magnitude
