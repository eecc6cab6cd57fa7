// The fused Adam step on a CUDA GPU, with the CPU kernel's bits (adam_kernel.h, Factors; adam_kernel_quant.h).
//
// Every operation is one IEEE-rounded intrinsic (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn):
// nvcc would otherwise contract a * b + c into an fma the CPU kernel does not do, and the CPU builds' fmas are these
// fmas. Conversions are the scalar build's bit formulas. So a state written on either device steps on the other and
// checkpoints are interchangeable (tests/python/test_device_adam.py checks CUDA against the CPU kernel bit for bit).
//
// fp32 / bf16 moments: one element per thread, grid-stride. int8 moments: one thread block per quantisation block of
// kQuantBlock elements (256 threads, 8 elements each, coalesced): dequantise, update in fp32, reduce the block's
// absmax (a maximum: exact in any order), requantise, write codes and absmax once. Blocks are independent, so the
// bits do not depend on the launch shape.
#include <cuda_runtime.h>

#include <cstdint>

#include "adam/adam_kernel.h"
#include "adam/adam_kernel_cuda.h"

namespace zeroshard::adam_kernel::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = static_cast<int>(kQuantBlock) / kThreads;
static_assert(kPerThread * kThreads == kQuantBlock, "a quantisation block is whole threads' elements");

// --- conversions: the scalar build's formulas (adam_kernel_scalar.cpp)

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const BF16* p, int64_t i) { return __uint_as_float(uint32_t{p[i].bits} << 16); }
__device__ __forceinline__ float load(const FP16* p, int64_t i) {
  const uint32_t h = p[i].bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) return __uint_as_float(sign | __float_as_uint(__fmul_rn(static_cast<float>(man), 0x1p-24f)));
  if (exp == 31) return __uint_as_float(sign | 0x7F800000u | (man << 13));
  return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}
__device__ __forceinline__ void store(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store(BF16* p, int64_t i, float x) {
  const uint32_t u = __float_as_uint(x);
  p[i].bits = x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// --- the per-element update, in the order and roundings of adam_kernel_impl.h's update()

__device__ __forceinline__ void update(const Factors& f, float& p, float& m, float& v, float g) {
  g = __fmul_rn(__fmul_rn(g, f.grad_unscale), f.grad_clip);
  if (f.l2_decay) g = __fmaf_rn(p, f.weight_decay, g);
  if (f.decoupled_decay) p = __fmul_rn(p, f.decay_mul);
  const float diff = __fsub_rn(g, m);
  m = __fmaf_rn(f.lerp_coeff, diff, f.lerp_small ? m : g);
  v = __fmaf_rn(__fmul_rn(f.one_minus_beta2, g), g, __fmul_rn(v, f.beta2));
  const float denom = __fmaf_rn(__fsqrt_rn(v), f.inv_bc2_sqrt, f.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(f.neg_step_size, m), denom));
}

template <class P, class G, class M>
__global__ void __launch_bounds__(kThreads) step_dense(P* p, const G* g, M* m, M* v, int64_t n, Factors f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float pi = load(p, i), mi = load(m, i), vi = load(v, i);
    update(f, pi, mi, vi, load(g, i));
    store(p, i, pi);
    store(m, i, mi);
    store(v, i, vi);
  }
}

// The number of thresholds[1..255] that x reaches (x >= t): the nearest code, ties to the larger (QuantMap).
__device__ __forceinline__ uint8_t nearest_code(float x, const float* thresholds) {
  int lo = 1, hi = 256;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (x >= thresholds[mid]) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return static_cast<uint8_t>(lo - 1);
}

// Block-wide (max |x| over finite x, whether any x is not finite), every thread gets the result.
__device__ __forceinline__ void block_absmax(float& mx, bool& bad, float* s_max, int* s_bad) {
  for (int o = 16; o > 0; o >>= 1) {
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
  }
  bad = __any_sync(0xFFFFFFFFu, bad);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    s_max[warp] = mx;
    s_bad[warp] = bad;
  }
  __syncthreads();
  mx = 0.f;
  bad = false;
  for (int w = 0; w < kThreads / 32; ++w) {
    mx = fmaxf(mx, s_max[w]);
    bad = bad || s_bad[w] != 0;
  }
}

// absmax as adam_kernel_quant.h's quant_block: NaN if any element is NaN or inf (then every code is 0), else the
// largest |x|; codes of x / absmax (x / 1 for an all-zero block).
__device__ __forceinline__ float requantise(const float (&x)[kPerThread], int64_t base, int64_t n,
                                            const float* thresholds, uint8_t* codes, float* s_max, int* s_bad) {
  float mx = 0.f;
  bool bad = false;
  for (int j = 0; j < kPerThread; ++j) {
    bad = bad || !isfinite(x[j]);
    mx = fmaxf(mx, fabsf(x[j]));
  }
  block_absmax(mx, bad, s_max, s_bad);
  const float d = mx == 0.f ? 1.f : mx;
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = base + j * kThreads + threadIdx.x;
    if (i < n) codes[i] = bad ? uint8_t{0} : nearest_code(__fdiv_rn(x[j], d), thresholds);
  }
  return bad ? __int_as_float(0x7FC00000) : mx;
}

template <class P, class G>
__global__ void __launch_bounds__(kThreads) step_int8(P* p, const G* g, uint8_t* mq, uint8_t* vq, float* m_absmax,
                                                      float* v_absmax, int64_t n, Factors f, DeviceMaps maps) {
  __shared__ float s_mv[256], s_mt[256], s_vv[256], s_vt[256];
  __shared__ float s_max[2][kThreads / 32];
  __shared__ int s_bad[2][kThreads / 32];
  const int t = threadIdx.x;
  s_mv[t] = maps.signed_values[t];
  s_mt[t] = maps.signed_thresholds[t];
  s_vv[t] = maps.unsigned_values[t];
  s_vt[t] = maps.unsigned_thresholds[t];
  __syncthreads();
  const int64_t blk = blockIdx.x;
  const int64_t base = blk * kQuantBlock;
  const float ma = m_absmax[blk], va = v_absmax[blk];
  float m[kPerThread], v[kPerThread];
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = base + j * kThreads + t;
    m[j] = v[j] = 0.f;  // past n: zeros leave the absmax unchanged, as the CPU kernel's padding
    if (i < n) {
      float pi = load(p, i);
      m[j] = __fmul_rn(s_mv[mq[i]], ma);
      v[j] = __fmul_rn(s_vv[vq[i]], va);
      update(f, pi, m[j], v[j], load(g, i));
      store(p, i, pi);
    }
  }
  const float new_ma = requantise(m, base, n, s_mt, mq, s_max[0], s_bad[0]);
  const float new_va = requantise(v, base, n, s_vt, vq, s_max[1], s_bad[1]);
  if (t == 0) {
    m_absmax[blk] = new_ma;
    v_absmax[blk] = new_va;
  }
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65536 ? blocks : 65536);  // grid-stride beyond: enough to fill any GPU
}

template <class P, class G>
void launch_with(const Args& a, int64_t n, const DeviceMaps& maps, cudaStream_t s) {
  P* p = static_cast<P*>(a.param);
  const G* g = static_cast<const G*>(a.grad);
  switch (a.state_type) {
    case StateType::kFloat32:
      step_dense<P, G, float><<<grid_for(n), kThreads, 0, s>>>(p, g, static_cast<float*>(a.exp_avg),
                                                               static_cast<float*>(a.exp_avg_sq), n, a.f);
      return;
    case StateType::kBFloat16:
      step_dense<P, G, BF16><<<grid_for(n), kThreads, 0, s>>>(p, g, static_cast<BF16*>(a.exp_avg),
                                                              static_cast<BF16*>(a.exp_avg_sq), n, a.f);
      return;
    case StateType::kInt8:
      step_int8<P, G><<<static_cast<unsigned>((n + kQuantBlock - 1) / kQuantBlock), kThreads, 0, s>>>(
          p, g, static_cast<uint8_t*>(a.exp_avg), static_cast<uint8_t*>(a.exp_avg_sq), a.exp_avg_absmax,
          a.exp_avg_sq_absmax, n, a.f, maps);
      return;
  }
}

template <class P>
void launch_param(const Args& a, int64_t n, const DeviceMaps& maps, cudaStream_t s) {
  switch (a.grad_type) {
    case GradType::kBFloat16:
      return launch_with<P, BF16>(a, n, maps, s);
    case GradType::kFloat16:
      return launch_with<P, FP16>(a, n, maps, s);
    case GradType::kFloat32:
      return launch_with<P, float>(a, n, maps, s);
  }
}

}  // namespace

const char* run(const Args& args, int64_t n, const DeviceMaps& maps, void* stream) {
  if (n == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  if (args.param_type == ParamType::kBFloat16) {
    launch_param<BF16>(args, n, maps, s);
  } else {
    launch_param<float>(args, n, maps, s);
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace zeroshard::adam_kernel::cuda
