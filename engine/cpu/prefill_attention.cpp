// Paged prefill attention for the CPU engine: every multi-token chunk of a step in one call, K/V read straight
// from the paged cache, flash-style (keys in chunks of KC with an online softmax), causal tiles skipped.
//
// Why by hand: torch's CPU flash attention (SDPA) reaches a small fraction of what the cores do on small-head
// GQA prefill shapes (SmolLM2: 9 heads over 3 KV heads of 64 dims) and needs each chunk's K/V gathered out of
// the cache first; on a CPU without AVX-512 it is slower still, and long prompts crawl. vLLM's CPU build has
// its own prefill kernel too. Here both products are register-blocked micro-kernels over a tile of query rows:
// scores as 16 keys per row of accumulators (K transposed in 16-key tiles, so a query value is one broadcast),
// values as a run of dims per accumulator; accumulation is fp32. Each micro-kernel reads its rows from one base
// pointer at fixed strides (the item's queries copied together first), so the compiler keeps the addresses in
// displacements instead of spilling a pointer per row.
//
// One driver (Prefill: the work split, the K packing, the online softmax's loop), two paths of what runs
// inside it (the packing of K and V, the two micro-kernels, the per-row softmax, the output row):
// - Avx512, in builds with AVX-512 F/BW (the "avx512" level): intrinsics, 16 lanes a register, 8 score rows and
//   4 / 2 / 2 value rows per micro-kernel at head size 64 / 128 / 256 (256: two passes of 128 dims). bf16 where
//   the CPU has AVX512-BF16: VDPBF16PS on pairs (K packed as bf16 pairs, V rows interleaved 16 bits at a time, bf16
//   probabilities, as torch's flash kernel and the decode kernel use); fp32 by FMA. exp: simd.h's exp_nonpositive.
// - Portable, everywhere else (the "avx2" and "default" levels, and bf16 in an AVX-512 build without
//   AVX512-BF16): GCC vector extensions of W floats, W = 8 where the build has AVX (one ymm register: AVX2 + FMA
//   under -march=x86-64-v3), else 4 (one SSE2 register under -march=x86-64), so one source compiles to either;
//   the register blocks fit 16 such registers. bf16 is widened to fp32 (its bits are the top half of an
//   fp32's) as it is copied: the queries with the item's rows, K as it is transposed, V once per key chunk, so
//   both micro-kernels are fp32 multiply-adds for either dtype and the probabilities stay fp32; the output is
//   rounded to bf16 nearest-even. exp: the same Cody-Waite reduction and Cephes polynomial as simd.h, 2^n
//   built from the exponent bits; the causal and window masks are vector compares and selects.
//
// The cache may be bf16 under fp32 queries (kv_cache_dtype="bfloat16" with a float32 model): both paths then run
// their fp32 kernels on K and V widened as they are packed (Avx512: K into its fp32 tiles, V rows into a
// per-thread fp32 copy of the key chunk; portable: as it widens a bf16 cache anyway), so the cache read is half
// the bytes and the arithmetic is fp32's.
//
// Work items are (chunk, KV head, tile of query positions), the G = H / Hkv query heads of the KV head
// together (each K/V row packed once for all of them), handed out heaviest first from a shared counter
// (causal tiles late in a sequence cost several times the early ones). K is transposed once per (chunk, KV
// head) before the items run, not once per item: an item reads every key up to its last position, so per-item
// packing repeated a sequence's early keys in each of its items. Chunks are packed in groups of at most
// k_pack_bytes; a chunk whose K alone is larger is packed per item, KC keys at a time.

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

// A zero K/V/query row (bit pattern 0 is 0.0 in fp32 and bf16), as long as the longest: 256 dims of fp32.
constexpr int kMaxDim = 256;
alignas(64) const uint32_t kZeroRow[kMaxDim] = {};

constexpr int64_t KC = 256;  // keys per chunk: the online softmax rescales the outputs once per chunk

template <typename T>
constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;

// The call's arguments, and how every path finds a key's cache row. DIM: the head size; T: float or bf16 (the
// queries and the output); C: the cache's dtype, T or bf16 under fp32 queries.
template <int DIM_, typename T_, typename C_ = T_>
struct Args {
  static constexpr int DIM = DIM_;
  using T = T_;
  using C = C_;
  static_assert(DIM % 64 == 0 && DIM <= kMaxDim, "head sizes 64, 128, 256");
  static_assert(std::is_same_v<T, C> || (std::is_same_v<T, float> && std::is_same_v<C, at::BFloat16>),
                "one dtype, or fp32 queries over a bf16 cache");
  static constexpr bool kWiden = !std::is_same_v<T, C>;  // the cache's rows widened to fp32 as they are packed

  const T* q;
  const C* kc;
  const C* vc;
  T* out;
  int64_t q_stride, out_stride, heads, kv_heads, group, block_size, row_stride, table_width;
  const int32_t *tables, *q_start, *q_len, *seq_len;
  float scale, softcap;
  int64_t window;
  int64_t num_chunks, k_pack_bytes;

  const T* zero_row() const { return reinterpret_cast<const T*>(kZeroRow); }
  const C* zero_cache_row() const { return reinterpret_cast<const C*>(kZeroRow); }

  // The first key a query at position `pos` sees: 0, or the start of its sliding window.
  int64_t window_start(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }

  const C* cache_row(const C* cache, int64_t c, int64_t key, int64_t h) const {
    const int64_t block = tables[c * table_width + key / block_size];
    return cache + (block * block_size + key % block_size) * row_stride + h * DIM;
  }
};

// What a path provides to the driver (Prefill, below), besides the arguments:
//   U, SR, PR: 32-bit units per packed K row; query rows per score and per value micro-kernel;
//   Scratch: per-thread buffers with kp, vrow, s, o, m, l, qb (the item's query rows);
//   init(w, pack_here): sizes a thread's buffers (pack_here: K is packed per item, KC keys at a time);
//   prepare(w, rows_pad): sizes an item's buffers beyond the driver's;
//   load_query(dst, src): one query row into qb;
//   pack_k, pack_v, scores, values: the packing and the micro-kernels; probs(w, r): row r's probabilities;
//   softmax_row(w, r, k0, tiles, a, b): row r's scores of keys [k0, k0 + 16 tiles), of which [a, b] are
//     visible: scaled, capped, exponentiated against the running max, the running sum and outputs rescaled;
//   store_row(dst, o, l): the output row o / l.

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TANDEM_PREFILL_AVX512 1

// The lanes i of 16 whose key base + i lies in [lo, hi].
inline __mmask16 lane_range(int64_t base, int64_t lo, int64_t hi) {
  const int64_t a = std::max<int64_t>(lo - base, 0), b = std::min<int64_t>(hi - base, 15);
  return a > b ? __mmask16(0) : __mmask16(((1u << (b - a + 1)) - 1) << a);
}

template <int DIM, typename T, typename C = T>
struct Avx512 : Args<DIM, T, C> {
  using Base = Args<DIM, T, C>;
  using Base::kc;
  using Base::vc;
  using Base::scale;
  using Base::softcap;
  using Base::cache_row;
  using Base::zero_cache_row;
  using Base::kWiden;

  static constexpr int U = DIM * int(sizeof(T)) / 4;  // 32-bit units per row: bf16 pairs, or floats
  static constexpr int SR = 8;                        // query rows per score micro-kernel (8 accumulators + K)
  // The value micro-kernel: PR rows x VC registers of dims (16 accumulators), DIM / (16 VC) passes over the
  // chunk's V. At most 8 registers of dims a pass, so each V load serves at least 2 rows: 256 dims in one
  // pass of one row would be a load per multiply-add.
  static constexpr int VC = DIM / 16 < 8 ? DIM / 16 : 8;
  static constexpr int PR = 16 / VC;

  // Per-thread buffers.
  struct Scratch {
    std::vector<uint32_t> kp;  // [KC / 16][U][16]: per-item packed K (chunks too large to pack ahead)
    // bf16: rows 2i, 2i + 1 interleaved (unpack order), [DIM / (16 VC)][KC / 2][16 VC]: each pass of the value
    // micro-kernel reads one contiguous block (a pass reading part of every row ran the 256-dim kernel
    // well below the 128-dim one per flop); fp32: unused
    std::vector<uint32_t> vp;
    std::vector<float> vw;       // a bf16 cache under fp32 queries: the key chunk's V rows widened, [KC][DIM]
    std::vector<const T*> vrow;  // fp32: each key's V row (padding keys: a zero row)
    std::vector<float> s, o, m, l;  // scores / probabilities [rows][KC], outputs [rows][DIM], max, sum
    std::vector<at::BFloat16> p;    // bf16 probabilities [rows][KC]
    std::vector<T> qb;              // the item's query rows, contiguous [rows_pad][DIM]
  };

  void init(Scratch& w, bool pack_here) const {
    w.kp.resize(pack_here ? KC * U : 0);
    w.vp.resize(kBf16<T> ? KC / 2 * DIM : 0);
    w.vw.resize(kWiden ? KC * DIM : 0);
    w.vrow.resize(KC);
  }

  void prepare(Scratch& w, int64_t rows_pad) const {
    if constexpr (kBf16<T>) w.p.resize(rows_pad * KC);
  }

  void load_query(T* dst, const T* src) const { std::memcpy(dst, src, DIM * sizeof(T)); }

  // bf16: where unit d of the key pair jp's interleaved V row is in vp (d: a multiple of 16).
  static uint32_t* vpack(Scratch& w, int64_t jp, int d) {
    return w.vp.data() + (d / (16 * VC)) * (KC / 2 * 16 * VC) + jp * (16 * VC) + d % (16 * VC);
  }

  const void* probs(const Scratch& w, int64_t r) const {
    if constexpr (kBf16<T>) return w.p.data() + r * KC;
    else return w.s.data() + r * KC;
  }

  // One 16-key tile of KV head h's K, keys [k0, k0 + 16) (those from k1 on zeros), transposed for the score
  // micro-kernel: dst[u][j] = unit u (a float, or a bf16 pair) of key k0 + j.
  void pack_k(uint32_t* dst, int64_t c, int64_t h, int64_t k0, int64_t k1) const {
    for (int64_t j = 0; j < 16; ++j) {
      if constexpr (kWiden) {  // bf16 keys as fp32 bits: a bf16 value's bits are the top half of its fp32's
        const uint16_t* src = reinterpret_cast<const uint16_t*>(k0 + j < k1 ? cache_row(kc, c, k0 + j, h)
                                                                            : zero_cache_row());
        for (int u = 0; u < U; ++u) dst[u * 16 + j] = uint32_t(src[u]) << 16;
      } else {
        const uint32_t* src = k0 + j < k1 ? reinterpret_cast<const uint32_t*>(cache_row(kc, c, k0 + j, h)) : kZeroRow;
        for (int u = 0; u < U; ++u) dst[u * 16 + j] = src[u];
      }
    }
  }

  // Keys [k0, k0 + 16 * tiles) of KV head h's V for the value micro-kernel; keys from k1 on are zeros.
  void pack_v(Scratch& w, int64_t c, int64_t h, int64_t k0, int64_t k1, int64_t tiles) const {
    for (int64_t j = 0; j < 16 * tiles; ++j) {
      const C* v = k0 + j < k1 ? cache_row(vc, c, k0 + j, h) : zero_cache_row();
      if constexpr (kWiden) {  // 16 bf16 values at a time, shifted into the top halves of fp32 lanes
        float* d = w.vw.data() + j * DIM;
        for (int i = 0; i < DIM; i += 16) {
          const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)));
          _mm512_storeu_ps(d + i, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
        }
        w.vrow[j] = d;
      } else {
        if constexpr (kBf16<T>) {
          if (j % 2) {  // rows j - 1 and j, 16 bits at a time within each 128-bit lane
            const T* prev = w.vrow[j - 1];
            for (int ch = 0; ch < DIM / 32; ++ch) {
              const __m512i a = _mm512_loadu_si512(prev + 32 * ch), b = _mm512_loadu_si512(v + 32 * ch);
              uint32_t* d = vpack(w, j / 2, 32 * ch);
              _mm512_storeu_si512(d, _mm512_unpacklo_epi16(a, b));
              _mm512_storeu_si512(d + 16, _mm512_unpackhi_epi16(a, b));
            }
          }
        }
        w.vrow[j] = v;
      }
    }
  }

  // s[r][16 t ...] = q_r . k over the key tiles, for SR consecutive rows of the item's packed queries.
  void scores(const uint32_t* kp, const T* qb, float* sb, int64_t tiles) const {
    for (int64_t t = 0; t < tiles; ++t) {
      const uint32_t* kt = kp + t * U * 16;
      const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qb);
      __m512 acc[SR];
      for (int i = 0; i < SR; ++i) acc[i] = _mm512_setzero_ps();
      for (int u = 0; u < U; ++u) {
        const __m512i kz = _mm512_loadu_si512(kt + u * 16);
        for (int i = 0; i < SR; ++i) {
          const __m512i qz = _mm512_set1_epi32(int32_t(q32[i * U + u]));
#ifdef __AVX512BF16__
          if constexpr (kBf16<T>)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)qz, (__m512bh)kz);
          else
#endif
            acc[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(qz), _mm512_castsi512_ps(kz), acc[i]);
        }
      }
      for (int i = 0; i < SR; ++i) _mm512_storeu_ps(sb + i * KC + 16 * t, acc[i]);
    }
  }

  // o_r += p_r . V over the chunk's keys, for PR consecutive rows (outputs at ob, stride DIM; probabilities at
  // pb, stride KC), 16 VC dims a pass (bf16: the unpack order is within 32 dims, so a pass keeps it).
  void values(Scratch& w, float* ob, const void* pb, int64_t tiles) const {
    for (int d0 = 0; d0 < DIM; d0 += 16 * VC) {
      __m512 acc[PR][VC];
      for (int i = 0; i < PR; ++i)
        for (int c = 0; c < VC; ++c) acc[i][c] = _mm512_loadu_ps(ob + i * DIM + d0 + 16 * c);
#ifdef __AVX512BF16__
      if constexpr (kBf16<T>) {
        const uint32_t* p32 = static_cast<const uint32_t*>(pb);  // bf16 pairs, KC / 2 per row
        for (int64_t jp = 0; jp < 8 * tiles; ++jp) {
          const uint32_t* vj = vpack(w, jp, d0);
          __m512i vz[VC];
          for (int c = 0; c < VC; ++c) vz[c] = _mm512_loadu_si512(vj + 16 * c);
          for (int i = 0; i < PR; ++i) {
            const __m512bh pz = (__m512bh)_mm512_set1_epi32(int32_t(p32[i * (KC / 2) + jp]));
            for (int c = 0; c < VC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pz, (__m512bh)vz[c]);
          }
        }
      } else
#endif
      {
        const float* pf = static_cast<const float*>(pb);
        for (int64_t j = 0; j < 16 * tiles; ++j) {
          const float* vj = reinterpret_cast<const float*>(w.vrow[j]) + d0;
          __m512 vz[VC];
          for (int c = 0; c < VC; ++c) vz[c] = _mm512_loadu_ps(vj + 16 * c);
          for (int i = 0; i < PR; ++i) {
            const __m512 pz = _mm512_set1_ps(pf[i * KC + j]);
            for (int c = 0; c < VC; ++c) acc[i][c] = _mm512_fmadd_ps(pz, vz[c], acc[i][c]);
          }
        }
      }
      for (int i = 0; i < PR; ++i)
        for (int c = 0; c < VC; ++c) _mm512_storeu_ps(ob + i * DIM + d0 + 16 * c, acc[i][c]);
    }
  }

  // Row r of the item: scale, cap, mask; the online softmax (keys [k0, k0 + 16 tiles), [a, b] visible).
  void softmax_row(Scratch& w, int64_t r, int64_t k0, int64_t tiles, int64_t a, int64_t b) const {
    float* s = w.s.data() + r * KC;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < tiles; ++t) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * t), _mm512_set1_ps(scale));
      if (softcap > 0) {  // Gemma 2: cap * tanh(score / cap)
        alignas(64) float buf[16];
        _mm512_store_ps(buf, x);
        for (float& y : buf) y = softcap * std::tanh(y / softcap);
        x = _mm512_load_ps(buf);
      }
      _mm512_storeu_ps(s + 16 * t, x);
      mx = _mm512_mask_max_ps(mx, lane_range(k0 + 16 * t, a, b), mx, x);
    }
    const float m_new = std::max(w.m[r], _mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m_new);
    for (int64_t t = 0; t < tiles; ++t) {
      const __mmask16 valid = lane_range(k0 + 16 * t, a, b);  // none when a > b: the row sees no key here
      const __m512 e = _mm512_maskz_mov_ps(valid, tandem_simd::exp_nonpositive(
                                                      _mm512_sub_ps(_mm512_loadu_ps(s + 16 * t), mv)));
      sum = _mm512_add_ps(sum, e);
      if constexpr (kBf16<T>)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.p.data() + r * KC + 16 * t),
                            (__m256i)_mm512_cvtneps_pbh(e));
      else
        _mm512_storeu_ps(s + 16 * t, e);
    }
    if (m_new == -std::numeric_limits<float>::infinity()) return;  // no key yet: nothing to rescale
    const float alpha = std::exp(w.m[r] - m_new);  // 0 on the first chunk with keys (m was -inf)
    w.m[r] = m_new;
    w.l[r] = w.l[r] * alpha + _mm512_reduce_add_ps(sum);
    if (alpha != 1.f)
      for (int64_t d = 0; d < DIM; d += 16)
        _mm512_storeu_ps(w.o.data() + r * DIM + d, _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * DIM + d),
                                                                 _mm512_set1_ps(alpha)));
  }

  // The output row o / l at dst.
  void store_row(T* dst, const float* o, float l) const {
    const __m512 inv = _mm512_set1_ps(1.f / l);
    for (int d = 0; d < DIM; d += 32) {
      __m512 x0 = _mm512_loadu_ps(o + d), x1 = _mm512_loadu_ps(o + d + 16);
      if constexpr (kBf16<T>) {  // the bf16 sums are in unpack order (simd.h)
        tandem_simd::from_unpack_order(x0, x1, x0, x1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(x0, inv)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d + 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(x1, inv)));
      } else {
        _mm512_storeu_ps(reinterpret_cast<float*>(dst) + d, _mm512_mul_ps(x0, inv));
        _mm512_storeu_ps(reinterpret_cast<float*>(dst) + d + 16, _mm512_mul_ps(x1, inv));
      }
    }
  }
};
#endif  // AVX-512

namespace portable {

constexpr int W = tandem_simd::kLanes;  // floats a register (simd.h)
using tandem_simd::vf;
using tandem_simd::vi;
using tandem_simd::vu;
constexpr int NV = 16 / W;  // registers per 16-key tile

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return vf{} + x; }
inline vi splat_i(int32_t x) { return vi{} + x; }
inline vi iota() {
  vi v{};
  for (int i = 0; i < W; ++i) v[i] = i;
  return v;
}
inline vf select(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }  // m: all ones or zeros a lane
inline vf vmax(vf a, vf b) { return a > b ? a : b; }  // MAXPS
inline vf vmin(vf a, vf b) { return a < b ? a : b; }  // MINPS

// exp(x) for the softmax's x = score - max <= 0, as simd.h's: Cody-Waite reduction by ln 2 and Cephes'
// degree-6 expf polynomial. x is clamped to [-87, 0] (visible lanes are <= 0; masked ones are discarded), so
// n = round(x / ln 2) >= -126 and 2^n, built as the exponent bits (n + 127) << 23, is a normal float (e^-87 is
// nothing next to the max's 1).
inline vf exp_nonpositive(vf x) {
  x = vmin(vmax(x, splat(-87.f)), vf{});
  // Rounding to nearest as truncation of t - 0.5 (t <= 0): SSE2 has no rounding instruction, and the
  // 1.5 * 2^23 trick's add and subtract would be folded away under -fassociative-math.
  const vi ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);
  const vf n = __builtin_convertvector(ni, vf);
  vf r = x - n * 0.693359375f;
  __asm__("" : "+x"(r));  // keeps the two steps apart: -fassociative-math would merge them into x - n * ln 2
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = p * r + c;
  p = p * (r * r) + (r + 1.f);
  return p * (vf)((ni + 127) << 23);
}

using tandem_simd::widen;

template <int DIM, typename T, typename C = T>
struct Kernel : Args<DIM, T, C> {
  using Base = Args<DIM, T, C>;
  using Base::kc;
  using Base::vc;
  using Base::scale;
  using Base::softcap;
  using Base::cache_row;
  using Base::zero_cache_row;

  static constexpr int U = DIM;              // K packed as fp32 (bf16 widened)
  static constexpr int SR = W == 8 ? 6 : 2;  // score rows: SR x NV accumulators + NV of K + a broadcast
  static constexpr int VW = 2;               // value micro-kernel: 2 W dims at a time,
  static constexpr int PR = 4;               // of PR rows: PR x 2 accumulators + 2 of V + a broadcast (6 rows:
                                             // GCC spills accumulators); every head size in DIM / (VW W) passes

  // Per-thread buffers.
  struct Scratch {
    std::vector<uint32_t> kp;  // [KC / 16][DIM][16] fp32 bits: per-item packed K (chunks too large to pack ahead)
    std::vector<float> vp;     // a bf16 cache: the key chunk's V rows widened, [KC][DIM]; fp32: unused
    std::vector<const float*> vrow;  // each key's V row in fp32 (padding keys: a zero row)
    std::vector<float> s, o, m, l;   // scores / probabilities [rows][KC], outputs [rows][DIM], max, sum
    std::vector<float> qb;           // the item's query rows in fp32, contiguous [rows_pad][DIM]
  };

  void init(Scratch& w, bool pack_here) const {
    w.kp.resize(pack_here ? KC * U : 0);
    w.vp.resize(kBf16<C> ? KC * DIM : 0);
    w.vrow.resize(KC);
  }

  void prepare(Scratch&, int64_t) const {}

  void load_query(float* dst, const T* src) const {
    for (int i = 0; i < DIM; ++i) dst[i] = widen(src[i]);
  }

  const void* probs(const Scratch& w, int64_t r) const { return w.s.data() + r * KC; }

  // One 16-key tile of KV head h's K, keys [k0, k0 + 16) (those from k1 on zeros), transposed and in fp32 for
  // the score micro-kernel: dst[d][j] = dim d of key k0 + j.
  void pack_k(uint32_t* dst, int64_t c, int64_t h, int64_t k0, int64_t k1) const {
    float* d = reinterpret_cast<float*>(dst);
    for (int64_t j = 0; j < 16; ++j) {
      const C* src = k0 + j < k1 ? cache_row(kc, c, k0 + j, h) : zero_cache_row();
      for (int u = 0; u < DIM; ++u) d[u * 16 + j] = widen(src[u]);
    }
  }

  // Keys [k0, k0 + 16 * tiles) of KV head h's V for the value micro-kernel (bf16 widened into vp); keys from k1
  // on are zeros.
  void pack_v(Scratch& w, int64_t c, int64_t h, int64_t k0, int64_t k1, int64_t tiles) const {
    for (int64_t j = 0; j < 16 * tiles; ++j) {
      const C* v = k0 + j < k1 ? cache_row(vc, c, k0 + j, h) : zero_cache_row();
      if constexpr (kBf16<C>) {
        float* d = w.vp.data() + j * DIM;
        for (int i = 0; i < DIM; ++i) d[i] = widen(v[i]);
        w.vrow[j] = d;
      } else {
        w.vrow[j] = v;
      }
    }
  }

  // s[r][16 t ...] = q_r . k over the key tiles, for SR consecutive rows of the item's packed queries.
  void scores(const uint32_t* kp, const float* qb, float* sb, int64_t tiles) const {
    for (int64_t t = 0; t < tiles; ++t) {
      const float* kt = reinterpret_cast<const float*>(kp) + t * U * 16;
      vf acc[SR][NV];
      for (int i = 0; i < SR; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = vf{};
      for (int u = 0; u < DIM; ++u) {
        vf kz[NV];
        for (int v = 0; v < NV; ++v) kz[v] = load(kt + u * 16 + v * W);
        for (int i = 0; i < SR; ++i) {
          const vf qz = splat(qb[i * DIM + u]);
          for (int v = 0; v < NV; ++v) acc[i][v] += qz * kz[v];
        }
      }
      for (int i = 0; i < SR; ++i)
        for (int v = 0; v < NV; ++v) store(sb + i * KC + 16 * t + v * W, acc[i][v]);
    }
  }

  // o_r += p_r . V over the chunk's keys, for PR consecutive rows (outputs at ob, stride DIM; probabilities at
  // pb, stride KC), VW * W dims at a time.
  void values(Scratch& w, float* ob, const void* pb, int64_t tiles) const {
    const float* pf = static_cast<const float*>(pb);
    for (int d0 = 0; d0 < DIM; d0 += VW * W) {
      vf acc[PR][VW];
      for (int i = 0; i < PR; ++i)
        for (int c = 0; c < VW; ++c) acc[i][c] = load(ob + i * DIM + d0 + c * W);
      for (int64_t j = 0; j < 16 * tiles; ++j) {
        const float* vj = w.vrow[j] + d0;
        vf vz[VW];
        for (int c = 0; c < VW; ++c) vz[c] = load(vj + c * W);
        for (int i = 0; i < PR; ++i) {
          const vf pz = splat(pf[i * KC + j]);
          for (int c = 0; c < VW; ++c) acc[i][c] += pz * vz[c];
        }
      }
      for (int i = 0; i < PR; ++i)
        for (int c = 0; c < VW; ++c) store(ob + i * DIM + d0 + c * W, acc[i][c]);
    }
  }

  // Row r of the item: scale, cap, mask; the online softmax (keys [k0, k0 + 16 tiles), [a, b] visible).
  void softmax_row(Scratch& w, int64_t r, int64_t k0, int64_t tiles, int64_t a, int64_t b) const {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    float* s = w.s.data() + r * KC;
    const int64_t n = 16 * tiles;
    // Lane l of the vector at key k0 + i is visible where a - k0 <= i + l <= b - k0 (none when a > b).
    const vi lane = iota(), first = splat_i(int32_t(a - k0)), last = splat_i(int32_t(b - k0));
    auto visible = [&](int64_t i) {
      const vi key = lane + int32_t(i);
      return (key >= first) & (key <= last);
    };
    vf mx = splat(-kInf);
    for (int64_t i = 0; i < n; i += W) {
      vf x = load(s + i) * scale;
      if (softcap > 0)  // Gemma 2: cap * tanh(score / cap)
        for (int e = 0; e < W; ++e) x[e] = softcap * std::tanh(x[e] / softcap);
      store(s + i, x);
      mx = select(visible(i), vmax(mx, x), mx);
    }
    float m_new = w.m[r];
    for (int e = 0; e < W; ++e) m_new = std::max(m_new, mx[e]);
    vf sum{};
    const vf mv = splat(m_new);
    for (int64_t i = 0; i < n; i += W) {
      const vf e = select(visible(i), exp_nonpositive(load(s + i) - mv), vf{});
      sum += e;
      store(s + i, e);
    }
    if (m_new == -kInf) return;  // no key yet: nothing to rescale
    const float alpha = std::exp(w.m[r] - m_new);  // 0 on the first chunk with keys (m was -inf)
    float total = 0.f;
    for (int e = 0; e < W; ++e) total += sum[e];
    w.m[r] = m_new;
    w.l[r] = w.l[r] * alpha + total;
    if (alpha != 1.f) {
      float* o = w.o.data() + r * DIM;
      for (int d = 0; d < DIM; d += W) store(o + d, load(o + d) * alpha);
    }
  }

  // The output row o / l at dst (bf16: rounded to nearest even, as c10::BFloat16 does; NaN stays NaN).
  void store_row(T* dst, const float* o, float l) const {
    const float inv = 1.f / l;
    for (int d = 0; d < DIM; d += W) {
      const vf x = load(o + d) * inv;
      if constexpr (kBf16<T>) {
        const vu bits = (vu)x, keep = (vu)(x == x);
        const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        const vu half = (rounded & keep) | (0x7FC0u & ~keep);
        uint16_t h[W];
        for (int e = 0; e < W; ++e) h[e] = uint16_t(half[e]);
        std::memcpy(dst + d, h, sizeof(h));
      } else {
        store(reinterpret_cast<float*>(dst) + d, x);
      }
    }
  }
};

}  // namespace portable

// The driver: the work split, K packed ahead, each item's loop over key chunks; K (a path above) does the rest.
template <class K>
struct Prefill : K {
  using T = typename K::T;
  using Scratch = typename K::Scratch;
  static constexpr int DIM = K::DIM;
  using K::q;
  using K::out;
  using K::q_stride;
  using K::out_stride;
  using K::kv_heads;
  using K::group;
  using K::q_start;
  using K::q_len;
  using K::seq_len;
  using K::window;
  using K::num_chunks;
  using K::k_pack_bytes;
  using K::window_start;
  using K::zero_row;
  using K::U;
  using K::SR;
  using K::PR;

  // One item: chunk c, KV head h, query positions [p0, p1); kp: that chunk and head's packed K from key kbeg
  // (nullptr: pack it here).
  void run(Scratch& w, int64_t c, int64_t h, int64_t p0, int64_t p1, const uint32_t* kp, int64_t kbeg) const {
    const int64_t pos0 = seq_len[c] - q_len[c], rows = (p1 - p0) * group;
    // From a whole tile (K is packed in tiles from kbeg, a multiple of 16); keys below the window are masked.
    const int64_t lo = window_start(p0) / 16 * 16;
    const int64_t rows_pad = rows + std::max(SR, PR);  // dummy rows past the end keep the micro-kernels branch-free
    w.s.resize(rows_pad * KC);
    w.o.assign(rows_pad * DIM, 0.f);
    w.m.assign(rows, -std::numeric_limits<float>::infinity());
    w.l.assign(rows, 0.f);
    this->prepare(w, rows_pad);
    w.qb.resize(rows_pad * DIM);
    auto qrow = [&](int64_t r) {
      return q + (q_start[c] + p0 - pos0 + r / group) * q_stride + (h * group + r % group) * DIM;
    };
    for (int64_t r = 0; r < rows_pad; ++r)  // rows past the end: zeros (their scores are never read)
      this->load_query(w.qb.data() + r * DIM, r < rows ? qrow(r) : zero_row());
    for (int64_t k0 = lo; k0 < p1; k0 += KC) {
      const int64_t k1 = std::min(p1, k0 + KC), tiles = (k1 - k0 + 15) / 16;
      this->pack_v(w, c, h, k0, k1, tiles);
      const uint32_t* kt = kp + (k0 - kbeg) * U;  // (k0 - kbeg) / 16 tiles of U * 16
      if (kp == nullptr) {  // not packed ahead: this block's tiles now
        for (int64_t t = 0; t < tiles; ++t) this->pack_k(w.kp.data() + t * U * 16, c, h, k0 + 16 * t, k1);
        kt = w.kp.data();
      }
      for (int64_t r0 = 0; r0 < rows; r0 += SR)
        this->scores(kt, w.qb.data() + r0 * DIM, w.s.data() + r0 * KC, tiles);
      for (int64_t r = 0; r < rows; ++r) {  // scale, cap, mask; the online softmax
        const int64_t pos = p0 + r / group;
        const int64_t a = window > 0 ? std::max(k0, pos - window + 1) : k0, b = std::min(pos, k1 - 1);
        this->softmax_row(w, r, k0, tiles, a, b);
      }
      for (int64_t r0 = 0; r0 < rows; r0 += PR) this->values(w, w.o.data() + r0 * DIM, this->probs(w, r0), tiles);
    }
    for (int64_t r = 0; r < rows; ++r)
      this->store_row(out + (q_start[c] + p0 - pos0 + r / group) * out_stride + (h * group + r % group) * DIM,
                      w.o.data() + r * DIM, w.l[r]);
  }

  void operator()() const {
    // K of each (chunk, KV head), keys [kbeg[c], seq_len[c]) in tiles; kept between calls (per calling thread):
    // a fresh buffer of hundreds of KB costs page faults on every call.
    thread_local std::vector<uint32_t> kpack;
    std::vector<int64_t> kbeg(num_chunks);
    for (int64_t c = 0; c < num_chunks; ++c)
      kbeg[c] = window_start(seq_len[c] - q_len[c]) / 16 * 16;
    auto units = [&](int64_t c) { return kv_heads * ((seq_len[c] - kbeg[c] + 15) / 16) * 16 * U; };
    const int64_t budget = k_pack_bytes / 4;
    for (int64_t c0 = 0, c1; c0 < num_chunks; c0 = c1) {
      int64_t used = units(c0);
      const bool ahead = used <= budget;  // else this chunk alone, packed per item
      for (c1 = c0 + 1; ahead && c1 < num_chunks && used + units(c1) <= budget; ++c1) used += units(c1);
      if (!ahead) used = 0;
      if (kpack.size() < size_t(used)) kpack.resize(used);
      run_chunks(c0, c1, ahead ? kpack.data() : nullptr, kbeg);
    }
  }

  // Chunks [c0, c1): K packed ahead into kpk (nullptr: per item), then the items.
  void run_chunks(int64_t c0, int64_t c1, uint32_t* kpk, const std::vector<int64_t>& kbeg) const {
    struct Item {
      int64_t cost, c, h, p0, p1;
    };
    std::vector<Item> items;
    const int64_t qp = 16 * std::max<int64_t>(1, (48 + 16 * group - 1) / (16 * group));  // >= 48 rows an item
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t pos0 = seq_len[c] - q_len[c];
      for (int64_t p0 = pos0; p0 < seq_len[c]; p0 += qp) {
        const int64_t p1 = std::min<int64_t>(seq_len[c], p0 + qp);
        const int64_t keys = p1 - window_start(p0);
        for (int64_t h = 0; h < kv_heads; ++h) items.push_back({keys * (p1 - p0), c, h, p0, p1});
      }
    }
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

    std::vector<int64_t> koff((c1 - c0) * kv_heads);  // each (chunk, KV head)'s offset in kpk
    struct Tile {
      int64_t c, h, k0;
    };
    std::vector<Tile> tiles;
    if (kpk != nullptr)
      for (int64_t c = c0, off = 0; c < c1; ++c)
        for (int64_t h = 0; h < kv_heads; ++h) {
          koff[(c - c0) * kv_heads + h] = off;
          for (int64_t k0 = kbeg[c]; k0 < seq_len[c]; k0 += 16, off += 16 * U) tiles.push_back({c, h, k0});
        }
    at::parallel_for(0, int64_t(tiles.size()), 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const Tile& t = tiles[i];
        this->pack_k(kpk + koff[(t.c - c0) * kv_heads + t.h] + (t.k0 - kbeg[t.c]) * U, t.c, t.h, t.k0, seq_len[t.c]);
      }
    });

    std::atomic<int64_t> next{0};
    const int64_t n = int64_t(items.size());
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t begin, int64_t end) {
      Scratch w;
      this->init(w, kpk == nullptr);
      for (int64_t t = begin; t < end; ++t)
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
          const Item& it = items[i];
          const uint32_t* kp = kpk == nullptr ? nullptr : kpk + koff[(it.c - c0) * kv_heads + it.h];
          run(w, it.c, it.h, it.p0, it.p1, kp, kbeg[it.c]);
        }
    });
  }
};

// The path each dtype takes in this build.
#ifdef TANDEM_PREFILL_AVX512
template <int DIM>
using Fp32Kernel = Avx512<DIM, float>;
#else
template <int DIM>
using Fp32Kernel = portable::Kernel<DIM, float>;
#endif
#if defined(TANDEM_PREFILL_AVX512) && defined(__AVX512BF16__)
#define TANDEM_PREFILL_BF16_PROBS 1
template <int DIM>
using Bf16Kernel = Avx512<DIM, at::BFloat16>;
#else  // widened to fp32 (in an AVX-512 build without AVX512-BF16 too)
template <int DIM>
using Bf16Kernel = portable::Kernel<DIM, at::BFloat16>;
#endif
// fp32 queries over a bf16 cache: the fp32 kernel of either path on K/V widened as they are packed.
#ifdef TANDEM_PREFILL_AVX512
template <int DIM>
using WidenKernel = Avx512<DIM, float, at::BFloat16>;
#else
template <int DIM>
using WidenKernel = portable::Kernel<DIM, float, at::BFloat16>;
#endif

}  // namespace

// Writes the prefill rows of `out` [T, H, D] (the step's decode rows are left alone). q [T, H, D] (rows may be
// strided: a view of the fused QKV projection); caches [num_blocks, block_size, Hkv, D] in q's dtype, or bf16
// under fp32 q; per chunk c:
// block_tables[c] (int32), its query rows [q_start[c], q_start[c] + q_len[c]) at positions
// [seq_len[c] - q_len[c], seq_len[c]) (its K/V already stored); window 0 = full context; softcap 0 = off.
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& q_start, const at::Tensor& q_len,
                   const at::Tensor& seq_len, double scale, int64_t window, double softcap, at::Tensor& out,
                   int64_t k_pack_bytes) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && out.sizes() == q.sizes(),
              "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "q and out rows must be [H, D] contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const bool widen = q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;  // fp32 q, bf16 cache
  TORCH_CHECK((q.scalar_type() == k_cache.scalar_type() || widen) && v_cache.scalar_type() == k_cache.scalar_type() &&
              q.scalar_type() == out.scalar_type(), "dtype mismatch: the cache must be in q's dtype, or bf16 under "
              "fp32 q; out in q's");
  for (const at::Tensor* t : {&block_tables, &q_start, &q_len, &seq_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "tables must be contiguous int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head layout mismatch");
  auto run = [&](auto tag) {
    using P = decltype(tag);
    P p{};
    using T = std::remove_const_t<std::remove_pointer_t<decltype(p.q)>>;
    using C = std::remove_const_t<std::remove_pointer_t<decltype(p.kc)>>;
    p.q = q.data_ptr<T>();
    p.kc = k_cache.data_ptr<C>();
    p.vc = v_cache.data_ptr<C>();
    p.out = out.data_ptr<T>();
    p.q_stride = q.stride(0);
    p.out_stride = out.stride(0);
    p.heads = q.size(1);
    p.kv_heads = k_cache.size(2);
    p.group = p.heads / p.kv_heads;
    p.block_size = k_cache.size(1);
    p.row_stride = p.kv_heads * q.size(2);
    p.table_width = block_tables.size(1);
    p.tables = block_tables.data_ptr<int32_t>();
    p.q_start = q_start.data_ptr<int32_t>();
    p.q_len = q_len.data_ptr<int32_t>();
    p.seq_len = seq_len.data_ptr<int32_t>();
    p.scale = float(scale);
    p.softcap = float(softcap);
    p.window = window;
    p.num_chunks = q_start.size(0);
    p.k_pack_bytes = k_pack_bytes;
    p();
  };
  const int64_t dim = q.size(2);
  TORCH_CHECK(dim == 64 || dim == 128 || dim == 256, "paged_prefill supports head sizes 64, 128 and 256, got ",
              dim);
  if (widen) {
    if (dim == 64) run(Prefill<WidenKernel<64>>{});
    else if (dim == 128) run(Prefill<WidenKernel<128>>{});
    else run(Prefill<WidenKernel<256>>{});
  } else if (q.scalar_type() == at::kFloat) {
    if (dim == 64) run(Prefill<Fp32Kernel<64>>{});
    else if (dim == 128) run(Prefill<Fp32Kernel<128>>{});
    else run(Prefill<Fp32Kernel<256>>{});
  } else if (q.scalar_type() == at::kBFloat16) {
    if (dim == 64) run(Prefill<Bf16Kernel<64>>{});
    else if (dim == 128) run(Prefill<Bf16Kernel<128>>{});
    else run(Prefill<Bf16Kernel<256>>{});
  } else {
    TORCH_CHECK(false, "paged_prefill supports float32 and bfloat16, got ", q.scalar_type());
  }
}

#ifdef TANDEM_PREFILL_BF16_PROBS
const tandem_ops::PrefillOps tandem_ops::kPrefill{&paged_prefill, true};
#else
const tandem_ops::PrefillOps tandem_ops::kPrefill{&paged_prefill, false};
#endif
