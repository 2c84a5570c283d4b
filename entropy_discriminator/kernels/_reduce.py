"""Triton building blocks shared by the one-pass and the fused kernels.

Notation (all fp32).  Logits z_i = x_i / T are handled in base-2 units y_i = x_i * c, c = log2(e) / T, so that
e^(z_i - z_ref) = 2^(y_i - m) is one ``exp2`` of one FMA.  Against a reference m (a running max, possibly lazy:
moved only when the data exceed it by more than TAU, so e <= 2^TAU) the kernels accumulate

    s0 = sum e_i,  s1 = sum e_i d_i,  s2 = sum e_i^2,  s3 = sum e_i^2 d_i,   e_i = 2^d_i, d_i = y_i - m

with e^2 computed as e*e (one exponential per logit).  Moving m to m' multiplies the sums by a = 2^(m - m') and
shifts the d's by dl = m - m':

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
# d is clamped at -D_FLOOR before e*d is formed: 2^-256 is 0 in fp32, so the clamp changes no sum and keeps
# 0 * (-inf) (masked vocabulary entries, the masked tail) out of s1 and s3.
D_FLOOR = tl.constexpr(256.0)
# int32 error counters of :func:`count_row`: bad label, NaN/+inf, all -inf, scaling overflow (ERR_WORDS_C in kernels)
ERR_WORDS = 4
ERR_WORDS_C = tl.constexpr(ERR_WORDS)


@triton.jit
def max_nan(a, b):
    """max that propagates NaN (so a NaN logit reaches the row max the caller validates)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def exp2(d, FTZ: tl.constexpr):
    """2^d in fp32.  FTZ: one ``ex2.approx.ftz.f32``, saving ``tl.exp2``'s denormal fix-up (about three instructions
    per logit); every caller's largest term has e >= 1, so a flushed e < 2^-126 changes no fp32 sum."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(d)


@triton.jit
def rescale(s0, s1, s2, s3, m_old, m_new):
    """Move the sums from reference m_old to m_new >= m_old (m_old may be -inf, m_new too: sums are 0)."""
    dl = m_old - m_new
    a = tl.where(m_old == float("-inf"), 0.0, tl.exp2(dl))
    ad = tl.where(a > 0, a * dl, 0.0)
    s1 = a * s1 + ad * s0
    s0 = a * s0
    s3 = a * a * s3 + a * ad * s2
    s2 = a * a * s2
    return s0, s1, s2, s3


@triton.jit
def finalize(mu, s0, s1, s2, s3, yk, valid):
    """(logp, entropy, s_star, s_expected) from the sums against the finite reference mu; 0 where not ``valid``.
    log p is capped at 0: where the label holds nearly all the mass, rounding can leave s0 a few ulp under
    2^(y_k - mu)."""
    log_s0 = tl.log(s0)
    dbar = s1 / s0
    ent = log_s0 - LN2 * dbar
    s_exp = LN2 * (s3 - s2 * dbar) / (s0 * s0)
    logp = tl.minimum(LN2 * (yk - mu) - log_s0, 0.0, propagate_nan=tl.PropagateNan.ALL)
    s_star = tl.where(logp == float("-inf"), 0.0, tl.exp(logp) * (ent + logp))
    logp = tl.where(valid, logp, 0.0)
    ent = tl.where(valid, ent, 0.0)
    s_star = tl.where(valid, s_star, 0.0)
    s_exp = tl.where(valid, s_exp, 0.0)
    return logp, ent, s_star, s_exp


@triton.jit
def merge_partials(mj, s0j, s1j, s2j, s3j):
    """Combine vectors of partial sums, each against its own m_j (padding: -inf, zero sums), in a fixed order into
    (mu, s0, s1, s2, s3) against the finite reference mu (the largest m_j, 0 when every m_j is -inf)."""
    m = tl.max(mj, axis=0)
    mu = tl.where(m > float("-inf"), m, 0.0)
    dj = mj - mu
    aj = tl.exp2(dj)
    adj = tl.where(aj > 0, aj * dj, 0.0)
    s0 = tl.sum(aj * s0j, axis=0)
    s1 = tl.sum(aj * s1j + adj * s0j, axis=0)
    s2 = tl.sum(aj * aj * s2j, axis=0)
    s3 = tl.sum(aj * aj * s3j + aj * adj * s2j, axis=0)
    return mu, s0, s1, s2, s3


@triton.jit
def row_faults(valid, in_range, mx, mx_scaled):
    """The four fault flags of a row (False when ignored): label outside [0, V); NaN or +inf (``mx``, the
    NaN-propagating raw max); every logit -inf; finite logits whose scaled max ``mx_scaled`` overflows fp32."""
    bad_label = valid & (in_range == 0)
    nan_inf = valid & ((mx != mx) | (mx == float("inf")))
    masked = valid & (mx == float("-inf"))
    overflow = valid & (tl.abs(mx) < float("inf")) & (tl.abs(mx_scaled) == float("inf"))
    return bad_label, nan_inf, masked, overflow


@triton.jit
def count_row(err_ptr, valid, in_range, mx, mx_scaled):
    """:func:`row_faults` counted into ``err_ptr`` (int32 [ERR_WORDS]; relaxed adds: readers order themselves with an
    acquire); returns whether the row is bad."""
    bad_label, nan_inf, masked, overflow = row_faults(valid, in_range, mx, mx_scaled)
    tl.atomic_add(err_ptr, 1, mask=bad_label, sem="relaxed", scope="gpu")
    tl.atomic_add(err_ptr + 1, 1, mask=nan_inf, sem="relaxed", scope="gpu")
    tl.atomic_add(err_ptr + 2, 1, mask=masked, sem="relaxed", scope="gpu")
    tl.atomic_add(err_ptr + 3, 1, mask=overflow, sem="relaxed", scope="gpu")
    return bad_label | nan_inf | masked | overflow


@triton.jit
def store_stats(row, n_out, valid, bad, mu, s0, s1, s2, s3, yk, out_ptr, valid_ptr):
    """Write one row's statistics to fp32 [5, n_out] ``out_ptr`` (logp, entropy, s_star, s_expected, s_centered; NaN
    for a bad row, 0 for an ignored one) and ``valid`` to bool [n_out] ``valid_ptr``."""
    logp, ent, s_star, s_exp = finalize(mu, s0, s1, s2, s3, yk, valid)
    logp = tl.where(bad, float("nan"), logp)
    ent = tl.where(bad, float("nan"), ent)
    s_star = tl.where(bad, float("nan"), s_star)
    s_exp = tl.where(bad, float("nan"), s_exp)
    q = out_ptr + row
    tl.store(q, logp)
    tl.store(q + n_out, ent)
    tl.store(q + 2 * n_out, s_star)
    tl.store(q + 3 * n_out, s_exp)
    tl.store(q + 4 * n_out, s_star - s_exp)
    tl.store(valid_ptr + row, valid)


@triton.jit
def merge_kernel(part_ptr, yk_ptr, lab_ptr, out_ptr, valid_ptr, err_ptr, N, n_out, NP, V, ignore_index,
                 PB: tl.constexpr):
    """Deterministic merge of NP partial sums per row, in a fixed order.  ``part_ptr`` fp32 [6, N, NP] (m, s0..s3, mx
    in base-2 units), ``yk_ptr`` fp32 [N] (the label's y), ``lab_ptr`` int [N], ``out_ptr`` fp32 [5, n_out] (this
    launch's rows start there), ``valid_ptr`` bool [N], ``err_ptr`` int32 [ERR_WORDS]."""
    row = tl.program_id(0)
    label = tl.load(lab_ptr + row)
    valid = label != ignore_index
    stride_f = tl.cast(N, tl.int64) * NP
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
        mxj = tl.load(base + 5 * stride_f + j, mask=msk, other=float("-inf"))
        mx = max_nan(mx, tl.reduce(mxj, 0, max_nan))
        mu_j, t0, t1, t2, t3 = merge_partials(mj, tl.load(base + stride_f + j, mask=msk, other=0.0),
                                              tl.load(base + 2 * stride_f + j, mask=msk, other=0.0),
                                              tl.load(base + 3 * stride_f + j, mask=msk, other=0.0),
                                              tl.load(base + 4 * stride_f + j, mask=msk, other=0.0))
        m_new = tl.maximum(m, tl.max(mj, axis=0))
        mu = tl.where(m_new > float("-inf"), m_new, 0.0)
        s0, s1, s2, s3 = rescale(s0, s1, s2, s3, m, mu)
        t0, t1, t2, t3 = rescale(t0, t1, t2, t3, mu_j, mu)
        s0 += t0
        s1 += t1
        s2 += t2
        s3 += t3
        m = m_new
    mu = tl.where(m > float("-inf"), m, 0.0)
    yk = tl.load(yk_ptr + row)
    yk = tl.where(yk > m, m, yk)  # a label logit formed apart from the tiles may round above their max
    bad = count_row(err_ptr, valid, (label >= 0) & (label < V), mx, mx)
    store_stats(row.to(tl.int64), n_out, valid, bad, mu, s0, s1, s2, s3, yk, out_ptr, valid_ptr)


def merge_block(num_partials: int) -> int:
    """Power-of-two chunk of partials the merge kernel reads per step."""
    return max(16, min(256, triton.next_power_of_2(num_partials)))
