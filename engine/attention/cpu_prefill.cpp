// Paged prefill attention for the CPU engine: every multi-token chunk of a step in one call, K/V read straight
// from the paged cache, flash-style (keys in chunks of KC with an online softmax), causal tiles skipped.
//
// Why by hand: torch's CPU flash attention (SDPA) runs at 40-67 GFLOP/s on SmolLM2's prefill shapes (9 heads,
// 3 KV heads, 64 dims, 125-300 tokens) on a 2-core AMD EPYC with AVX512-BF16, about a fifth of what the cores
// do in bf16, and needs each chunk's K/V gathered out of the cache first: 29% of a bf16 prefill there. vLLM's
// CPU build has its own prefill kernel too. Here both products are register-blocked micro-kernels over a tile
// of query rows: scores as 16 keys per vector (K transposed in 16-key tiles, so a query value is one broadcast),
// values as 16 dims per vector; bf16 by VDPBF16PS on pairs (bf16 probabilities, as torch's flash kernel and the
// decode kernel use), fp32 by FMA. Accumulation is fp32 for both. Each micro-kernel reads its rows from one base
// pointer at fixed strides (the item's queries copied together first), so the compiler keeps the addresses in
// displacements instead of spilling a pointer per row.
//
// Work items are (chunk, KV head, tile of query positions), the G = H / Hkv query heads of the KV head
// together (each K/V row packed once for all of them), handed out heaviest first from a shared counter
// (causal tiles late in a sequence cost several times the early ones). K is transposed once per (chunk, KV
// head) before the items run, not once per item: an item reads every key up to its last position, so per-item
// packing repeated a sequence's early keys in each of its items (12-15% of the kernel's time at 118-1024
// tokens). Chunks are packed in groups of at most k_pack_bytes; a chunk whose K alone is larger is packed per
// item, KC keys at a time, as before.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TANDEM_PREFILL 1
namespace {

// A zero K/V/query row (bit pattern 0 is 0.0 in fp32 and bf16), as long as the longest: 128 dims of fp32.
alignas(64) const uint32_t kZeroRow[128] = {};

constexpr int64_t KC = 256;  // keys per chunk: the online softmax rescales the outputs once per chunk
constexpr int SR = 8;        // query rows per score micro-kernel (8 accumulators + the K vector)

// The lanes i of 16 whose key base + i lies in [lo, hi].
inline __mmask16 lane_range(int64_t base, int64_t lo, int64_t hi) {
  const int64_t a = std::max<int64_t>(lo - base, 0), b = std::min<int64_t>(hi - base, 15);
  return a > b ? __mmask16(0) : __mmask16(((1u << (b - a + 1)) - 1) << a);
}

template <typename T>
constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;

template <int DIM, typename T>
struct Prefill {
  static constexpr int U = DIM * int(sizeof(T)) / 4;  // 32-bit units per row: bf16 pairs, or floats
  static constexpr int PR = 256 / DIM;                // query rows per value micro-kernel (16 accumulators)

  const T* q;
  const T* kc;
  const T* vc;
  T* out;
  int64_t q_stride, out_stride, heads, kv_heads, group, block_size, row_stride, table_width;
  const int32_t *tables, *q_start, *q_len, *seq_len;
  float scale, softcap;
  int64_t window;

  // Per-thread buffers.
  struct Scratch {
    std::vector<uint32_t> kp;  // [KC / 16][U][16]: per-item packed K (chunks too large to pack ahead)
    std::vector<uint32_t> vp;  // bf16: [KC / 2][DIM] rows 2i, 2i + 1 interleaved (unpack order); fp32: unused
    std::vector<const T*> vrow;  // fp32: each key's V row (padding keys: a zero row)
    std::vector<float> s, o, m, l;  // scores / probabilities [rows][KC], outputs [rows][DIM], max, sum
    std::vector<at::BFloat16> p;    // bf16 probabilities [rows][KC]
    std::vector<T> qb;              // the item's query rows, contiguous [rows_pad][DIM]
  };

  const T* zero_row() const { return reinterpret_cast<const T*>(kZeroRow); }

  // The first key a query at position `pos` sees: 0, or the start of its sliding window.
  int64_t window_start(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }

  const T* cache_row(const T* cache, int64_t c, int64_t key, int64_t h) const {
    const int64_t block = tables[c * table_width + key / block_size];
    return cache + (block * block_size + key % block_size) * row_stride + h * DIM;
  }

  // One 16-key tile of KV head h's K, keys [k0, k0 + 16) (those from k1 on zeros), transposed for the score
  // micro-kernel: dst[u][j] = unit u (a float, or a bf16 pair) of key k0 + j.
  void pack_k(uint32_t* dst, int64_t c, int64_t h, int64_t k0, int64_t k1) const {
    for (int64_t j = 0; j < 16; ++j) {
      const uint32_t* src = k0 + j < k1 ? reinterpret_cast<const uint32_t*>(cache_row(kc, c, k0 + j, h)) : kZeroRow;
      for (int u = 0; u < U; ++u) dst[u * 16 + j] = src[u];
    }
  }

  // Keys [k0, k0 + 16 * tiles) of KV head h's V for the value micro-kernel; keys from k1 on are zeros.
  void pack_v(Scratch& w, int64_t c, int64_t h, int64_t k0, int64_t k1, int64_t tiles) const {
    for (int64_t j = 0; j < 16 * tiles; ++j) {
      const T* v = k0 + j < k1 ? cache_row(vc, c, k0 + j, h) : zero_row();
      if constexpr (kBf16<T>) {
        if (j % 2) {  // rows j - 1 and j, 16 bits at a time within each 128-bit lane
          const T* prev = w.vrow[j - 1];
          for (int ch = 0; ch < DIM / 32; ++ch) {
            const __m512i a = _mm512_loadu_si512(prev + 32 * ch), b = _mm512_loadu_si512(v + 32 * ch);
            uint32_t* d = w.vp.data() + (j / 2) * DIM + 32 * ch;
            _mm512_storeu_si512(d, _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512(d + 16, _mm512_unpackhi_epi16(a, b));
          }
        }
      }
      w.vrow[j] = v;
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
  // pb, stride KC).
  void values(Scratch& w, float* ob, const void* pb, int64_t tiles) const {
    __m512 acc[PR][DIM / 16];
    for (int i = 0; i < PR; ++i)
      for (int c = 0; c < DIM / 16; ++c) acc[i][c] = _mm512_loadu_ps(ob + i * DIM + 16 * c);
#ifdef __AVX512BF16__
    if constexpr (kBf16<T>) {
      const uint32_t* p32 = static_cast<const uint32_t*>(pb);  // bf16 pairs, KC / 2 per row
      for (int64_t jp = 0; jp < 8 * tiles; ++jp) {
        const uint32_t* vj = w.vp.data() + jp * DIM;
        __m512i vz[DIM / 16];
        for (int c = 0; c < DIM / 16; ++c) vz[c] = _mm512_loadu_si512(vj + 16 * c);
        for (int i = 0; i < PR; ++i) {
          const __m512bh pz = (__m512bh)_mm512_set1_epi32(int32_t(p32[i * (KC / 2) + jp]));
          for (int c = 0; c < DIM / 16; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pz, (__m512bh)vz[c]);
        }
      }
    } else
#endif
    {
      const float* pf = static_cast<const float*>(pb);
      for (int64_t j = 0; j < 16 * tiles; ++j) {
        const float* vj = reinterpret_cast<const float*>(w.vrow[j]);
        __m512 vz[DIM / 16];
        for (int c = 0; c < DIM / 16; ++c) vz[c] = _mm512_loadu_ps(vj + 16 * c);
        for (int i = 0; i < PR; ++i) {
          const __m512 pz = _mm512_set1_ps(pf[i * KC + j]);
          for (int c = 0; c < DIM / 16; ++c) acc[i][c] = _mm512_fmadd_ps(pz, vz[c], acc[i][c]);
        }
      }
    }
    for (int i = 0; i < PR; ++i)
      for (int c = 0; c < DIM / 16; ++c) _mm512_storeu_ps(ob + i * DIM + 16 * c, acc[i][c]);
  }

  // One item: chunk c, KV head h, query positions [p0, p1); kp: that chunk and head's packed K from key kbeg
  // (nullptr: pack it here).
  void run(Scratch& w, int64_t c, int64_t h, int64_t p0, int64_t p1, const uint32_t* kp, int64_t kbeg) const {
    const int64_t pos0 = seq_len[c] - q_len[c], rows = (p1 - p0) * group;
    // From a whole tile (K is packed in tiles from kbeg, a multiple of 16); keys below the window are masked.
    const int64_t lo = window_start(p0) / 16 * 16;
    const int64_t rows_pad = rows + SR;  // dummy rows past the end keep the micro-kernels branch-free
    w.s.resize(rows_pad * KC);
    w.o.assign(rows_pad * DIM, 0.f);
    w.m.assign(rows, -std::numeric_limits<float>::infinity());
    w.l.assign(rows, 0.f);
    if constexpr (kBf16<T>) w.p.resize(rows_pad * KC);
    w.qb.resize(rows_pad * DIM);
    auto qrow = [&](int64_t r) {
      return q + (q_start[c] + p0 - pos0 + r / group) * q_stride + (h * group + r % group) * DIM;
    };
    auto prow = [&](int64_t r) -> const void* {
      if constexpr (kBf16<T>) return w.p.data() + r * KC;
      else return w.s.data() + r * KC;
    };
    for (int64_t r = 0; r < rows_pad; ++r)  // rows past the end: zeros (their scores are never read)
      std::memcpy(w.qb.data() + r * DIM, r < rows ? qrow(r) : zero_row(), DIM * sizeof(T));
    for (int64_t k0 = lo; k0 < p1; k0 += KC) {
      const int64_t k1 = std::min(p1, k0 + KC), tiles = (k1 - k0 + 15) / 16;
      pack_v(w, c, h, k0, k1, tiles);
      const uint32_t* kt = kp + (k0 - kbeg) * U;  // (k0 - kbeg) / 16 tiles of U * 16
      if (kp == nullptr) {  // not packed ahead: this block's tiles now
        for (int64_t t = 0; t < tiles; ++t) pack_k(w.kp.data() + t * U * 16, c, h, k0 + 16 * t, k1);
        kt = w.kp.data();
      }
      for (int64_t r0 = 0; r0 < rows; r0 += SR) scores(kt, w.qb.data() + r0 * DIM, w.s.data() + r0 * KC, tiles);
      for (int64_t r = 0; r < rows; ++r) {  // scale, cap, mask; the online softmax
        const int64_t pos = p0 + r / group;
        const int64_t a = window > 0 ? std::max(k0, pos - window + 1) : k0, b = std::min(pos, k1 - 1);
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
        if (m_new == -std::numeric_limits<float>::infinity()) continue;  // no key yet: nothing to rescale
        const float alpha = std::exp(w.m[r] - m_new);  // 0 on the first chunk with keys (m was -inf)
        w.m[r] = m_new;
        w.l[r] = w.l[r] * alpha + _mm512_reduce_add_ps(sum);
        if (alpha != 1.f)
          for (int64_t d = 0; d < DIM; d += 16)
            _mm512_storeu_ps(w.o.data() + r * DIM + d, _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * DIM + d),
                                                                     _mm512_set1_ps(alpha)));
      }
      for (int64_t r0 = 0; r0 < rows; r0 += PR) values(w, w.o.data() + r0 * DIM, prow(r0), tiles);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
      const float* o = w.o.data() + r * DIM;
      T* dst = out + (q_start[c] + p0 - pos0 + r / group) * out_stride + (h * group + r % group) * DIM;
      for (int d = 0; d < DIM; d += 32) {
        __m512 x0 = _mm512_loadu_ps(o + d), x1 = _mm512_loadu_ps(o + d + 16);
        if constexpr (kBf16<T>) {  // the bf16 sums are in unpack order (cpu_simd.h)
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
        pack_k(kpk + koff[(t.c - c0) * kv_heads + t.h] + (t.k0 - kbeg[t.c]) * U, t.c, t.h, t.k0, seq_len[t.c]);
      }
    });

    std::atomic<int64_t> next{0};
    const int64_t n = int64_t(items.size());
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t begin, int64_t end) {
      Scratch w;
      w.kp.resize(kpk == nullptr ? KC * U : 0);
      w.vp.resize(kBf16<T> ? KC / 2 * DIM : 0);
      w.vrow.resize(KC);
      for (int64_t t = begin; t < end; ++t)
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
          const Item& it = items[i];
          const uint32_t* kp = kpk == nullptr ? nullptr : kpk + koff[(it.c - c0) * kv_heads + it.h];
          run(w, it.c, it.h, it.p0, it.p1, kp, kbeg[it.c]);
        }
    });
  }

  int64_t num_chunks, k_pack_bytes;
};

}  // namespace

// Writes the prefill rows of `out` [T, H, D] (the step's decode rows are left alone). q [T, H, D] (rows may be
// strided: a view of the fused QKV projection); caches [num_blocks, block_size, Hkv, D]; per chunk c:
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
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
              q.scalar_type() == out.scalar_type(), "dtype mismatch");
  for (const at::Tensor* t : {&block_tables, &q_start, &q_len, &seq_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "tables must be contiguous int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head layout mismatch");
  auto run = [&](auto tag) {
    using P = decltype(tag);
    P p{};
    using T = std::remove_const_t<std::remove_pointer_t<decltype(p.q)>>;
    p.q = q.data_ptr<T>();
    p.kc = k_cache.data_ptr<T>();
    p.vc = v_cache.data_ptr<T>();
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
  TORCH_CHECK(dim == 64 || dim == 128, "paged_prefill supports head sizes 64 and 128, got ", dim);
  if (q.scalar_type() == at::kFloat) {
    if (dim == 64) run(Prefill<64, float>{});
    else run(Prefill<128, float>{});
#ifdef __AVX512BF16__
  } else if (q.scalar_type() == at::kBFloat16) {
    if (dim == 64) run(Prefill<64, at::BFloat16>{});
    else run(Prefill<128, at::BFloat16>{});
#endif
  } else {
    TORCH_CHECK(false, "paged_prefill does not support ", q.scalar_type(), " on this CPU (see prefill_dtypes)");
  }
}
#endif

void register_prefill(pybind11::module& m) {
#ifdef TANDEM_PREFILL
  m.def("paged_prefill", &paged_prefill, "paged prefill attention (CPU)", pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"), pybind11::arg("q_start"),
        pybind11::arg("q_len"), pybind11::arg("seq_len"), pybind11::arg("scale"), pybind11::arg("window"),
        pybind11::arg("softcap"), pybind11::arg("out"), pybind11::arg("k_pack_bytes") = int64_t(8) << 20,
        pybind11::call_guard<pybind11::gil_scoped_release>());  // as paged_decode (cpu_decode.cpp)
#endif
#if defined(TANDEM_PREFILL) && defined(__AVX512BF16__)
  m.attr("prefill_dtypes") = pybind11::make_tuple("float32", "bfloat16");
#elif defined(TANDEM_PREFILL)
  m.attr("prefill_dtypes") = pybind11::make_tuple("float32");
#else
  m.attr("prefill_dtypes") = pybind11::make_tuple();
#endif
}
