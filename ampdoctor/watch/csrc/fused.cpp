#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/function.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int32_t INF_BITS = 0x7F800000;  // float32 +inf: an |x| below these bits is finite

struct Acc {
  int64_t c[8] = {};
  int32_t amax = 0;         // largest finite |x| bits (0: none)
  int32_t amin = INF_BITS;  // smallest non-zero finite |x| bits (INF: none)
};

// A tensor the kernels read: on the CPU, float32, float16 or bfloat16 (anything else takes the eager path).
bool readable(const torch::Tensor& t) {
  auto st = t.scalar_type();
  return t.device().is_cpu() && (st == at::kFloat || st == at::kHalf || st == at::kBFloat16);
}

// The tensors (made contiguous) cut into chunks of at most `chunk` elements: chunk k is elements
// [c0[k], c1[k]) of tensor ct[k]; `grain` keeps a small step on one thread (handing a few chunks to
// the pool costs more than it saves).
struct Chunks {
  std::vector<torch::Tensor> cs;
  std::vector<int64_t> ct, c0, c1;
  int64_t grain = 1;

  Chunks(const std::vector<torch::Tensor>& ts, int64_t chunk) {
    cs.reserve(ts.size());
    for (auto& t : ts) cs.push_back(t.contiguous());
    int64_t total = 0;
    for (int64_t j = 0; j < static_cast<int64_t>(cs.size()); ++j) {
      int64_t m = cs[j].numel();
      total += m;
      for (int64_t s = 0; s < m; s += chunk) { ct.push_back(j); c0.push_back(s); c1.push_back(std::min(m, s + chunk)); }
    }
    const int64_t nc = ct.size();
    grain = total < (int64_t{1} << 20) ? std::max<int64_t>(nc, 1) : 1;
  }
};

// A block's row from its threshold counts (the number of |x| at or above each threshold, of NaN and of -inf):
// 0 zero, 1 underflow, 2 subnormal, 3 normal, 4 overflow, 5 +inf, 6 NaN, 7 -inf are their differences.
inline void tally(Acc& a, int64_t n, int64_t ge1, int64_t geuf, int64_t gesub, int64_t geof, int64_t geinf, int64_t nan,
                  int64_t neginf) {
  a.c[0] += n - ge1;
  a.c[1] += ge1 - geuf;
  a.c[2] += geuf - gesub;
  a.c[3] += gesub - geof;
  a.c[4] += geof - geinf;
  a.c[5] += geinf - nan - neginf;
  a.c[6] += nan;
  a.c[7] += neginf;
}

// one block: |x| bits against the thresholds' bits. Counts of |x| at or above each threshold (and of
// -inf) are plain sums of comparisons, in int32 lanes (a chunk holds at most CHUNK elements), and
// the extremes are plain min/max reductions: g++ -O3 vectorises the loop. Category counts are the
// differences of the threshold counts.
void count_bits(const uint32_t* __restrict__ q, int32_t n, int32_t uf, int32_t sub, int32_t of, Acc& a) {
  constexpr int32_t INF = INF_BITS;
  int32_t ge1 = 0, geuf = 0, gesub = 0, geof = 0, geinf = 0, nan = 0, neginf = 0;
  int32_t amax = 0, amin = INF;
  for (int32_t i = 0; i < n; ++i) {
    uint32_t u = q[i];
    int32_t ai = static_cast<int32_t>(u & 0x7FFFFFFFu);
    ge1 += (ai >= 1);
    geuf += (ai >= uf);
    gesub += (ai >= sub);
    geof += (ai >= of);
    geinf += (ai >= INF);
    nan += (ai > INF);
    neginf += (u == 0xFF800000u);
    int32_t fin = ai < INF ? ai : 0;                      // finite |x|, 0 otherwise
    amax = std::max(amax, fin);
    int32_t nz = (ai == 0 || ai >= INF) ? INF : ai;      // finite non-zero |x|, INF otherwise
    amin = std::min(amin, nz);
  }
  tally(a, n, ge1, geuf, gesub, geof, geinf, nan, neginf);
  a.amax = std::max(a.amax, amax);
  a.amin = std::min(a.amin, amin);
}

// A block whose largest |x| the screen found finite and below the overflow threshold (most blocks that fail the
// screen: a few zeros, underflows or subnormals among normal numbers): no overflow, infinity or NaN can be in it,
// so only the zero, underflow and normal thresholds are left to count, the largest |x| is the screen's, and the
// smallest non-zero one is the unsigned minimum of |x| - 1 (a zero wraps to the largest), plus one. The same row
// as count_bits, in about a third of its vector operations.
void count_low(const uint32_t* __restrict__ q, int32_t n, int32_t uf, int32_t sub, int32_t mx, Acc& a) {
  int32_t ge1 = 0, geuf = 0, gesub = 0;
  uint32_t nz = 0xFFFFFFFFu;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t ai = static_cast<int32_t>(q[i] & 0x7FFFFFFFu);
    ge1 += (ai >= 1);
    geuf += (ai >= uf);
    gesub += (ai >= sub);
    nz = std::min(nz, static_cast<uint32_t>(ai) - 1u);
  }
  tally(a, n, ge1, geuf, gesub, 0, 0, 0, 0);  // (nothing at or above the overflow threshold)
  a.amax = std::max(a.amax, mx);
  const int32_t amin = nz == 0xFFFFFFFFu ? INF_BITS : static_cast<int32_t>(nz + 1u);
  a.amin = std::min(a.amin, amin);
}

// Most blocks of a healthy step hold only normal numbers of the format. A first pass takes only the smallest
// and largest |x| bits (three vector operations per lane instead of about a dozen); when both lie in
// [normal's threshold, overflow's threshold), every element of the block is a finite non-zero normal number,
// so the block's row is exactly (n normal, absmax = the largest, min non-zero = the smallest), which the full
// count would give too. Any other block is counted in full (count_low when its largest is in range), still in cache.
void run_bits(const uint32_t* __restrict__ q, int32_t n, int32_t uf, int32_t sub, int32_t of, Acc& a) {
  constexpr int32_t B = 1024;
  const int32_t lo = std::max(std::max(sub, uf), int32_t{1});
  const int32_t hi = std::min(of, INF_BITS);  // finite and below the overflow threshold
  for (int32_t s = 0; s < n; s += B) {
    const int32_t m = std::min(B, n - s);
    const uint32_t* __restrict__ p = q + s;
    int32_t mx = 0, mn = 0x7FFFFFFF;
    for (int32_t i = 0; i < m; ++i) {
      int32_t ai = static_cast<int32_t>(p[i] & 0x7FFFFFFFu);
      mx = std::max(mx, ai);
      mn = std::min(mn, ai);
    }
    if (mn >= lo && mx < hi) {
      a.c[3] += m;
      a.amax = std::max(a.amax, mx);
      a.amin = std::min(a.amin, mn);
    } else if (mx < hi) {
      count_low(p, m, uf, sub, mx, a);
    } else {
      count_bits(p, m, uf, sub, of, a);
    }
  }
}

// FP16 / BF16: widened to float32 exactly, a block at a time, straight into the bits the loop reads
template <typename T>
inline void widen(const T* p, int32_t m, uint32_t* bits) {
  for (int32_t i = 0; i < m; ++i) {
    const float f = static_cast<float>(p[i]);
    std::memcpy(bits + i, &f, sizeof(float));
  }
}

#if defined(__F16C__)
// FP16: the CPU's own conversion instruction, 8 at a time (exact, like the scalar conversion)
template <>
inline void widen<at::Half>(const at::Half* p, int32_t m, uint32_t* bits) {
  int32_t i = 0;
  for (; i + 8 <= m; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + i),
                        _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)))));
  for (; i < m; ++i) {
    const float f = static_cast<float>(p[i]);
    std::memcpy(bits + i, &f, sizeof(float));
  }
}
#endif

template <typename T>
void run_narrow(const T* p, int32_t n, int32_t uf, int32_t sub, int32_t of, Acc& a) {
  constexpr int32_t B = 4096;
  uint32_t bits[B];
  for (int32_t s = 0; s < n; s += B) {
    int32_t m = std::min(B, n - s);
    widen(p + s, m, bits);
    run_bits(bits, m, uf, sub, of, a);
  }
}

// FP16 read in its own 16 bits, with no widening: an FP16 |x| bit pattern orders as its value does, and so does its
// float32 widening, so |x| >= t (t given as float32 bits) exactly when |x|'s FP16 bits >= the bits of the smallest FP16
// value >= t. The thresholds are mapped once (Half16), and a block is screened and counted in 16-bit lanes (twice
// the lanes of the float32 loop, and no pass writing the widened block): the same counts, largest and smallest |x|
// as run_narrow gives (tests/test_fused.py checks every FP16 bit pattern against it). NaN patterns (above
// 0x7C00) widen to float32 NaNs and are counted as those are.
struct Half16 {
  bool ok = false;  // every threshold finite or +inf (else the widening path)
  uint16_t uf = 0, sub = 0, of = 0;
};

inline int32_t half_bits_f32(uint16_t b) {
  const float f = static_cast<float>(c10::Half(b, c10::Half::from_bits()));
  int32_t i;
  std::memcpy(&i, &f, 4);
  return i;
}

// the smallest FP16 |x| pattern in [0, 0x7C00] whose float32 bits are >= t (0x7C00, +inf, when none below it)
inline uint16_t half_at_least(int32_t t) {
  if (t <= 0) return 0;
  uint32_t lo = 0, hi = 0x7C00;  // half_bits_f32(0x7C00) is +inf: >= any t <= INF_BITS
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (half_bits_f32(static_cast<uint16_t>(mid)) >= t) hi = mid; else lo = mid + 1;
  }
  return static_cast<uint16_t>(lo);
}

inline Half16 half16(int32_t uf, int32_t sub, int32_t of) {
  Half16 h;
  if (uf > INF_BITS || sub > INF_BITS || of > INF_BITS) return h;
  h.uf = half_at_least(uf);
  h.sub = half_at_least(sub);
  h.of = half_at_least(of);
  h.ok = true;
  return h;
}

// count_bits in 16 bits: a block of at most 4096 elements (16-bit lane sums cannot wrap)
void count_bits16(const uint16_t* __restrict__ q, int32_t n, const Half16& h, Acc& a) {
  constexpr uint16_t INF16 = 0x7C00;
  uint16_t ge1 = 0, geuf = 0, gesub = 0, geof = 0, geinf = 0, nan = 0, neginf = 0;
  uint16_t amax = 0, amin = 0xFFFF;
  for (int32_t i = 0; i < n; ++i) {
    const uint16_t u = q[i];
    const uint16_t ai = u & 0x7FFF;
    ge1 += (ai >= 1);
    geuf += (ai >= h.uf);
    gesub += (ai >= h.sub);
    geof += (ai >= h.of);
    geinf += (ai >= INF16);
    nan += (ai > INF16);
    neginf += (u == 0xFC00);
    const uint16_t fin = ai < INF16 ? ai : 0;
    amax = std::max(amax, fin);
    const uint16_t nz = (ai == 0 || ai >= INF16) ? 0xFFFF : ai;
    amin = std::min(amin, nz);
  }
  tally(a, n, ge1, geuf, gesub, geof, geinf, nan, neginf);
  a.amax = std::max(a.amax, half_bits_f32(amax));
  a.amin = std::min(a.amin, amin == 0xFFFF ? INF_BITS : half_bits_f32(amin));
}

// count_low in 16 bits: the block's largest |x| is finite and below the overflow threshold
void count_low16(const uint16_t* __restrict__ q, int32_t n, const Half16& h, uint16_t mx, Acc& a) {
  uint16_t ge1 = 0, geuf = 0, gesub = 0;
  uint16_t nz = 0xFFFF;
  for (int32_t i = 0; i < n; ++i) {
    const uint16_t ai = q[i] & 0x7FFF;
    ge1 += (ai >= 1);
    geuf += (ai >= h.uf);
    gesub += (ai >= h.sub);
    nz = std::min(nz, static_cast<uint16_t>(ai - 1));  // (a zero wraps to the largest)
  }
  tally(a, n, ge1, geuf, gesub, 0, 0, 0, 0);
  a.amax = std::max(a.amax, half_bits_f32(mx));
  a.amin = std::min(a.amin, nz == 0xFFFF ? INF_BITS : half_bits_f32(static_cast<uint16_t>(nz + 1)));
}

// run_bits in 16 bits
void run_half(const at::Half* p, int32_t n, const Half16& h, Acc& a) {
  constexpr int32_t B = 4096;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
  const uint16_t lo = std::max(std::max(h.sub, h.uf), uint16_t{1});
  const uint16_t hi = std::min(h.of, uint16_t{0x7C00});
  for (int32_t s = 0; s < n; s += B) {
    const int32_t m = std::min(B, n - s);
    const uint16_t* __restrict__ b = q + s;
    uint16_t mx = 0, mn = 0x7FFF;
    for (int32_t i = 0; i < m; ++i) {
      const uint16_t ai = b[i] & 0x7FFF;
      mx = std::max(mx, ai);
      mn = std::min(mn, ai);
    }
    if (mn >= lo && mx < hi) {
      a.c[3] += m;
      a.amax = std::max(a.amax, half_bits_f32(mx));
      a.amin = std::min(a.amin, half_bits_f32(mn));
    } else if (mx < hi) {
      count_low16(b, m, h, mx, a);
    } else {
      count_bits16(b, m, h, a);
    }
  }
}

// an FP16 block: its own bits where the thresholds map, else widened
inline void run_fp16(const at::Half* p, int32_t n, int32_t uf, int32_t sub, int32_t of, const Half16& h, Acc& a) {
  if (h.ok) run_half(p, n, h, a); else run_narrow(p, n, uf, sub, of, a);
}

// NUMEL ZERO UNDERFLOW SUBNORMAL NORMAL OVERFLOW POSINF NEGINF NAN ABSMAX MIN_NONZERO (stats.Col)
void fill_row(const Acc& t, double* o) {
  int64_t numel = 0;
  for (int q = 0; q < 8; ++q) numel += t.c[q];
  o[0] = numel;
  for (int q = 0; q < 6; ++q) o[1 + q] = t.c[q];
  o[7] = t.c[7];
  o[8] = t.c[6];
  float amax, amin;
  std::memcpy(&amax, &t.amax, 4);
  std::memcpy(&amin, &t.amin, 4);
  o[9] = amax;
  o[10] = amin;  // +inf (the bits of INF) when no finite non-zero element
}

}  // namespace

template <typename T>
double sumsq(const T* p, int64_t n);

// the rows of `ts` ([n, 11] float64) and, with `norms`, the L2 norm of each (float32 [n], as `norms` below gives
// it): a chunk's squares are summed right after its row is counted, while it is still in cache (one read of
// memory for both, where a separate `norms` call reads it again)
std::vector<torch::Tensor> stats_impl(const std::vector<torch::Tensor>& ts, int64_t uf, int64_t sub, int64_t of,
                                      int64_t chunk, bool norms) {
  const int64_t n = ts.size();
  // another device or dtype: an undefined result, and the caller takes the eager path
  if (!std::all_of(ts.begin(), ts.end(), readable)) return {};
  const Chunks ch(ts, chunk);
  const auto& cs = ch.cs;
  const auto& ct = ch.ct;
  const int64_t nc = ct.size();
  std::vector<Acc> part(nc);
  std::vector<double> sq(norms ? nc : 0, 0.0);
  const Half16 h16 = half16(static_cast<int32_t>(uf), static_cast<int32_t>(sub), static_cast<int32_t>(of));
  at::parallel_for(0, nc, ch.grain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      Acc& a = part[k];
      const auto& t = cs[ct[k]];
      int64_t s = ch.c0[k];
      int32_t len = static_cast<int32_t>(ch.c1[k] - ch.c0[k]);
      switch (t.scalar_type()) {
        case at::kFloat: {
          const float* f = t.data_ptr<float>() + s;
          run_bits(reinterpret_cast<const uint32_t*>(f), len, uf, sub, of, a);  // read as bits, in place
          if (norms) sq[k] = sumsq(f, len);
          break;
        }
        case at::kHalf:
          run_fp16(t.data_ptr<at::Half>() + s, len, uf, sub, of, h16, a);
          if (norms) sq[k] = sumsq(t.data_ptr<at::Half>() + s, len);
          break;
        case at::kBFloat16:
          run_narrow(t.data_ptr<at::BFloat16>() + s, len, uf, sub, of, a);
          if (norms) sq[k] = sumsq(t.data_ptr<at::BFloat16>() + s, len);
          break;
        default: TORCH_CHECK(false, "ampdoctor stats: unsupported dtype");
      }
    }
  });
  auto out = torch::zeros({n, 11}, torch::kFloat64);
  auto o = out.accessor<double, 2>();
  std::vector<Acc> tot(n);
  std::vector<double> sqt(norms ? n : 0, 0.0);
  for (int64_t k = 0; k < nc; ++k) {
    Acc& t = tot[ct[k]];
    for (int q = 0; q < 8; ++q) t.c[q] += part[k].c[q];
    t.amax = part[k].amax > t.amax ? part[k].amax : t.amax;
    t.amin = part[k].amin < t.amin ? part[k].amin : t.amin;
    if (norms) sqt[ct[k]] += sq[k];  // (the chunks in order: the same sums as `norms`)
  }
  for (int64_t j = 0; j < n; ++j) fill_row(tot[j], &o[j][0]);
  if (!norms) return {out};
  auto nr = torch::empty({n}, torch::kFloat32);
  float* no = nr.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) no[j] = static_cast<float>(std::sqrt(sqt[j]));
  return {out, nr};
}

torch::Tensor stats(std::vector<torch::Tensor> ts, int64_t uf, int64_t sub, int64_t of, int64_t chunk) {
  auto r = stats_impl(ts, uf, sub, of, chunk, false);
  return r.empty() ? torch::Tensor() : r[0];
}

// (rows, norms), or () where a tensor is not readable here
std::vector<torch::Tensor> stats_norms(std::vector<torch::Tensor> ts, int64_t uf, int64_t sub, int64_t of, int64_t chunk) {
  return stats_impl(ts, uf, sub, of, chunk, true);
}

// the row of one tensor, read right where it is made (the tap): no batching, the data still in cache
bool row_of(const torch::Tensor& t0, int32_t uf, int32_t sub, int32_t of, const Half16& h16, double* o) {
  if (!readable(t0)) return false;
  const auto st = t0.scalar_type();
  const torch::Tensor t = t0.contiguous();
  Acc a;
  const int64_t m = t.numel();
  constexpr int64_t C = int64_t{1} << 30;  // int32 counts per pass
  for (int64_t s = 0; s < m; s += C) {
    const int32_t len = static_cast<int32_t>(std::min(C, m - s));
    switch (st) {
      case at::kFloat: run_bits(reinterpret_cast<const uint32_t*>(t.data_ptr<float>() + s), len, uf, sub, of, a); break;
      case at::kHalf: run_fp16(t.data_ptr<at::Half>() + s, len, uf, sub, of, h16, a); break;
      default: run_narrow(t.data_ptr<at::BFloat16>() + s, len, uf, sub, of, a); break;
    }
  }
  fill_row(a, o);
  return true;
}

// L2 norm of each tensor (float32 result, as _foreach_norm(dtype=float32) gives), the squares summed in
// double: a tensor of finite elements always has a finite sum of squares here (float32 squares overflow
// from 1.8e19), so the norm is non-finite exactly when an element is. One call for all the gradients:
// _foreach_norm on the CPU pays a few microseconds per tensor, most of its time on small ones.
// Sixteen running sums, element i into sum i % 16: each sum is still added in order (no reassociation for the
// compiler to be allowed), and the sixteen lanes vectorise (four AVX2 registers of doubles).
template <typename T>
double sumsq(const T* p, int64_t n) {
  constexpr int L = 16;
  double a[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    for (int k = 0; k < L; ++k) {
      const double x = static_cast<float>(p[i + k]);
      a[k] += x * x;
    }
  }
  for (int k = 0; i < n; ++i, ++k) { const double x = static_cast<float>(p[i]); a[k] += x * x; }
  for (int w = L / 2; w >= 1; w /= 2)
    for (int k = 0; k < w; ++k) a[k] += a[k + w];
  return a[0];
}

torch::Tensor norms(std::vector<torch::Tensor> ts, int64_t chunk) {
  const int64_t n = ts.size();
  if (!std::all_of(ts.begin(), ts.end(), readable)) return torch::Tensor();
  const Chunks ch(ts, chunk);
  const auto& ct = ch.ct;
  const int64_t nc = ct.size();
  std::vector<double> part(nc, 0.0);
  at::parallel_for(0, nc, ch.grain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const auto& t = ch.cs[ct[k]];
      const int64_t s = ch.c0[k], len = ch.c1[k] - ch.c0[k];
      switch (t.scalar_type()) {
        case at::kFloat: part[k] = sumsq(t.data_ptr<float>() + s, len); break;
        case at::kHalf: part[k] = sumsq(t.data_ptr<at::Half>() + s, len); break;
        default: part[k] = sumsq(t.data_ptr<at::BFloat16>() + s, len); break;
      }
    }
  });
  std::vector<double> tot(n, 0.0);
  for (int64_t k = 0; k < nc; ++k) tot[ct[k]] += part[k];
  auto out = torch::empty({n}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<float>(std::sqrt(tot[j]));
  return out;
}

// Adam's figures per state tensor (engine.ring.adam_figures): the norm of m / (sqrt(v) + eps) and the smallest v,
// in one pass over each (m, v) pair instead of torch's several (a cat, a sqrt, a divide, a square and two segment
// reductions, each with its temporary). Element arithmetic in float32 as those ops do it, the squares summed in
// double; a NaN in v makes its minimum NaN (as torch's min). Result: float64 [2n], the n norms then the n minima;
// undefined (the caller takes the torch path) unless every tensor is a float32 CPU tensor, m and v alike in size.
template <typename F>
void for_tensors(const std::vector<torch::Tensor>& ts, F f) {
  int64_t total = 0;
  for (auto& t : ts) total += t.numel();
  const int64_t grain = total < (int64_t{1} << 20) ? std::max<int64_t>(static_cast<int64_t>(ts.size()), 1) : 1;
  at::parallel_for(0, static_cast<int64_t>(ts.size()), grain, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) f(j);
  });
}

torch::Tensor adam_figures(std::vector<torch::Tensor> ms, std::vector<torch::Tensor> vs, std::vector<double> eps) {
  const int64_t n = ms.size();
  if (static_cast<int64_t>(vs.size()) != n || static_cast<int64_t>(eps.size()) != n) return torch::Tensor();
  for (int64_t j = 0; j < n; ++j) {
    const auto& m = ms[j];
    const auto& v = vs[j];
    if (!m.device().is_cpu() || !v.device().is_cpu() || m.scalar_type() != at::kFloat ||
        v.scalar_type() != at::kFloat || m.numel() != v.numel())
      return torch::Tensor();
  }
  std::vector<torch::Tensor> mc(n), vc(n);
  for (int64_t j = 0; j < n; ++j) { mc[j] = ms[j].contiguous(); vc[j] = vs[j].contiguous(); }
  auto out = torch::empty({2 * n}, torch::kFloat64);
  double* o = out.data_ptr<double>();
  for_tensors(mc, [&](int64_t j) {
    const float* m = mc[j].data_ptr<float>();
    const float* v = vc[j].data_ptr<float>();
    const int64_t len = mc[j].numel();
    const float e = static_cast<float>(eps[j]);
    // the squares summed in double, the smallest v and whether a NaN is among them, each in L running lanes (element
    // i into lane i % L, each lane in order: the loops vectorise; a minimum does not depend on the order it is taken
    // in, zeros' signs aside)
    constexpr int L = 16;
    double a[L] = {};
    float lo_l[L];
    int32_t nan_l[L] = {};
    for (int k = 0; k < L; ++k) lo_l[k] = std::numeric_limits<float>::infinity();
    float q[256];  // a block's squares (the elementwise part vectorises: sqrt needs -fno-math-errno), then summed in double
    for (int64_t s0 = 0; s0 < len; s0 += 256) {
      const int64_t k = std::min<int64_t>(256, len - s0);
      const float* __restrict__ mb = m + s0;
      const float* __restrict__ vb = v + s0;
      for (int64_t i = 0; i < k; ++i) {
        const float r = mb[i] / (std::sqrt(vb[i]) + e);
        q[i] = r * r;
      }
      int64_t i = 0;
      for (; i + L <= k; i += L) {
        for (int w = 0; w < L; ++w) {
          const float vv = vb[i + w];
          nan_l[w] |= vv != vv;
          lo_l[w] = vv < lo_l[w] ? vv : lo_l[w];
        }
      }
      for (int w = 0; i < k; ++i, ++w) {
        const float vv = vb[i];
        nan_l[w] |= vv != vv;
        lo_l[w] = vv < lo_l[w] ? vv : lo_l[w];
      }
      i = 0;
      for (; i + L <= k; i += L)
        for (int w = 0; w < L; ++w) a[w] += q[i + w];
      for (int w = 0; i < k; ++i, ++w) a[w] += q[i];
    }
    float lo = std::numeric_limits<float>::infinity();
    int32_t nan = 0;
    for (int w = 0; w < L; ++w) {
      nan |= nan_l[w];
      lo = lo_l[w] < lo ? lo_l[w] : lo;
    }
    for (int w = L / 2; w >= 1; w /= 2)
      for (int k = 0; k < w; ++k) a[k] += a[k + w];
    o[j] = std::sqrt(a[0]);
    o[n + j] = nan ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(lo);
  });
  return out;
}

// The tap: a step's recording in C++ (see watch.hooks). The forward hook hands it each module call
// (module index, args, kwargs, output); it finds the floating tensors inside (as tensors.iter_tensors
// does), gives each tensor a per-step id (the same tensor keeps its id: kept by TensorImpl, checked
// alive through a weak pointer), queues new ones for statistics, hooks the gradient of each that
// requires grad, and notes the call. The gradient hook is C++: no Python call in backward. Queues are
// drained from Python; a queue that holds `limit` elements or more asks for it (record's return value,
// or the `drain` callback, called with the GIL from backward), so held tensors stay bounded like the
// statistics buffer's.
// A list of ints handed to Python, and the Python list made of it last time: the same values (a step's calls,
// tensor ids and gradient order repeat from step to step) give back the same list object, so Python makes no int
// objects for it and its comparisons with the last step's meet the same objects.
struct ListCache {
  std::vector<int64_t> v;
  pybind11::object l;
};

pybind11::object cached_list(ListCache& c, std::vector<int64_t>& v) {
  if (v.empty()) return pybind11::list();  // (a take with nothing new: the step's list stays cached)
  if (!c.l || c.v != v) {
    c.v = v;
    c.l = pybind11::cast(v);
  }
  v.clear();  // (its capacity stays: no reallocation next step)
  return c.l;
}

// The step's tensor ids by TensorImpl: entries in arrival order (each with a weak reference to its TensorImpl, which
// keeps that memory from being reused by another tensor while the entry lives, so a pointer found here is the same
// tensor: no liveness check on a hit) and an open-addressing index over them. No allocation per tensor once the
// step's size has been reached, and clearing is one pass over contiguous entries (an unordered_map allocated a
// node per tensor and walked a linked list to free them).
struct TidMap {
  struct Entry {
    c10::TensorImpl* impl;
    c10::weak_intrusive_ptr<c10::TensorImpl> keep;
    int64_t tid;
  };
  std::vector<Entry> entries;
  std::vector<int32_t> index = std::vector<int32_t>(1024, -1);  // slot -> entry, -1: empty (size a power of two)

  static size_t hash(const c10::TensorImpl* p) {
    uint64_t x = reinterpret_cast<uintptr_t>(p);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 29;
    return static_cast<size_t>(x);
  }
  // the entry's id, or -1
  int64_t find(const c10::TensorImpl* p) const {
    const size_t mask = index.size() - 1;
    for (size_t i = hash(p) & mask;; i = (i + 1) & mask) {
      const int32_t e = index[i];
      if (e < 0) return -1;
      if (entries[e].impl == p) return entries[e].tid;
    }
  }
  void insert(const torch::Tensor& t, int64_t tid) {
    if (2 * (entries.size() + 1) > index.size()) grow();
    c10::TensorImpl* p = t.unsafeGetTensorImpl();
    entries.push_back(Entry{p, c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), tid});
    place(p, static_cast<int32_t>(entries.size() - 1));
  }
  void place(const c10::TensorImpl* p, int32_t e) {
    const size_t mask = index.size() - 1;
    size_t i = hash(p) & mask;
    while (index[i] >= 0) i = (i + 1) & mask;
    index[i] = e;
  }
  void grow() {
    index.assign(index.size() * 2, -1);
    for (size_t e = 0; e < entries.size(); ++e) place(entries[e].impl, static_cast<int32_t>(e));
  }
  void clear() {
    if (entries.empty()) return;
    entries.clear();  // (the weak references go: a dead tensor's memory is freed here)
    std::fill(index.begin(), index.end(), -1);
  }
};

// The watched model's modules by identity (like id()): keys and values side by side in one open-addressing array,
// so a module call's lookup reads one line that stays near (an unordered_map's chained nodes, scattered over the
// heap and cold by the next call, cost two dependent cache misses a call: most of the recorder's own time).
struct ModIndex {
  struct Slot {
    const PyObject* key = nullptr;
    int64_t value = -1;
  };
  std::vector<Slot> slots = std::vector<Slot>(16);

  static size_t hash(const PyObject* p) {
    uint64_t x = reinterpret_cast<uintptr_t>(p) >> 4;  // (objects are 16-byte aligned)
    x *= 0x9E3779B97F4A7C15ULL;
    return static_cast<size_t>(x >> 32);
  }
  void assign(const std::vector<const PyObject*>& keys) {
    size_t cap = 16;
    while (cap < 2 * keys.size() + 1) cap *= 2;
    slots.assign(cap, Slot{});
    const size_t mask = cap - 1;
    for (size_t k = 0; k < keys.size(); ++k) {
      size_t i = hash(keys[k]) & mask;
      while (slots[i].key != nullptr && slots[i].key != keys[k]) i = (i + 1) & mask;
      if (slots[i].key == nullptr) slots[i] = Slot{keys[k], static_cast<int64_t>(k)};  // (the first index of a module)
    }
  }
  // the module's index, or -1 (another model's module)
  int64_t find(const PyObject* p) const {
    const size_t mask = slots.size() - 1;
    for (size_t i = hash(p) & mask;; i = (i + 1) & mask) {
      const Slot& s = slots[i];
      if (s.key == p) return s.value;
      if (s.key == nullptr) return -1;
    }
  }
};

// whether a stats row (fill_row's layout) counts a NaN or an infinity
inline bool row_bad(const double* r) { return r[6] + r[7] + r[8] > 0; }

struct Tap {
  std::mutex mu;  // the gradient queue: backward may run on another thread (the autograd engine's)
  std::vector<int64_t> grad_order;  // every watched gradient's tid, in arrival order
  std::vector<int64_t> grad_ids;    // queued as tensors (another device or dtype, or rows not wanted here)
  std::vector<torch::Tensor> grads;
  std::vector<int64_t> grad_row_ids;  // reduced on arrival (CPU): their rows
  std::vector<double> grad_rows;
  int64_t grad_pending = 0;
  bool grad_mixed = false;  // queued gradients on more than one device
  bool grad_bad = false;    // a row made here since the last take counts a NaN or an infinity
  int64_t limit;
  int64_t serial = 0;   // the step being recorded; a gradient hook from another step does nothing
  bool active = false;
  bool acts, watch_grads;
  bool rows;             // reduce CPU tensors here, on arrival, to stats rows with these thresholds
  int32_t uf, sub, of;
  Half16 h16;  // the thresholds in FP16 bits (FP16 tensors read in their own bits)
  pybind11::object drain;
  // forward (only touched with the GIL held)
  TidMap tids;
  int64_t next_tid = 0;
  std::vector<int64_t> act_ids;
  std::vector<torch::Tensor> act_ts;
  std::vector<int64_t> act_row_ids;
  std::vector<double> act_rows;
  int64_t act_pending = 0;
  bool act_mixed = false;
  bool act_bad = false;
  std::vector<int64_t> call_mod, call_in, call_out, flat;  // call k: inputs flat[call_in[k]:call_out[k]], outputs to the next
  std::vector<torch::Tensor> scratch;
  ModIndex mod_index;                                // the watched model's modules (by identity, like id())
  pybind11::object root_ref;                         // a weakref to the model (training_only)
  ListCache l_act_ids, l_act_rids, l_grad_order, l_grad_ids, l_grad_rids, l_mods, l_bounds, l_flat;
  bool training_only = false;
  Tap(int64_t limit_, bool acts_, bool grads_, bool rows_, int64_t uf_, int64_t sub_, int64_t of_, pybind11::object drain_)
      : limit(limit_), acts(acts_), watch_grads(grads_), rows(rows_), uf(uf_), sub(sub_), of(of_),
        h16(half16(uf, sub, of)), drain(std::move(drain_)) {}
  ~Tap() {  // the last owner may be a hook on the autograd thread: release Python's objects under the GIL
    if (Py_IsInitialized()) {
      pybind11::gil_scoped_acquire gil;
      drain = pybind11::object();
      root_ref = pybind11::object();
      for (ListCache* c : {&l_act_ids, &l_act_rids, &l_grad_order, &l_grad_ids, &l_grad_rids, &l_mods, &l_bounds, &l_flat})
        c->l = pybind11::object();
      grads.clear();
      act_ts.clear();
    }
  }
};
using TapP = std::shared_ptr<Tap>;

// a watched gradient arrives (from backward, on any thread)
void on_grad(const std::weak_ptr<Tap>& w, int64_t tid, int64_t serial, const at::TensorBase& g) {
  auto tp = w.lock();
  if (!tp || !g.defined()) return;
  bool full = false;
  double row[11];
  const bool reduced = tp->rows && row_of(torch::Tensor(g), tp->uf, tp->sub, tp->of, tp->h16, row);
  {
    std::lock_guard<std::mutex> lock(tp->mu);
    if (!tp->active || tp->serial != serial) return;
    tp->grad_order.push_back(tid);
    if (reduced) {
      tp->grad_row_ids.push_back(tid);
      tp->grad_rows.insert(tp->grad_rows.end(), row, row + 11);
      tp->grad_bad = tp->grad_bad || row_bad(row);
      return;
    }
    if (!tp->grads.empty() && tp->grads.front().device() != g.device()) tp->grad_mixed = true;
    tp->grad_ids.push_back(tid);
    tp->grads.emplace_back(torch::Tensor(g));
    tp->grad_pending += g.numel();
    full = tp->grad_pending >= tp->limit;
  }
  if (full) {
    pybind11::gil_scoped_acquire gil;
    tp->drain();
  }
}

// The gradient hook of a tensor made by an op: a tensor pre-hook on its grad_fn, as Tensor::register_hook
// installs one, without the hook list, the second copy for the tensor's own hooks and the two std::function
// wrappers it allocates for each tensor. It sees the gradient of output `idx` (the tensor's output_nr) and
// hands the gradients on unchanged. A later in-place op gives the tensor a new grad_fn, and this hook stays
// with the old one: the gradient of the value the module returned, as with register_hook.
struct GradTap : torch::autograd::FunctionPreHook {
  std::weak_ptr<Tap> w;
  int64_t tid, serial;
  size_t idx;
  GradTap(std::weak_ptr<Tap> w_, int64_t tid_, int64_t serial_, size_t idx_)
      : w(std::move(w_)), tid(tid_), serial(serial_), idx(idx_) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (idx < grads.size()) on_grad(w, tid, serial, grads[idx]);
    return grads;
  }
};

void tap_watch(const TapP& tap, const torch::Tensor& t, int64_t tid) {
  std::weak_ptr<Tap> w = tap;
  const int64_t serial = tap->serial;
  const auto& fn = t.grad_fn();
  if (fn) {
    fn->add_tensor_pre_hook(std::make_unique<GradTap>(std::move(w), tid, serial, t.output_nr()));
    return;
  }
  // a leaf that requires grad (an input the user marked): its gradient reaches no grad_fn of its own
  t.register_hook([w, tid, serial](const at::TensorBase& g) { on_grad(w, tid, serial, g); });
}

// tensors.iter_tensors in C++: tensors, then dicts, lists and tuples (4 levels deep), then to_tuple()
void walk(pybind11::handle o, int depth, std::vector<torch::Tensor>& out) {
  PyObject* p = o.ptr();
  // (the exact containers first: a module's args are a tuple, and THPVariable_Check of a non-tensor is an isinstance)
  const bool tup = PyTuple_CheckExact(p);
  if (!tup && THPVariable_Check(p)) { out.push_back(THPVariable_Unpack(p)); return; }
  if (depth > 4) return;
  if (tup) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p); ++i) walk(PyTuple_GET_ITEM(p, i), depth + 1, out);
  } else if (PyDict_CheckExact(p)) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(p, &pos, &k, &v)) walk(v, depth + 1, out);
  } else if (PyList_CheckExact(p)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(p); ++i) walk(PyList_GET_ITEM(p, i), depth + 1, out);
  } else if (PyDict_Check(p)) {  // a subclass (ModelOutput, OrderedDict): its own values(), in its order
    for (auto v : o.attr("values")()) walk(v, depth + 1, out);
  } else if (PyTuple_Check(p) || PyList_Check(p)) {
    for (auto v : o) walk(v, depth + 1, out);
  } else if (pybind11::hasattr(o, "to_tuple")) {
    walk(o.attr("to_tuple")(), depth + 1, out);
  }
}

int64_t tid_of(Tap& tap, const torch::Tensor& t, bool grad_enabled) {
  const int64_t known = tap.tids.find(t.unsafeGetTensorImpl());
  if (known >= 0) return known;
  const int64_t tid = tap.next_tid++;
  tap.tids.insert(t, tid);
  if (tap.acts) {
    double row[11];
    if (tap.rows && row_of(t, tap.uf, tap.sub, tap.of, tap.h16, row)) {
      tap.act_row_ids.push_back(tid);
      tap.act_rows.insert(tap.act_rows.end(), row, row + 11);
      tap.act_bad = tap.act_bad || row_bad(row);
      return tid;
    }
    if (!tap.act_ts.empty() && tap.act_ts.front().device() != t.device()) tap.act_mixed = true;
    tap.act_ids.push_back(tid);
    tap.act_ts.push_back(t);
    tap.act_pending += t.numel();
  }
  return tid;
}

void note(const TapP& tap, pybind11::handle obj, int depth, bool grad_enabled) {
  Tap& tp = *tap;
  tp.scratch.clear();
  walk(obj, depth, tp.scratch);
  for (const auto& t : tp.scratch) {
    if (!t.is_floating_point()) continue;
    const int64_t before = tp.next_tid;
    const int64_t tid = tid_of(tp, t, grad_enabled);
    tp.flat.push_back(tid);
    if (tid >= before && tp.watch_grads && grad_enabled && t.requires_grad()) tap_watch(tap, t, tid);
  }
}

bool tap_record(const TapP& tap, int64_t mod, pybind11::handle args, pybind11::handle kwargs, pybind11::handle output,
                bool grad_enabled);

void tap_configure(const TapP& tap, pybind11::list modules, pybind11::object root_ref, bool training_only) {
  std::vector<const PyObject*> keys;
  keys.reserve(modules.size());
  for (size_t i = 0; i < modules.size(); ++i) keys.push_back(modules[i].ptr());
  tap->mod_index.assign(keys);
  tap->root_ref = std::move(root_ref);
  tap->training_only = training_only;
}

// the __call__ wrapper's listener (watch.hooks): one module call, anything's; returns whether the activation
// queue should be drained now
bool tap_call(const TapP& tap, pybind11::handle module, pybind11::handle args, pybind11::handle kwargs,
              pybind11::handle output) {
  Tap& tp = *tap;
  if (!tp.active) return false;
  const int64_t mod = tp.mod_index.find(module.ptr());
  if (mod < 0) return false;  // another model's module
  const bool grad = at::GradMode::is_enabled();
  if (tp.training_only) {  // only training forwards: grad enabled and the model in train mode
    if (!grad || !tp.root_ref) return false;
    PyObject* root = PyWeakref_GetObject(tp.root_ref.ptr());
    if (root == nullptr || root == Py_None) return false;
    static PyObject* const training = PyUnicode_InternFromString("training");  // (one string, not one a call)
    PyObject* v = PyObject_GetAttr(root, training);
    if (v == nullptr) throw pybind11::error_already_set();
    const int on = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (on < 0) throw pybind11::error_already_set();
    if (!on) return false;
  }
  return tap_record(tap, mod, args, kwargs, output, grad);
}

// one module call; returns whether the activation queue should be drained now
bool tap_record(const TapP& tap, int64_t mod, pybind11::handle args, pybind11::handle kwargs, pybind11::handle output,
                bool grad_enabled) {
  Tap& tp = *tap;
  tp.call_mod.push_back(mod);
  tp.call_in.push_back(static_cast<int64_t>(tp.flat.size()));
  if (kwargs.is_none() || (PyDict_Check(kwargs.ptr()) && PyDict_GET_SIZE(kwargs.ptr()) == 0)) {
    note(tap, args, 0, grad_enabled);
  } else {  // as iter_tensors((args, kwargs))
    note(tap, args, 1, grad_enabled);
    note(tap, kwargs, 1, grad_enabled);
  }
  tp.call_out.push_back(static_cast<int64_t>(tp.flat.size()));
  note(tap, output, 0, grad_enabled);
  return tp.act_pending >= tp.limit;
}

torch::Tensor rows_tensor(std::vector<double>& v) {
  const int64_t k = static_cast<int64_t>(v.size() / 11);
  auto out = torch::empty({k, 11}, torch::kFloat64);
  if (k) std::memcpy(out.data_ptr<double>(), v.data(), sizeof(double) * v.size());
  v.clear();
  return out;
}

// the rows made here, or None when there are none (no empty tensor made for nothing)
pybind11::object rows_or_none(std::vector<double>& v) {
  if (v.empty()) return pybind11::none();
  return pybind11::cast(rows_tensor(v));
}

// (tids, tensors, elements, on more than one device, tids reduced here, their rows [k, 11] or None, any of those rows
// non-finite)
pybind11::tuple acts_taken(Tap& tp) {
  auto rows = rows_or_none(tp.act_rows);
  const int64_t n = tp.act_pending;
  const bool mixed = tp.act_mixed, bad = tp.act_bad;
  tp.act_pending = 0;
  tp.act_mixed = tp.act_bad = false;
  auto ts = pybind11::cast(tp.act_ts);
  tp.act_ts.clear();
  return pybind11::make_tuple(cached_list(tp.l_act_ids, tp.act_ids), ts, n, mixed,
                              cached_list(tp.l_act_rids, tp.act_row_ids), rows, bad);
}

pybind11::tuple tap_take_acts(const TapP& tap) { return acts_taken(*tap); }

// (arrival order, then as tap_take_acts); the caller holds the gradient lock
pybind11::tuple grads_taken(Tap& tp) {
  auto rows = rows_or_none(tp.grad_rows);
  const int64_t n = tp.grad_pending;
  const bool mixed = tp.grad_mixed, bad = tp.grad_bad;
  tp.grad_pending = 0;
  tp.grad_mixed = tp.grad_bad = false;
  auto grads = pybind11::cast(tp.grads);
  tp.grads.clear();
  return pybind11::make_tuple(cached_list(tp.l_grad_order, tp.grad_order), cached_list(tp.l_grad_ids, tp.grad_ids), grads,
                              n, mixed, cached_list(tp.l_grad_rids, tp.grad_row_ids), rows, bad);
}

pybind11::tuple tap_take_grads(const TapP& tap) {
  std::lock_guard<std::mutex> lock(tap->mu);  // (the GIL is held: a gradient hook takes the lock, never the GIL with it)
  return grads_taken(*tap);
}

// the calls noted since the last take, flat (no Python object per call: see records.StepStats.calls):
// (module indices, bounds, tids); call k's inputs are tids[bounds[2k]:bounds[2k+1]], its outputs
// tids[bounds[2k+1]:bounds[2k+2]], in the order the calls ended
pybind11::tuple take_calls(Tap& tp) {
  const size_t n = tp.call_mod.size();
  if (n == 0 && tp.flat.empty())  // nothing since the last take: the cached lists stay the step's
    return pybind11::make_tuple(pybind11::list(), pybind11::list(), pybind11::list());
  std::vector<int64_t> bounds;
  bounds.reserve(2 * n + 1);
  for (size_t k = 0; k < n; ++k) {
    bounds.push_back(tp.call_in[k]);
    bounds.push_back(tp.call_out[k]);
  }
  bounds.push_back(static_cast<int64_t>(tp.flat.size()));
  tp.call_in.clear();
  tp.call_out.clear();
  return pybind11::make_tuple(cached_list(tp.l_mods, tp.call_mod), cached_list(tp.l_bounds, bounds),
                              cached_list(tp.l_flat, tp.flat));
}

pybind11::tuple tap_take_calls(const TapP& tap) { return take_calls(*tap); }

// everything noted since the last take, in one call: (calls or None, activations or None, gradients or None), each
// as its own take gives it, None where nothing came (a step takes four times, and after backward nothing is new)
pybind11::tuple tap_take(const TapP& tap) {
  Tap& tp = *tap;
  pybind11::object calls = pybind11::none(), acts = pybind11::none(), grads = pybind11::none();
  if (!tp.call_mod.empty() || !tp.flat.empty()) calls = take_calls(tp);
  if (!tp.act_ids.empty() || !tp.act_row_ids.empty()) acts = acts_taken(tp);
  {
    std::lock_guard<std::mutex> lock(tp.mu);
    if (!tp.grad_order.empty() || !tp.grad_ids.empty() || !tp.grad_row_ids.empty()) grads = grads_taken(tp);
  }
  return pybind11::make_tuple(calls, acts, grads);
}

void tap_start(const TapP& tap, int64_t serial, bool active) {
  {
    std::lock_guard<std::mutex> lock(tap->mu);
    tap->serial = serial;
    tap->active = active;
    tap->grad_order.clear();
    tap->grad_ids.clear();
    tap->grads.clear();
    tap->grad_row_ids.clear();
    tap->grad_rows.clear();
    tap->grad_pending = 0;
    tap->grad_mixed = false;
    tap->grad_bad = false;
  }
  tap->tids.clear();
  tap->next_tid = 0;
  tap->act_ids.clear();
  tap->act_ts.clear();
  tap->act_row_ids.clear();
  tap->act_rows.clear();
  tap->act_pending = 0;
  tap->act_mixed = false;
  tap->act_bad = false;
  tap->call_mod.clear();
  tap->call_in.clear();
  tap->call_out.clear();
  tap->flat.clear();
}

// tap_call for the __call__ wrapper, once per module call: a plain CPython function (METH_FASTCALL) bound to the
// Tap (a capsule holds it), where a pybind11 call with a functools.partial costs about a microsecond more a call
constexpr const char* TAP_CAPSULE = "ampdoctor.fused.Tap";

void tap_capsule_free(PyObject* cap) { delete static_cast<TapP*>(PyCapsule_GetPointer(cap, TAP_CAPSULE)); }

PyObject* tap_call_fast(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "tap call: (module, args, kwargs, output)");
    return nullptr;
  }
  auto* tp = static_cast<TapP*>(PyCapsule_GetPointer(self, TAP_CAPSULE));
  if (tp == nullptr) return nullptr;
  try {
    if (tap_call(*tp, args[0], args[1], args[2], args[3])) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef tap_call_def = {"tap_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tap_call_fast)),
                            METH_FASTCALL, "tap_call(module, args, kwargs, output) of one Tap"};

pybind11::object tap_caller(const TapP& tap) {
  PyObject* cap = PyCapsule_New(new TapP(tap), TAP_CAPSULE, tap_capsule_free);
  if (cap == nullptr) throw pybind11::error_already_set();
  PyObject* f = PyCFunction_New(&tap_call_def, cap);
  Py_DECREF(cap);
  if (f == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(f);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stats", &stats, "ampdoctor one-pass statistics");
  m.def("stats_norms", &stats_norms, "(stats rows, L2 norms) in one read of the tensors; empty if one is not readable");
  m.def("norms", &norms, "the L2 norm of each tensor (float32), squares summed in double");
  m.def("adam_figures", &adam_figures, "per Adam state tensor: |m / (sqrt(v) + eps)| and min(v), float64 [2n]");
  pybind11::class_<Tap, std::shared_ptr<Tap>>(m, "Tap")
      .def(pybind11::init<int64_t, bool, bool, bool, int64_t, int64_t, int64_t, pybind11::object>());
  m.def("tap_record", &tap_record, "note one module call");
  m.def("tap_configure", &tap_configure, "the watched modules (in index order), a weakref to the model, training_only");
  m.def("tap_call", &tap_call, "note one module call if it is a watched module's and the step is recorded");
  m.def("tap_caller", &tap_caller, "tap_call bound to one Tap, as a plain C function: f(module, args, kwargs, output)");
  m.def("tap_take_acts", &tap_take_acts, "(tids, tensors, elements) queued for statistics since the last take");
  m.def("tap_take_grads", &tap_take_grads, "(tids, gradients, elements) queued since the last take, in arrival order");
  m.def("tap_take_calls", &tap_take_calls, "(module indices, [(input tids, output tids)]) noted since the last take");
  m.def("tap_take", &tap_take, "(calls, activations, gradients) since the last take, each None where nothing came");
  m.def("tap_start", &tap_start, "a new step: clears everything, sets the serial and whether to record");
}
