// Paged decode attention for the CPU engine: one query token per sequence, K/V read straight from the
// paged cache (block by block through the block table), each K and V row read exactly once.
//
// Why by hand: torch has no paged attention on CPU. The pure-PyTorch path gathers every sequence's whole
// context into a dense buffer and then runs SDPA over it (three passes over ~50 MB per layer for 64
// sequences of ~400 tokens); vLLM's CPU kernel lives inside vLLM. Built at first use with
// torch.utils.cpp_extension (engine/cpu/kernels.py); the gather + SDPA path stays the reference
// and the fallback.
//
// Parallel over sequences (or (sequence, KV head) when there are few); the G = H / Hkv query heads sharing a
// KV head are processed together so each K/V row is loaded once for all of them. Scores are kept for the
// whole context (two passes over the scores, one over K, one over V); accumulation is fp32 for fp32 and bf16
// caches alike. The cache may be bf16 under fp32 queries (kv_cache_dtype="bfloat16" with a float32 model):
// its rows are widened to fp32 as they are read, and everything else is the fp32 path.

#include "ops.h"

#include "simd.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int d) {
  float s = 0.f;
  for (int i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);  // vectorized: -fassociative-math
  return s;
}

template <typename T>
inline void axpy(float a, const T* v, float* out, int d) {
  for (int i = 0; i < d; ++i) out[i] += a * static_cast<float>(v[i]);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_AVX512 1

// Lane r of the result = the sum of v[r]'s 16 lanes: a transposing reduction (unpack, 64-bit unpack, two
// 128-bit shuffles), about 3 instructions per vector instead of a full horizontal sum for each.
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// 16 consecutive elements as fp32 (bf16 widened exactly: its bits are the top half of the fp32's).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// q . k_r for the m <= 16 rows k_r = k + r * stride (DIM elements each), as the first m lanes.
template <int DIM, typename T>
inline __m512 dots16(const float* q, const T* k, int64_t stride, int64_t m) {
  __m512 qv[DIM / 16], acc[16];
  for (int c = 0; c < DIM / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int r = 0; r < 16; ++r) {
    acc[r] = _mm512_setzero_ps();
    if (r < m)
      for (int c = 0; c < DIM / 16; ++c) acc[r] = _mm512_fmadd_ps(qv[c], load16(k + r * stride + 16 * c), acc[r]);
  }
  return sum16(acc);
}

#if defined(__AVX512BF16__)
#define TANDEM_AVX512_BF16 1
// dots16 for bf16 q and K with AVX512-BF16: each VDPBF16PS multiplies 32 bf16 pairs and adds them into 16
// fp32 lanes, so a K row is read and multiplied without widening it to fp32 first (the widening made the
// bf16 scores cost more than fp32's, per byte). The products of two bf16 values are exact in fp32; the sums
// are fp32 as before, in another order. q is the model's own bf16 (unscaled: the caller scales the sums).
template <int DIM>
inline __m512 dots16_bf16(const at::BFloat16* q, const at::BFloat16* k, int64_t stride, int64_t m) {
  __m512bh qv[DIM / 32];
  __m512 acc[16];
  for (int c = 0; c < DIM / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int r = 0; r < 16; ++r) {
    acc[r] = _mm512_setzero_ps();
    if (r < m)
      for (int c = 0; c < DIM / 32; ++c)
        acc[r] = _mm512_dpbf16_ps(acc[r], qv[c], (__m512bh)_mm512_loadu_si512(k + r * stride + 32 * c));
  }
  return sum16(acc);
}

// The probabilities of one head as bf16 (round to nearest even), for the VDPBF16PS value accumulation below.
inline void to_bf16(const float* s, int64_t n, at::BFloat16* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tandem_simd::lanes(n - i);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, s + i));
    _mm256_mask_storeu_epi16(out + i, k, h);
  }
}

// out += sum_r p[r] * v_r over the m rows v_r = v + r * stride (bf16 probabilities p and rows, fp32 sums), two
// rows per VDPBF16PS: rows r and r + 1 are interleaved 16 bits at a time (unpacklo/hi within each 128-bit lane)
// and multiplied by the broadcast pair (p[r], p[r + 1]). Widening every V row to fp32 instead cost three
// instructions per 16 elements for each query head of the group. The accumulators hold each 32-element chunk
// in the unpack order (simd.h), permuted in and out once per call. An odd last row is paired with zeros:
// nothing past the run is read (it could hold NaN bits).
template <int DIM>
inline void axpy_rows(const at::BFloat16* p, const at::BFloat16* v, int64_t stride, int64_t m, float* out) {
  static_assert(DIM % 32 == 0, "chunks of 32 bf16");
  __m512 lo[DIM / 32], hi[DIM / 32];
  for (int c = 0; c < DIM / 32; ++c)
    tandem_simd::to_unpack_order(_mm512_loadu_ps(out + 32 * c), _mm512_loadu_ps(out + 32 * c + 16), lo[c], hi[c]);
  auto step = [&](__m512bh pair, const at::BFloat16* a, const at::BFloat16* b) {
    for (int c = 0; c < DIM / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(a + 32 * c);
      const __m512i y = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_dpbf16_ps(lo[c], (__m512bh)_mm512_unpacklo_epi16(x, y), pair);
      hi[c] = _mm512_dpbf16_ps(hi[c], (__m512bh)_mm512_unpackhi_epi16(x, y), pair);
    }
  };
  int64_t r = 0;
  for (; r + 1 < m; r += 2) {
    int32_t pair;
    std::memcpy(&pair, p + r, sizeof(pair));  // (p[r], p[r + 1]); p + r may be 16-bit aligned only
    step((__m512bh)_mm512_set1_epi32(pair), v + r * stride, v + (r + 1) * stride);
  }
  if (r < m) {
    uint16_t last;
    std::memcpy(&last, p + r, sizeof(last));
    step((__m512bh)_mm512_set1_epi32(int32_t(last)), v + r * stride, nullptr);
  }
  for (int c = 0; c < DIM / 32; ++c) {
    __m512 x0, x1;
    tandem_simd::from_unpack_order(lo[c], hi[c], x0, x1);
    _mm512_storeu_ps(out + 32 * c, x0);
    _mm512_storeu_ps(out + 32 * c + 16, x1);
  }
}
#endif

// s[0, n) = exp(s - max s), in place; returns their sum.
inline float softmax_numerators(float* s, int64_t n) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tandem_simd::lanes(n - i);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + i));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tandem_simd::lanes(n - i);
    const __m512 e = tandem_simd::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), m));
    _mm512_mask_storeu_ps(s + i, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// out += sum_r s[r] * v_r over the m rows v_r = v + r * stride, out held in registers throughout.
template <int DIM, typename T>
inline void axpy_rows(const float* s, const T* v, int64_t stride, int64_t m, float* out) {
  __m512 acc[DIM / 16];
  for (int c = 0; c < DIM / 16; ++c) acc[c] = _mm512_loadu_ps(out + 16 * c);
  for (int64_t r = 0; r < m; ++r) {
    const __m512 a = _mm512_set1_ps(s[r]);
    for (int c = 0; c < DIM / 16; ++c) acc[c] = _mm512_fmadd_ps(a, load16(v + r * stride + 16 * c), acc[c]);
  }
  for (int c = 0; c < DIM / 16; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}
#endif

// DIM: the head size when it is a compile-time 64 or 128 (then the AVX-512 block path where the CPU has it:
// scores of 16 rows at a time with one transposing reduction, value rows accumulated in registers), else 0
// (the portable per-row loops, which the compiler vectorizes within each row). T: the queries' and output's
// dtype; C: the cache's (T, or bf16 under fp32 queries).
template <int DIM, typename T, typename C = T>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                 int64_t window, double softcap) {
  static_assert(std::is_same_v<T, C> || (std::is_same_v<T, float> && std::is_same_v<C, at::BFloat16>),
                "one dtype, or fp32 queries over a bf16 cache");
  // The AVX512-BF16 paths multiply bf16 queries and probabilities: only where the queries are bf16 themselves.
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, table_width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t row_stride = kv_heads * dim;  // between consecutive tokens of one block
  const int64_t block_elems = block_size * row_stride;  // one block of one layer's K (or V): contiguous
  // A work item is one sequence and a span of its KV heads: all of them when there are enough sequences to
  // keep every thread busy, so each block is read as one contiguous run (a K row holds every KV head; one
  // head's slice of it is a third of the row for SmolLM2, and the hardware fetches the lines around it
  // anyway), else one head per item so a few long sequences still spread over the threads.
  const int64_t span = batch >= 4 * at::get_num_threads() ? kv_heads : 1;
  const int64_t spans = kv_heads / span, hs = span * group;  // query heads per item

  at::parallel_for(0, batch * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hs * dim), acc(hs * dim), scores, inv_sum(hs);
    std::vector<at::BFloat16> probs;  // bf16 copies of the probabilities (the AVX512-BF16 value path)
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / spans, h0 = (w % spans) * span;  // KV heads [h0, h0 + span)
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int32_t* table = tables + b * table_width;
      // Calls f(first position, its cache row, count) for each run of consecutive positions in [lo, hi) that
      // share a block, walking the block table and prefetching the block two ahead of `base_ptr` into L2
      // (blocks are scattered: the hardware's stream restarts at each one). Prefetching only the next block,
      // into L1, gained less. The gain is sensitive to code generation (the same walk rewritten
      // around a prefetch lambda lost it), so re-measure a change in the engine or over a many-layer pool: a
      // benchmark on one layer's cache runs from L3. Figures: docs/engine.md#decode-attention-cpu_decodecpp.
      auto for_each_run = [&](const C* base_ptr, int64_t lo, int64_t hi, auto&& f) {
        for (int64_t blk = lo / block_size; blk * block_size < hi; ++blk) {
          if ((blk + 2) * block_size < hi) {
            const char* next = reinterpret_cast<const char*>(base_ptr + int64_t(table[blk + 2]) * block_elems);
            for (int64_t off = 0; off < int64_t(block_elems * sizeof(C)); off += 64)
              __builtin_prefetch(next + off, 0, 1);  // locality 1: PREFETCHT2
          }
          const int64_t start = std::max(lo, blk * block_size), stop = std::min(hi, (blk + 1) * block_size);
          f(start, int64_t(table[blk]) * block_size + start - blk * block_size, stop - start);
        }
      };
      auto for_each_row = [&](const C* base_ptr, int64_t lo, int64_t hi, auto&& f) {
        for_each_run(base_ptr, lo, hi, [&](int64_t t0, int64_t r0, int64_t cnt) {
          for (int64_t i = 0; i < cnt; ++i) f(t0 + i, r0 + i);
        });
      };
      constexpr bool kBlocked = DIM > 0;
      for (int64_t j = 0; j < hs; ++j)
        for (int64_t i = 0; i < dim; ++i)
          qf[j * dim + i] = static_cast<float>(qp[(b * heads + h0 * group + j) * dim + i]) * float(scale);
      scores.assign(hs * n, 0.f);
#ifdef TANDEM_AVX512
      if constexpr (kBlocked) {
        for_each_run(kp, first, len, [&](int64_t t0, int64_t r0, int64_t cnt) {
          for (int64_t c0 = 0; c0 < cnt; c0 += 16) {
            const int64_t m = std::min<int64_t>(16, cnt - c0);
            const C* rows = kp + (r0 + c0) * row_stride + h0 * DIM;
            for (int64_t j = 0; j < hs; ++j) {
              __m512 d;
#ifdef TANDEM_AVX512_BF16
              if constexpr (kBf16)
                d = _mm512_mul_ps(dots16_bf16<DIM>(qp + (b * heads + h0 * group + j) * DIM, rows + (j / group) * DIM,
                                                   row_stride, m), _mm512_set1_ps(float(scale)));
              else
#endif
                d = dots16<DIM>(qf.data() + j * DIM, rows + (j / group) * DIM, row_stride, m);
              _mm512_mask_storeu_ps(scores.data() + j * n + (t0 + c0 - first), __mmask16((1u << m) - 1), d);
            }
          }
        });
      } else
#endif
      for_each_row(kp, first, len, [&](int64_t t, int64_t row) {
        const C* krow = kp + row * row_stride + h0 * dim;
        for (int64_t j = 0; j < hs; ++j)
          scores[j * n + (t - first)] = dot(qf.data() + j * dim, krow + (j / group) * dim, dim);
      });
      if (softcap > 0) {  // Gemma 2: cap * tanh(score / cap) on the scaled scores, before the softmax
        const float cap = float(softcap);
        for (float& s : scores) s = cap * std::tanh(s / cap);
      }
      for (int64_t j = 0; j < hs; ++j) {
        float* s = scores.data() + j * n;
#ifdef TANDEM_AVX512
        inv_sum[j] = 1.f / softmax_numerators(s, n);  // vector max and exp: the scalar max + expf loop was slower
#else
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          s[i] = expf(s[i] - m);  // vectorized through glibc's libmvec (-fno-math-errno, omp simd)
          sum += s[i];
        }
        inv_sum[j] = 1.f / sum;
#endif
      }
      std::fill(acc.begin(), acc.end(), 0.f);
#ifdef TANDEM_AVX512
      if constexpr (kBlocked) {
        auto values = [&](const auto* weights) {  // the fp32 scores, or their bf16 copies
          for_each_run(vp, first, len, [&](int64_t t0, int64_t r0, int64_t cnt) {
            const C* rows = vp + r0 * row_stride + h0 * DIM;
            for (int64_t j = 0; j < hs; ++j)
              axpy_rows<DIM>(weights + j * n + (t0 - first), rows + (j / group) * DIM, row_stride, cnt,
                             acc.data() + j * DIM);
          });
        };
#ifdef TANDEM_AVX512_BF16
        if constexpr (kBf16) {
          // Value rows by VDPBF16PS on bf16 probabilities (fp32 sums, as torch's CPU flash attention does for
          // bf16): fewer instructions than widening every V row to fp32, which shows once the cache is in L3
          // and memory no longer stalls the loop (docs/engine.md#decode-attention-cpu_decodecpp).
          probs.resize(hs * n);
          for (int64_t j = 0; j < hs; ++j) to_bf16(scores.data() + j * n, n, probs.data() + j * n);
          values(probs.data());
        } else
#endif
          values(scores.data());
      } else
#endif
      for_each_row(vp, first, len, [&](int64_t t, int64_t row) {
        const C* vrow = vp + row * row_stride + h0 * dim;
        for (int64_t j = 0; j < hs; ++j)
          axpy(scores[j * n + (t - first)], vrow + (j / group) * dim, acc.data() + j * dim, dim);
      });
      for (int64_t j = 0; j < hs; ++j)
        for (int64_t i = 0; i < dim; ++i)
          op[(b * heads + h0 * group + j) * dim + i] = static_cast<T>(acc[j * dim + i] * inv_sum[j]);
    }
  });
}

// q [B, H, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] (contiguous; q's dtype, or bf16 under fp32 q);
// block_tables [B, W] int32; seq_lens [B] int32 (the new token included, its K/V already stored); window 0 =
// full context; softcap 0 = off.
// Returns [B, H, D] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                        double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  const bool widen = q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;  // fp32 q, bf16 cache
  TORCH_CHECK((q.scalar_type() == k_cache.scalar_type() || widen) && v_cache.scalar_type() == k_cache.scalar_type(),
              "dtype mismatch: the cache must be in q's dtype, or bf16 under fp32 q");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "tables must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head layout mismatch");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  if (widen) {
    using B = at::BFloat16;
    auto run = [&](auto impl) { impl(q, k_cache, v_cache, tables, lens, out, scale, window, softcap); };
    if (q.size(2) == 64) run(decode_impl<64, float, B>);
    else if (q.size(2) == 128) run(decode_impl<128, float, B>);
    else run(decode_impl<0, float, B>);
  } else if (q.scalar_type() == at::kFloat) {
    if (q.size(2) == 64) decode_impl<64, float>(q, k_cache, v_cache, tables, lens, out, scale, window, softcap);
    else if (q.size(2) == 128) decode_impl<128, float>(q, k_cache, v_cache, tables, lens, out, scale, window, softcap);
    else decode_impl<0, float>(q, k_cache, v_cache, tables, lens, out, scale, window, softcap);
  } else if (q.scalar_type() == at::kBFloat16) {
    using B = at::BFloat16;
    if (q.size(2) == 64) decode_impl<64, B>(q, k_cache, v_cache, tables, lens, out, scale, window, softcap);
    else if (q.size(2) == 128) decode_impl<128, B>(q, k_cache, v_cache, tables, lens, out, scale, window, softcap);
    else decode_impl<0, B>(q, k_cache, v_cache, tables, lens, out, scale, window, softcap);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

// A decode-only step's whole attention for one layer, from its qkv projection: what Attention.attend and the
// backend's forward otherwise do in some twenty torch calls a layer. qkv [T, (H + 2 Hkv) D] (rows contiguous: q
// heads, k heads, v heads); cos/sin [T, 1 or none, half] in qkv's dtype, or None (no rotary here: q and k as they
// are); k/v caches [blocks, block_size, Hkv, D] in qkv's dtype; slots [T] int64 (-1: not stored); block_tables /
// seq_lens as paged_decode's, a row each. Rotates q and k in qkv in place (fused.cpp's rope_), copies each row's k
// and v into its slot, then paged_decode of the q heads. Returns [T, H * D].
at::Tensor decode_attend(const at::Tensor& qkv, const c10::optional<at::Tensor>& cos,
                         const c10::optional<at::Tensor>& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         int64_t heads, int64_t kv_heads, double scale, int64_t window, double softcap) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == kv_heads && v_cache.sizes() == k_cache.sizes(),
              "decode_attend: caches must be [blocks, block_size, ", kv_heads, ", head_dim]");
  const int64_t tokens = qkv.size(0), d = k_cache.size(3), row = kv_heads * d;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "decode_attend: qkv must be [tokens, (heads + 2 kv_heads) head_dim] with contiguous rows");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attend: the caches must be contiguous, in qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens &&
                  block_tables.size(0) == tokens && seq_lens.size(0) == tokens,
              "decode_attend: a slot, a block table row and a length per token");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "decode_attend: cos and sin together");
  if (cos.has_value()) {
    const at::Tensor c = cos->reshape({tokens, -1}), s = sin->reshape({tokens, -1});
    tandem_fused::rope(qkv, c, s, heads + kv_heads, d);
  }
  const auto slot = slots.contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t capacity = k_cache.numel() / row, bytes = row * qkv.element_size();
  const char* src = static_cast<const char*>(qkv.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ld = qkv.stride(0) * qkv.element_size(), es = qkv.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    if (sp[t] < 0) continue;
    TORCH_CHECK(sp[t] < capacity, "decode_attend: slot ", sp[t], " is past the cache's ", capacity);
    std::memcpy(kc + sp[t] * bytes, src + t * ld + heads * d * es, bytes);
    std::memcpy(vc + sp[t] * bytes, src + t * ld + (heads + kv_heads) * d * es, bytes);
  }
  const at::Tensor q = qkv.narrow(1, 0, heads * d).contiguous().view({tokens, heads, d});
  return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap).view({tokens, heads * d});
}

}  // namespace

const tandem_ops::DecodeOps tandem_ops::kDecode{&paged_decode, &decode_attend};
