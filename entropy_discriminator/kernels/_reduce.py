"""Triton building blocks shared by the one-pass and the fused kernels.

Notation (all fp32).  A row of temperature-scaled logits z_i = x_i / T is handled in base-2 units
y_i = x_i * c with c = log2(e) / T, so that e^(z_i - z_ref) = 2^(y_i - m) and the exponential is one
``exp2`` of one fused multiply-add.  Against a reference m (a running max, possibly lazy: it is
moved only when the data exceed it by more than TAU, so e <= 2^TAU) the kernels accumulate

    s0 = sum e_i,  s1 = sum e_i d_i,  s2 = sum e_i^2,  s3 = sum e_i^2 d_i,   e_i = 2^d_i, d_i = y_i - m

with e^2 computed as e*e (one exponential per logit).  Moving m to m' = m + delta' multiplies the
sums by a = 2^(m - m') and shifts the d's by dl = m - m':

    s0' = a s0,  s1' = a (s1 + dl s0),  s2' = a^2 s2,  s3' = a^2 (s3 + dl s2).

From the four sums (natural logs; ln2 = log(2)):

    log Z - z_ref = log s0,            H = log s0 - ln2 s1 / s0,
    E_p[S] = H sum p^2 + sum p^2 log p = ln2 (s3 - s2 s1 / s0) / s0^2,
    log p_k = ln2 (y_k - m) - log s0,  S* = p_k (H + log p_k)  (0 when p_k = 0).
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = 1.4426950408889634  # host side only
# d is clamped at -D_FLOOR before e*d is formed: 2^-256 is 0 in fp32, so the clamp changes no sum
# and keeps 0 * (-inf) (masked vocabulary entries, the masked tail) out of s1 and s3.
D_FLOOR = tl.constexpr(256.0)


@triton.jit
def max_nan(a, b):
    """max that propagates NaN (so a NaN logit reaches the row max the caller validates)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def rescale(s0, s1, s2, s3, m_old, m_new):
    """Move the sums from reference m_old to m_new >= m_old (m_old may be -inf: sums are 0)."""
    dl = m_old - m_new
    a = tl.exp2(dl)
    ad = tl.where(a > 0, a * dl, 0.0)
    s1 = a * s1 + ad * s0
    s0 = a * s0
    s3 = a * a * s3 + a * ad * s2
    s2 = a * a * s2
    return s0, s1, s2, s3


@triton.jit
def finalize(mu, s0, s1, s2, s3, yk, valid):
    """Per-token statistics from the sums against the finite reference mu (see module doc).

    Returns (logp, entropy, s_star, s_expected), each 0 where ``valid`` is False.
    """
    log_s0 = tl.log(s0)
    dbar = s1 / s0
    ent = log_s0 - LN2 * dbar
    s_exp = LN2 * (s3 - s2 * dbar) / (s0 * s0)
    logp = LN2 * (yk - mu) - log_s0
    s_star = tl.where(logp == float("-inf"), 0.0, tl.exp(logp) * (ent + logp))
    logp = tl.where(valid, logp, 0.0)
    ent = tl.where(valid, ent, 0.0)
    s_star = tl.where(valid, s_star, 0.0)
    s_exp = tl.where(valid, s_exp, 0.0)
    return logp, ent, s_star, s_exp


@triton.jit
def merge_kernel(
    part_ptr,  # fp32 [6, N, NP]: m, s0, s1, s2, s3, mx (base-2 units) per row and partial
    yk_ptr,  # fp32 [N]: y of the label logit (base-2 units)
    lab_ptr,  # int64 [N]
    logp_ptr,
    ent_ptr,
    ss_ptr,
    se_ptr,
    rmax_ptr,  # fp32 [N] outputs
    N,
    NP,
    ignore_index,
    PB: tl.constexpr,
):
    """Deterministic merge of NP partial sums per row, in a fixed order (no atomics)."""
    row = tl.program_id(0)
    label = tl.load(lab_ptr + row)
    valid = label != ignore_index
    stride_f = N.to(tl.int64) * NP
    base = part_ptr + row.to(tl.int64) * NP
    m = float("-inf")
    mx = float("-inf")
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    for j0 in range(0, NP, PB):
        j = j0 + tl.arange(0, PB)
        msk = j < NP
        mj = tl.load(base + j, mask=msk, other=float("-inf"))
        s0j = tl.load(base + stride_f + j, mask=msk, other=0.0)
        s1j = tl.load(base + 2 * stride_f + j, mask=msk, other=0.0)
        s2j = tl.load(base + 3 * stride_f + j, mask=msk, other=0.0)
        s3j = tl.load(base + 4 * stride_f + j, mask=msk, other=0.0)
        mxj = tl.load(base + 5 * stride_f + j, mask=msk, other=float("-inf"))
        mx = max_nan(mx, tl.reduce(mxj, 0, max_nan))
        m_new = tl.maximum(m, tl.max(mj, axis=0))
        mu = tl.where(m_new > float("-inf"), m_new, 0.0)
        s0, s1, s2, s3 = rescale(s0, s1, s2, s3, m, mu)
        dj = mj - mu
        aj = tl.exp2(dj)
        adj = tl.where(aj > 0, aj * dj, 0.0)
        s0 += tl.sum(aj * s0j, axis=0)
        s1 += tl.sum(aj * s1j + adj * s0j, axis=0)
        s2 += tl.sum(aj * aj * s2j, axis=0)
        s3 += tl.sum(aj * aj * s3j + aj * adj * s2j, axis=0)
        m = m_new
    mu = tl.where(m > float("-inf"), m, 0.0)
    yk = tl.load(yk_ptr + row)
    logp, ent, s_star, s_exp = finalize(mu, s0, s1, s2, s3, yk, valid)
    tl.store(logp_ptr + row, logp)
    tl.store(ent_ptr + row, ent)
    tl.store(ss_ptr + row, s_star)
    tl.store(se_ptr + row, s_exp)
    tl.store(rmax_ptr + row, tl.where(valid, mx * LN2, 0.0))


def merge_block(num_partials: int) -> int:
    """Power-of-two chunk of partials the merge kernel reads per step."""
    return max(16, min(256, triton.next_power_of_2(num_partials)))
