// Linear layers for decode-sized batches on CPUs with AVX512_BF16: y = x @ W^T (+ bias), x bf16, W in
// nn.Linear's own (out, in) layout as bf16 or as int8 with one scale per output row (weight-only:
// converted exactly to bf16 in registers), fp32 accumulation, one rounding to bf16 per output. A
// decode step reads every weight once and does little with it, so it is memory-bound: oneDNN's bf16
// GEMM at 1-8 rows reads ~11 GB/s here, this ~25 GB/s, and int8 halves the bytes.
// Each thread reads its share of W's rows front to back (prefetch-friendly), every row once for all
// x rows (held in L1 while every chunk of 8 x rows uses it). Anything else (more rows, other dtypes,
// in_features not a multiple of 32, a CPU without AVX512_BF16) goes to at::linear.
// Registered as torch.ops.iterserve_cpu.linear and .linear_int8 (batcher/cpu_linear.py, batcher/quantization.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <optional>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

// Rows up to which the kernel beats at::linear (measured, docs/forward.md): bf16 weights against
// oneDNN's GEMM; int8 ones against that GEMM on the weights converted per call.
constexpr int64_t MAX_ROWS_BF16 = 16;
constexpr int64_t MAX_ROWS_INT8 = 32;
constexpr int CHUNK = 8;          // x rows per pass over a weight row (accumulators in registers)

#ifdef __AVX512BF16__
// 32 weights as bf16: read as they are, or int8 converted exactly (every int8 value is a bf16 value).
inline __m512bh load_w(const c10::BFloat16* w) { return (__m512bh)_mm512_loadu_si512(w); }
inline __m512bh load_w(const int8_t* w) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Rows n0..n1 of W against M (<= CHUNK) rows of x; K % 32 == 0. y = (x . w_n) * scale_n + bias_n.
template <int M, typename weight_t>
void rows_kernel(const c10::BFloat16* x, const weight_t* w, const c10::BFloat16* scale, const c10::BFloat16* bias,
                 c10::BFloat16* y, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const weight_t* wr = w + n * K;
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {  // two independent chains per row hide the dot's latency
      const __m512bh w0 = load_w(wr + k), w1 = load_w(wr + k + 32);
      for (int m = 0; m < M; ++m) {
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
      }
    }
    if (k < K) {
      const __m512bh w0 = load_w(wr + k);
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    }
    const float sc = scale ? static_cast<float>(scale[n]) : 1.f;
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < M; ++m)
      y[m * N + n] = c10::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) * sc + b);
  }
}

template <typename weight_t>
using RowsFn = void (*)(const c10::BFloat16*, const weight_t*, const c10::BFloat16*, const c10::BFloat16*,
                        c10::BFloat16*, int64_t, int64_t, int64_t, int64_t);
template <typename weight_t>
constexpr RowsFn<weight_t> ROWS_FOR[CHUNK + 1] = {
    nullptr, rows_kernel<1, weight_t>, rows_kernel<2, weight_t>, rows_kernel<3, weight_t>, rows_kernel<4, weight_t>,
    rows_kernel<5, weight_t>, rows_kernel<6, weight_t>, rows_kernel<7, weight_t>, rows_kernel<8, weight_t>};

// y (M, N) for x (M, K): each thread takes a contiguous share of W's rows; a row is read from memory
// once for every chunk of x rows (it stays in L1 between chunks).
template <typename weight_t>
at::Tensor run(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& scale,
               const std::optional<at::Tensor>& bias) {
  const int64_t K = w.size(1), N = w.size(0), M = x_in.numel() / K;
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> sizes = x_in.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x_in.options());
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  const auto* wp = w.const_data_ptr<weight_t>();
  const c10::BFloat16* sp = scale ? scale->const_data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* bp = bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.mutable_data_ptr<c10::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 16) {
      const int64_t n_end = std::min(n + 16, n1);
      for (int64_t m = 0; m < M; m += CHUNK)
        ROWS_FOR<weight_t>[std::min<int64_t>(CHUNK, M - m)](xp + m * K, wp, sp, bp, yp + m * N, n, n_end, K, N);
    }
  });
  return y;
}
#endif

bool is_bf16_vector(const std::optional<at::Tensor>& t, int64_t n) {
  return !t || (t->scalar_type() == at::kBFloat16 && t->dim() == 1 && t->size(0) == n && t->is_contiguous());
}

// Whether the kernel takes this product (else the caller's fallback runs).
bool uses_kernel(const at::Tensor& x, const at::Tensor& w, at::ScalarType w_type, int64_t max_rows,
                 const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& bias) {
#ifdef __AVX512BF16__
  if (w.dim() != 2 || x.dim() < 1) return false;
  const int64_t K = w.size(1);
  return x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && w.scalar_type() == w_type &&
         w.is_contiguous() && K % 32 == 0 && x.size(-1) == K && x.numel() > 0 && x.numel() / K <= max_rows &&
         is_bf16_vector(scale, w.size(0)) && is_bf16_vector(bias, w.size(0));
#else
  return false;
#endif
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
#ifdef __AVX512BF16__
  if (uses_kernel(x, w, at::kBFloat16, MAX_ROWS_BF16, std::nullopt, bias))
    return run<c10::BFloat16>(x, w, std::nullopt, bias);
#endif
  return at::linear(x, w, bias);
}

// int8 weight (N, K) with one bf16 scale per output row. Products the kernel does not take go to
// at::linear on the weight converted exactly, the scale applied to the output.
at::Tensor linear_int8_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const std::optional<at::Tensor>& bias) {
#ifdef __AVX512BF16__
  if (uses_kernel(x, w, at::kChar, MAX_ROWS_INT8, scale, bias)) return run<int8_t>(x, w, scale, bias);
#endif
  at::Tensor y = at::linear(x, w.to(x.scalar_type())).mul(scale.to(x.scalar_type()));
  return bias ? y.add(*bias) : y;
}

bool has_kernel() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, &linear_cpu);
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None) -> Tensor");
  m.impl("linear_int8", c10::DispatchKey::CPU, &linear_int8_cpu);
  m.def("linear_has_kernel() -> bool", &has_kernel);
}
