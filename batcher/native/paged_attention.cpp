// Paged attention on CPU: reads K/V in place through the block tables, causal by absolute position;
// decode and prefill rows in one call, math in float32. A decode row reads cache rows directly (exact
// softmax over all its keys); prefill rows go 16 at a time over 16-key tiles copied to a per-thread
// buffer (online softmax), so K/V are read once for 16 rows x G heads. Contract: batcher/attention/op.py. Registered as torch.ops.iterserve_cpu.paged_attention;
// only the ATen headers it needs are included (torch/extension.h triples the build time).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cmath>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int KT = 16;      // keys per tile (one AVX-512 register of scores)
constexpr int MAX_D = 256;  // largest head dim
constexpr int MAX_Q = 48;   // query vectors (rows x heads of one KV group) per work item

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// exp for x <= 0 (scores minus their running max), vectorisable: 2^(x*log2e) by range reduction and a
// degree-6 polynomial; relative error ~2e-7, like expf's.
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  float t = x * 1.44269504088896341f;
  float fi = std::nearbyint(t);
  float f = t - fi;  // [-0.5, 0.5]
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(fi) << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

// A cache row as floats: float rows are read in place, others converted into `buf`.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < n; ++d) buf[d] = to_float(row[d]);
    return buf;
  }
}

// Dot product of two float rows. gcc reduces an `omp simd` dot lane by lane in order (16 dependent adds
// per call); a register accumulator and one tree reduction is ~4x faster for decode.
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float sum = 0.f;
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// One query row (a decode step): G query vectors against every cached key of one KV head. Scores are
// dot products straight from the cache rows (no tile copy), then an exact softmax over all of them.
template <typename scalar_t>
void attend_row(int64_t row, int64_t kv_head, int64_t n_keys, const scalar_t* q_ptr, const scalar_t* kc,
                const scalar_t* vc, scalar_t* out, const int32_t* table, int64_t H, int64_t Hkv,
                int64_t D, int64_t block_size, float scale, std::vector<float>& scores) {
  const int64_t G = H / Hkv;
  alignas(64) float q[MAX_Q][MAX_D];
  alignas(64) float acc[MAX_Q][MAX_D];
  for (int64_t g = 0; g < G; ++g) {
    const scalar_t* src = q_ptr + (row * H + kv_head * G + g) * D;
    for (int64_t d = 0; d < D; ++d) q[g][d] = to_float(src[d]) * scale;
    for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  scores.resize(G * n_keys);
  alignas(64) float buf[MAX_D];
  const int64_t row_stride = Hkv * D;
  for (int64_t p = 0; p < n_keys; ++p) {
    const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
    const scalar_t* ks = kc + slot * row_stride + kv_head * D;
    const float* k = as_float(ks, buf, D);
    for (int64_t g = 0; g < G; ++g) scores[g * n_keys + p] = dot(q[g], k, D);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * n_keys;
    float mx = -INFINITY;
    for (int64_t p = 0; p < n_keys; ++p) mx = sg[p] > mx ? sg[p] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < n_keys; ++p) {
      sg[p] = exp_neg(sg[p] - mx);
      sum += sg[p];
    }
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < n_keys; ++p) sg[p] *= inv;
  }
  for (int64_t p = 0; p < n_keys; ++p) {
    const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
    const scalar_t* vs = vc + slot * row_stride + kv_head * D;
    const float* v = as_float(vs, buf, D);
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * n_keys + p];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[g][d] += w * v[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    scalar_t* dst = out + (row * H + kv_head * G + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[g][d]);
  }
}

struct Item {  // `rows` packed query rows from `row0` of sequence `seq`, against KV head `kv_head`
  int64_t seq, row0, rows, kv_head;
};

template <typename scalar_t>
void attend(const Item& it, int64_t seq_row0, const scalar_t* q_ptr, const scalar_t* kc, const scalar_t* vc,
            scalar_t* out, const int32_t* table, int64_t table_width, int64_t ctx, int64_t q_len,
            int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale) {
  const int64_t G = H / Hkv;
  const int64_t NQ = it.rows * G;  // query vectors, row-major then head
  alignas(64) float q[MAX_Q][MAX_D];
  alignas(64) float acc[MAX_Q][MAX_D];
  alignas(64) float kt[MAX_D][KT];  // K tile transposed: scores vectorise over keys
  alignas(64) float vt[KT][MAX_D];
  alignas(64) float s[MAX_Q][KT];
  float m[MAX_Q], l[MAX_Q];
  int64_t pos[MAX_Q];
  const int64_t first_pos = ctx - q_len;
  for (int64_t r = 0; r < it.rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g;
      const scalar_t* src = q_ptr + ((it.row0 + r) * H + it.kv_head * G + g) * D;
      for (int64_t d = 0; d < D; ++d) q[i][d] = to_float(src[d]) * scale;
      for (int64_t d = 0; d < D; ++d) acc[i][d] = 0.f;
      m[i] = -INFINITY;
      l[i] = 0.f;
      pos[i] = first_pos + (it.row0 - seq_row0) + r;
    }
  }
  const int64_t n_keys = pos[NQ - 1] + 1;  // the last row sees the most
  const int64_t row_stride = Hkv * D;
  for (int64_t j0 = 0; j0 < n_keys; j0 += KT) {
    const int64_t nk = std::min<int64_t>(KT, n_keys - j0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t p = j0 + j;
      const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
      const scalar_t* ks = kc + slot * row_stride + it.kv_head * D;
      const scalar_t* vs = vc + slot * row_stride + it.kv_head * D;
      for (int64_t d = 0; d < D; ++d) kt[d][j] = to_float(ks[d]);
      for (int64_t d = 0; d < D; ++d) vt[j][d] = to_float(vs[d]);
    }
    for (int64_t j = nk; j < KT; ++j) {
      for (int64_t d = 0; d < D; ++d) kt[d][j] = 0.f;
      for (int64_t d = 0; d < D; ++d) vt[j][d] = 0.f;
    }
    // Scores: query vectors innermost, so consecutive FMAs are independent (no latency chain).
    for (int64_t i = 0; i < NQ; ++i)
      for (int j = 0; j < KT; ++j) s[i][j] = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float* kd = kt[d];
      for (int64_t i = 0; i < NQ; ++i) {
        const float qd = q[i][d];
#pragma omp simd
        for (int j = 0; j < KT; ++j) s[i][j] += qd * kd[j];
      }
    }
    // Online softmax; keys past a row's position (and past the tile's end) weigh zero.
    for (int64_t i = 0; i < NQ; ++i) {
      const int64_t visible = std::max<int64_t>(0, std::min<int64_t>(nk, pos[i] - j0 + 1));
      float mx = m[i];
      for (int j = 0; j < visible; ++j) mx = s[i][j] > mx ? s[i][j] : mx;
      // Every row sees key 0, so m[i] is finite after the first tile; exp_neg clamps the -inf start.
      const float alpha = visible ? exp_neg(m[i] - mx) : 1.f;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < KT; ++j) {
        const float e = j < visible ? exp_neg(s[i][j] - mx) : 0.f;
        s[i][j] = e;
        sum += e;
      }
      l[i] = l[i] * alpha + sum;
      m[i] = mx;
      if (alpha != 1.f) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[i][d] *= alpha;
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      const float* vj = vt[j];
      for (int64_t i = 0; i < NQ; ++i) {
        const float pj = s[i][j];
        float* a = acc[i];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += pj * vj[d];
      }
    }
  }
  for (int64_t r = 0; r < it.rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g;
      scalar_t* dst = out + ((it.row0 + r) * H + it.kv_head * G + g) * D;
      const float inv = 1.f / l[i];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[i][d] * inv);
    }
  }
}

}  // namespace

at::Tensor paged_attention_cpu(at::Tensor query, at::Tensor key, at::Tensor value,
                                  at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                                  at::Tensor query_start, at::Tensor context_lens,
                                  at::Tensor block_tables, int64_t block_size, double scale) {
  query = query.contiguous();
  key = key.to(k_cache.scalar_type()).contiguous();
  value = value.to(v_cache.scalar_type()).contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes differ");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  auto qs_t = query_start.to(at::kInt).contiguous();
  auto ctx_t = context_lens.to(at::kInt).contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), Hkv = key.size(1);
  TORCH_CHECK(H % Hkv == 0 && D <= MAX_D && H / Hkv <= MAX_Q, "unsupported head geometry");
  const int64_t B = ctx_t.size(0), width = tables.size(1);
  const int32_t* qs = qs_t.data_ptr<int32_t>();
  const int32_t* ctx = ctx_t.data_ptr<int32_t>();
  const int64_t G = H / Hkv;
  const int64_t rows_per_item = std::max<int64_t>(1, MAX_Q / G);
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = qs[b]; r < qs[b + 1]; r += rows_per_item)
      for (int64_t h = 0; h < Hkv; ++h)
        items.push_back({b, r, std::min<int64_t>(rows_per_item, qs[b + 1] - r), h});
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_cpu", [&] {
    const int64_t row = Hkv * D;
    const scalar_t* kin = key.data_ptr<scalar_t>();
    const scalar_t* vin = value.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(kc + sl[t] * row, kin + t * row, row * sizeof(scalar_t));
      std::memcpy(vc + sl[t] * row, vin + t * row, row * sizeof(scalar_t));
    }
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t used = qs[B];
    if (used < T) std::memset(o + used * H * D, 0, (T - used) * H * D * sizeof(scalar_t));
    const scalar_t* qp = query.data_ptr<scalar_t>();
    const int32_t* tb = tables.data_ptr<int32_t>();
    const float sc = static_cast<float>(scale);
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t n = begin; n < end; ++n) {
        const Item& it = items[n];
        const int64_t q_len = qs[it.seq + 1] - qs[it.seq];
        if (it.rows == 1) {  // decode rows, and the last row of a ragged prefill tile
          const int64_t n_keys = ctx[it.seq] - q_len + (it.row0 - qs[it.seq]) + 1;
          attend_row<scalar_t>(it.row0, it.kv_head, n_keys, qp, kc, vc, o, tb + it.seq * width, H, Hkv,
                               D, block_size, sc, scores);
          continue;
        }
        attend<scalar_t>(it, qs[it.seq], qp, kc, vc, o, tb + it.seq * width, width,
                              ctx[it.seq], q_len, H, Hkv, D, block_size, sc);
      }
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor query_start, Tensor context_lens, Tensor block_tables, int block_size, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention_cpu);
}
