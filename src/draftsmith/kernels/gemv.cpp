// Few-row linears for memory-bound decoding and verification on x86-64 CPUs with AVX-512 or AVX2.
//
// y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]) for a few rows m (1 + K draft tokens per request).
// A decode step streams every weight once, so the kernel is a weight stream: W is packed once,
// at load, into blocks of BLOCK = 32 output columns, each block contiguous in memory:
//   float32:  [N/32][K][32]          (one k: 32 outputs, two 64-byte lines)
//   bfloat16: [N/32][K/2][32][2]     (one k pair: 32 outputs x 2 k, for vdpbf16ps)
// On AVX2 a block is two halves of 16 columns one after the other ([N/32][2][K][16], bfloat16
// [N/32][2][K/2][16][2]): its tiles are 16 columns wide, and each half is then one 64-byte line
// per k, read front to back (the interleaved order read every other line per pass and ran the
// 8-row verify ~1.5x slower from DRAM). The tensors' shapes are the same on both ISAs.
// Every thread reads one contiguous run of blocks front to back. Per block the rows of x are
// taken MT at a time (their sums in registers); the block, at most 32 x K x 4 bytes, stays in L2
// for the next MT rows. Each output is summed in the same k order whatever the number of rows, so
// a row's result does not depend on the batch it was computed in.
//
// On CPUs with AMX (Intel Sapphire Rapids and later) the bfloat16 linears run on the tile unit
// instead, for every number of rows: the same packed blocks are its B operand, and a verify block of
// 8-16 rows costs about what one row does (the AVX512-BF16 dot products made 16 rows ~1.9x one row on
// 2 such cores; see amx_ready, rows_bf16_amx).
//
// The rest (RMSNorm, attention of decode / verify steps, RoPE, SwiGLU) is written over V16 (simd.h:
// one zmm, or two ymm on AVX2), except the attention's inner loops: AVX2 keeps its sums within 16 ymm
// (key_pair, value_chain), AVX-512 widens bfloat16 values as 32-bit pairs (weighted_values' Pairs) and
// AVX512-BF16 takes the bfloat16 scores by vdpbf16ps (score_tile_dp) and, up to head_dim 128, the
// weighted values too (weighted_values_dp).
//
// Registered as torch.ops.draftsmith.{pack_f32, pack_bf16, gemv_f32, gemv_bf16, rms_norm, add_rms_norm,
// attention, attention_rows, rope, silu_mul, layer (a plain decoder layer's step in one call), argmax, lse_argmax, has_bf16, isa}; built on
// first use by kernels/build.py with -march=native.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define DS_AMX 1
#endif

namespace {

using v16::V16;

constexpr int64_t BLOCK = 32;
constexpr int64_t HALF = 16;  // AVX2: a block's two 16-column halves are stored one after the other

int64_t pad_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// A zeroed tensor for a packed weight. One of at least 2 MB lives in its own anonymous mapping, 2 MB
// aligned and marked for transparent huge pages (MADV_HUGEPAGE: where the kernel's THP setting is
// "madvise", the common default, malloc'd memory gets 4 KB pages). A decode step streams every weight
// once, so with 4 KB pages each 4 KB of weights costs a TLB miss; on 2 Zen 4 cores smollm2-135m's
// linears took 1-7% less time in float32 and 3-8% in bfloat16 at 1-16 rows, 3-16% at one thread
// (benchmarks/ab_linears.py; same bits). Elsewhere, or where mmap fails: at::zeros.
at::Tensor packed_zeros(at::IntArrayRef sizes, const at::TensorOptions& opt) {
#if defined(MADV_HUGEPAGE)
  constexpr size_t kHugePage = size_t(2) << 20;
  size_t bytes = at::elementSize(at::typeMetaToScalarType(opt.dtype()));
  for (const int64_t s : sizes) bytes *= static_cast<size_t>(s);
  if (bytes >= kHugePage) {
    const size_t len = pad_to(static_cast<int64_t>(bytes), 4096);
    void* raw = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {  // trimmed to [p, p + len), p 2 MB aligned
      const uintptr_t r = reinterpret_cast<uintptr_t>(raw), p = (r + kHugePage - 1) & ~(kHugePage - 1);
      if (p > r) munmap(raw, p - r);
      munmap(reinterpret_cast<void*>(p + len), r + len + kHugePage - (p + len));  // >= 4 KB: p - r < kHugePage
      void* ptr = reinterpret_cast<void*>(p);
      // advice only (without THP, or if it fails, the pages stay 4 KB, as before); the tail short of
      // a whole huge page stays on 4 KB pages either way (the mapping ends there)
      madvise(ptr, len / kHugePage * kHugePage, MADV_HUGEPAGE);
      return at::from_blob(ptr, sizes, [len](void* q) { munmap(q, len); }, opt);  // anonymous pages are zero
    }
  }
#endif
  return at::zeros(sizes, opt);
}

at::Tensor pack_f32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_f32: weight must be a 2-D float32 tensor");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = pad_to(N, BLOCK) / BLOCK;
  auto out = packed_zeros({NB, K, BLOCK}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < BLOCK && b * BLOCK + j < N; ++j) {
        const float* row = src + (b * BLOCK + j) * K;
#if defined(__AVX512F__)
        float* d = dst + b * K * BLOCK + j;
        for (int64_t k = 0; k < K; ++k) d[k * BLOCK] = row[k];
#else
        float* d = dst + b * K * BLOCK + (j / HALF) * K * HALF + j % HALF;
        for (int64_t k = 0; k < K; ++k) d[k * HALF] = row[k];
#endif
      }
  });
  return out;
}

// AMX (Intel Sapphire Rapids and later): the bfloat16 linears run on the tile unit, for every number
// of rows (so a row's result still does not depend on its batch). The OS must grant the process the
// tile state once (Linux >= 5.16: arch_prctl ARCH_REQ_XCOMP_PERM); where it does not, the AVX512-BF16
// tiles run instead.
constexpr int64_t AMX_PAIRS = 16;  // k pairs per tile step: one 64-byte tile row of bfloat16

bool amx_ready() {  // DRAFTSMITH_AMX=0 keeps the AVX512-BF16 tiles (a before / after, or a suspect tile unit)
#ifdef DS_AMX
  static const bool ok = [] {
    const char* env = std::getenv("DRAFTSMITH_AMX");
    if (env && std::string(env) == "0") return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// k pairs of a packed bfloat16 weight of K inputs: ceil(K / 2), whole tile steps on AMX (zero pairs)
int64_t bf16_pairs(int64_t K) { return amx_ready() ? pad_to(pad_to(K, 2) / 2, AMX_PAIRS) : pad_to(K, 2) / 2; }

at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16: weight must be a 2-D bfloat16 tensor");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = pad_to(N, BLOCK) / BLOCK, KP = bf16_pairs(K);
  auto out = packed_zeros({NB, KP, BLOCK, 2}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < BLOCK && b * BLOCK + j < N; ++j) {
        const uint16_t* row = src + (b * BLOCK + j) * K;
#if defined(__AVX512F__)
        uint16_t* d = dst + b * KP * BLOCK * 2 + j * 2;
        for (int64_t k = 0; k < K; ++k) d[(k / 2) * BLOCK * 2 + (k & 1)] = row[k];
#else
        uint16_t* d = dst + b * KP * BLOCK * 2 + (j / HALF) * KP * HALF * 2 + (j % HALF) * 2;
        for (int64_t k = 0; k < K; ++k) d[(k / 2) * HALF * 2 + (k & 1)] = row[k];
#endif
      }
  });
  return out;
}

// Store 32 fp32 sums (+ bias) of one block, tot[0..32), into y's row (float32, or rounded once to
// bfloat16), n0 = first column, n = valid columns.
template <typename O>
inline void store_row(O* y, const float* bias, int64_t n0, int64_t n, const float* tot) {
  V16 lo = v16::load(tot), hi = v16::load(tot + 16);
  if (bias) {
    alignas(64) float bb[BLOCK] = {0};
    std::memcpy(bb, bias + n0, n * sizeof(float));
    lo = v16::add(lo, v16::load(bb));
    hi = v16::add(hi, v16::load(bb + 16));
  }
  if constexpr (!std::is_same_v<O, float>) {
    alignas(32) uint16_t tmp[BLOCK];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), v16::to_bf16(lo));
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 16), v16::to_bf16(hi));
    std::memcpy(y + n0, tmp, n * sizeof(uint16_t));
  } else if (n == BLOCK) {
    v16::store(y + n0, lo);
    v16::store(y + n0 + 16, hi);
  } else {
    alignas(64) float tmp[BLOCK];
    v16::store(tmp, lo);
    v16::store(tmp + 16, hi);
    std::memcpy(y + n0, tmp, n * sizeof(float));
  }
}

// Sums run over chunks of KC steps of k in registers, each chunk then added to a running total
// (blocked summation: the rounding error of a 1,536-term dot product stays near the other
// backends' instead of growing with K). Every tile of a build sums an output in this same order.
constexpr int64_t KC = 32;
// bfloat16 k pairs per chunk. AVX512-BF16: 64 (8 KB of a block), so a tile's 2 x R loads, adds and
// stores of the running totals come once per 64 x 2 x R vdpbf16ps instead of per 16 x 2 x R. On one
// Zen 4 core (an ad-hoc probe: a 256 x 576 weight in L2) 81 vs 74 GMAC/s at 8 rows, 93 vs 81 at 16;
// smollm2-135m's linears at 2 threads (both with L2 prefetches) 0.94-1.05x at 8 rows, 0.93-0.94x at
// 16. Measured only there: it applies to every AVX512-BF16 build without AMX (Zen 5, Intel Cooper
// Lake) too. Without AVX512-BF16, KC / 2 pairs (their tiles widen the pairs to float32 FMAs).
#ifdef __AVX512BF16__
constexpr int64_t KP_CHUNK = 64;
#else
constexpr int64_t KP_CHUNK = KC / 2;
#endif

constexpr int64_t ROW_GROUP = 48;  // rows whose running totals live on the stack at once
constexpr int64_t PREFETCH_K = 128;  // k ahead in a block's stream (AVX-512: 16 KB; AVX2: 8 KB a half)
// The cache those prefetches fill. One to 3 rows: L1 (prefetcht0). From PREFETCH_L2_ROWS rows on a
// Zen 4 (DS_PREFETCH_L2: kernels/build.py sets it for AMD family 25 with AVX-512): L2 (prefetcht1).
// Into L1 each line held an L1 miss buffer for its whole trip from DRAM, and 16 KB ahead of a block
// shared the 32 KB L1 with the chunk being summed and x, so a few-row pass did not stream and
// compute at once. On 2 Zen 4 cores, smollm2-135m's linears against the L1 version
// (benchmarks/ab_linears.py, two runs, 2 threads; bfloat16 with KP_CHUNK's change too): float32
// 0.86-0.88 / 0.74-0.76 / 0.82-0.84x at 8 / 16 / 32 rows and 0.87 / 0.91 / 0.96x at 48 / 64 / 128
// (same bits), bfloat16 0.75-0.84 / 0.73-0.78 / 0.85-0.90x and 0.88 / 0.91 / 0.91x; an ad-hoc A/B
// of the prefetch alone: float32 1.04 / 0.73x at 8 / 16 rows, bfloat16 0.86 / 0.84x. Into L2 at one
// or two rows was 1.14-1.30x slower in float32 on one thread (a core alone waits on its loads); at 4
// rows the same as L1. Elsewhere always L1: as tuned on Intel and a Zen 5; on a Zen 3 L1 beat L2
// (BENCHMARKS.md, stop 26).
enum Prefetch : int { kNoPrefetch = 0, kPrefetchL1, kPrefetchL2 };
constexpr int64_t PREFETCH_L2_ROWS = 4;

inline Prefetch prefetch_for(int64_t rows) {
#ifdef DS_PREFETCH_L2
  if (rows >= PREFETCH_L2_ROWS) return kPrefetchL2;
#endif
  (void)rows;
  return kPrefetchL1;
}

inline void prefetch_line(const void* p, Prefetch pf) {
#ifdef DS_PREFETCH_L2
  if (pf == kPrefetchL2) {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
    return;
  }
#endif
  (void)pf;  // (elsewhere the loops compile to L1 prefetches alone, as before)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

#if defined(__AVX512F__)

// AVX-512: a tile is R <= 8 rows x the block's 32 columns, 2 x R zmm sums. A block's rows take
// ceil(M / 8) tiles; the loop runs chunk by chunk (rows_by_chunk: every tile of the rows over KC k,
// or KP_CHUNK bfloat16 pairs, while those 2 to 8 KB of the block are in L1), and the first tile
// over a chunk asks for the lines PREFETCH_K k ahead, one row included (without, one row relied on the hardware prefetcher: on an
// Intel Xeon (AVX-512 without BF16, 2 cores) smollm2-135m's linears at one row then took 13.2 vs
// 11.1 ms in bfloat16 and 19.7 vs 19.0 in float32; benchmarks/ab_linears.py, same bits). Tile after
// tile over the whole block (the first version) left DRAM idle while the later tiles re-read the
// block from L2: on 2 Zen 5 cores smollm2-135m's linears at 8 / 16 rows took 1.31 / 1.61x their
// one-row time in float32 and 1.32 / 1.53x in bfloat16; chunk by chunk 1.03 / 1.35x and 0.97 / 1.15x.
constexpr int MT_F32 = 8, MT_BF16 = 8;

// A chunk's register sums of R rows (32 columns each: lo, hi) added to their running totals.
template <int R>
inline void add_sums(float* tot, const __m512* lo, const __m512* hi) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* t = tot + r * BLOCK;
    _mm512_store_ps(t, _mm512_add_ps(_mm512_load_ps(t), lo[r]));
    _mm512_store_ps(t + 16, _mm512_add_ps(_mm512_load_ps(t + 16), hi[r]));
  }
}

// Chunk [k0, k1) of R rows (x rows K apart) over one block, added to tot (rows BLOCK apart).
template <int R>
inline void chunk_f32(const float* wb, const float* x, int64_t K, int64_t k0, int64_t k1, float* tot, Prefetch prefetch) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    if (prefetch) {
      prefetch_line(wb + (k + PREFETCH_K) * BLOCK, prefetch);
      prefetch_line(wb + (k + PREFETCH_K) * BLOCK + 16, prefetch);
    }
    const __m512 w0 = _mm512_load_ps(wb + k * BLOCK), w1 = _mm512_load_ps(wb + k * BLOCK + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      lo[r] = _mm512_fmadd_ps(w0, xv, lo[r]);
      hi[r] = _mm512_fmadd_ps(w1, xv, hi[r]);
    }
  }
  add_sums<R>(tot, lo, hi);
}

#ifdef __AVX512BF16__
// Pairs [p0, p1) of R bfloat16 rows (KP pairs each) over one block, added to tot.
template <int R>
inline void chunk_bf16(const uint16_t* wb, const uint16_t* x, int64_t KP, int64_t p0, int64_t p1, float* tot, Prefetch prefetch) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    if (prefetch) {
      prefetch_line(wb + (p + PREFETCH_K) * BLOCK * 2, prefetch);
      prefetch_line(wb + (p + PREFETCH_K) * BLOCK * 2 + 32, prefetch);
    }
    const __m512bh w0 = (__m512bh)_mm512_load_si512(wb + p * BLOCK * 2);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(wb + p * BLOCK * 2 + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * KP * 2 + p * 2, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      lo[r] = _mm512_dpbf16_ps(lo[r], w0, xv);
      hi[r] = _mm512_dpbf16_ps(hi[r], w1, xv);
    }
  }
  add_sums<R>(tot, lo, hi);
}
#else
// AVX-512 without AVX512-BF16 (Skylake-SP / Cascade Lake / Ice Lake servers, or a hypervisor that
// hides the flag): the same packed pairs, widened to float32 as they are read (a 32-bit lane of a
// pair holds the even k in its low 16 bits, the odd k in its high 16: a shift and a mask), and two
// FMAs per pair where vdpbf16ps does one; x comes as float32 (widened once per call, as on AVX2),
// so its values are FMA broadcast operands. The weights stream at half float32's bytes, which is
// what a memory-bound decode or few-row verify step pays for; the arithmetic is float32 (an
// output's sum order is the same whatever the number of rows, as everywhere here).
template <int R>
inline void chunk_bf16(const uint16_t* wb, const float* x, int64_t KP, int64_t p0, int64_t p1, float* tot, Prefetch prefetch) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = p0; p < p1; ++p) {
    if (prefetch) {
      prefetch_line(wb + (p + PREFETCH_K) * BLOCK * 2, prefetch);
      prefetch_line(wb + (p + PREFETCH_K) * BLOCK * 2 + 32, prefetch);
    }
    const __m512i w0 = _mm512_load_si512(wb + p * BLOCK * 2), w1 = _mm512_load_si512(wb + p * BLOCK * 2 + 32);
    const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), o0 = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)), o1 = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(x[r * KP * 2 + p * 2]), xo = _mm512_set1_ps(x[r * KP * 2 + p * 2 + 1]);
      lo[r] = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, lo[r]));
      hi[r] = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, hi[r]));
    }
  }
  add_sums<R>(tot, lo, hi);
}
#endif

#else  // AVX2 + FMA: 16 ymm registers

// A tile is R rows x one or both 16-column halves of the block (2 or 4 8-column vectors): both for
// up to 2 rows (4R sums); beyond, float32 takes one half at a time, up to 8 rows, and bfloat16 the
// whole block 2 rows at a time (MT_BF16 = 2). An 8-row half tile has 16 sums, as many as there
// are ymm registers (the compiler takes some operands from L1), and is still faster than two
// tiles: with at most 6 rows a tile (the version before) 7 and 8 rows took two per half (4 + 3,
// 4 + 4). Zen 3, smollm2-135m's linears, 2 threads, the two builds in one process
// (benchmarks/ab_linears.py): 7 rows 31.8 -> 27.4 ms, 8 rows 35.6 -> 29.0 (one row 22.3); 1-6 and
// 16 rows unchanged. 7 and 8 rows are a batch-1 verify of 6 and 7 drafts.
// 16 registers hold few sums, so a block's rows take several tiles; to keep the weights in L1 for
// all of them, the loop runs chunk by chunk (KC k at a time: 2 KB of a float32 half), every tile of
// the rows over one chunk before the next (rows_by_chunk), and the first tile over a chunk asks for
// the lines PREFETCH_K k ahead in each half it reads (the hardware prefetcher alone left the 8-row
// pass waiting on DRAM). An output's sum is the same whatever the tile.
// bfloat16 widens each weight vector once per tile: 4 rows x a half (the version before) widened a
// block's vectors twice per 8 rows and ran 2 x 2 dependent FMAs per vector and k pair; 2 rows x the
// block keeps 8 independent sums. Zen 3, smollm2-135m's linears (30 layers + lm_head), the two builds
// in one process: 8 rows 62 -> 46 ms at 1 thread, 35 -> 25 at 2; 16 rows 121 -> 85, 63 -> 45; one
// row unchanged. The same tiles in float32 were no faster at 8 rows and slower from 16 (99 vs 76 ms).
constexpr int MT_F32 = 8, MT_BF16 = 2;

// Chunk [k0, k1) of R rows x H halves (from the half at wh; the next half K * HALF floats on), added
// to tot (rows BLOCK apart; the half's columns at tot + HALF * h of the first half's).
template <int R, int H>
inline void chunk_f32(const float* wh, const float* x, int64_t K, int64_t k0, int64_t k1, float* tot, Prefetch prefetch) {
  constexpr int C = 2 * H;
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    if (prefetch)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) prefetch_line(wh + h * K * HALF + (k + PREFETCH_K) * HALF, prefetch);
    __m256 w[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) w[c] = _mm256_load_ps(wh + (c / 2) * K * HALF + k * HALF + 8 * (c % 2));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(w[c], xv, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      float* t = tot + r * BLOCK + 8 * c;
      _mm256_store_ps(t, _mm256_add_ps(_mm256_load_ps(t), acc[r][c]));
    }
}

// bfloat16: one 32-byte load is 8 columns x a k pair; the even k are the low 16 bits of each 32-bit
// lane, the odd the high. x: float32 rows of 2 x KP values (widened once per call); p = k pairs, a
// half's pair p one 64-byte line at wh + p * HALF * 2, the next half KP * HALF * 2 values on.
template <int R, int H>
inline void chunk_bf16(const uint16_t* wh, const float* x, int64_t KP, int64_t p0, int64_t p1, float* tot, Prefetch prefetch) {
  constexpr int C = 2 * H;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    if (prefetch)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h)
        prefetch_line(wh + h * KP * HALF * 2 + (p + PREFETCH_K) * HALF * 2, prefetch);
    __m256 xe[R], xo[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      xe[r] = _mm256_broadcast_ss(x + r * KP * 2 + 2 * p);
      xo[r] = _mm256_broadcast_ss(x + r * KP * 2 + 2 * p + 1);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256i raw = _mm256_load_si256(
          reinterpret_cast<const __m256i*>(wh + (c / 2) * KP * HALF * 2 + p * HALF * 2 + 16 * (c % 2)));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wo, xo[r], _mm256_fmadd_ps(we, xe[r], acc[r][c]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      float* t = tot + r * BLOCK + 8 * c;
      _mm256_store_ps(t, _mm256_add_ps(_mm256_load_ps(t), acc[r][c]));
    }
}

#endif

// f(first row, rows as an integral_constant) over tiles of MT rows, then one tile of the rest.
template <int R, typename F>
inline void rest_rows(int64_t left, int64_t m, F& f) {
  if constexpr (R > 0) {
    if (left == R) f(m, std::integral_constant<int, R>{});
    else rest_rows<R - 1>(left, m, f);
  }
}

template <int MT, typename F>
inline void by_rows(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) f(m, std::integral_constant<int, MT>{});
  rest_rows<MT - 1>(M - m, m, f);
}

#if !defined(__AVX512F__)
// Tiles as even as they come (not 6 + 2: a 2-row tile of one half has 4 sums, too few to cover the
// FMA latency): up to MT rows in one tile; more rows in tiles of at most 6 (12 sums, 2 weight vectors
// and a broadcast fit the 16 registers; an 8-row tile spills 3 of its 16 sums to the stack, which
// pays only where it saves a second pass over the chunk). Zen 3, smollm2-135m's linears, 2 threads,
// benchmarks/ab_linears.py (two runs): 24 rows 0.86 / 0.91x of before (8 + 8 + 8 -> 6 x 4), 48 rows
// 0.88 / 0.88x, 16 rows 0.98 / 0.96x (8 + 8 -> 6 + 5 + 5), 32 rows 1.04 / 0.93x; up to 8 rows the
// same tiles. f(first row, rows as an integral_constant).
template <int MT, typename F>
inline void by_even_rows(int64_t M, F&& f) {
  constexpr int64_t W = MT < 6 ? MT : 6;  // the widest tile once the rows need more than one
  const int64_t tiles = M <= MT ? 1 : (M + W - 1) / W;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t r = M / tiles + (t < M % tiles ? 1 : 0);
    rest_rows<MT>(r, m, f);
    m += r;
  }
}
#endif

// All M rows of x through one block, ROW_GROUP rows at a time: per chunk of k, every row tile.
// S = k steps per chunk (KC k of float32, KP_CHUNK pairs of bfloat16); tile(R, H, m, half, s0, s1,
// tot, prefetch) sums rows m.. over steps [s0, s1) into tot (AVX2: of H halves from `half`; AVX-512:
// H = 2, the whole block, half 0). The first tile over a chunk prefetches, into the cache prefetch_for(M) picks.
template <int MT, typename O, typename Tile>
inline void rows_by_chunk(int64_t steps, int64_t S, int64_t M, O* y, int64_t ldy, const float* bias, int64_t n0,
                          int64_t n, Tile&& tile) {
  alignas(64) float tot[ROW_GROUP][BLOCK];
  for (int64_t g0 = 0; g0 < M; g0 += ROW_GROUP) {
    const int64_t mg = std::min(ROW_GROUP, M - g0);
    std::memset(tot, 0, sizeof(float) * BLOCK * mg);
    for (int64_t s0 = 0; s0 < steps; s0 += S) {
      const int64_t s1 = std::min(steps, s0 + S);
#if defined(__AVX512F__)
      Prefetch first = prefetch_for(M);
      by_rows<MT>(mg, [&](int64_t m, auto R) {
        tile(R, std::integral_constant<int, 2>{}, g0 + m, 0, s0, s1, tot[m], first);
        first = kNoPrefetch;
      });
#else
      if (MT == 2 || mg <= 2) {  // both halves in one tile, 2 rows at a time
        Prefetch first = prefetch_for(M);
        by_rows<2>(mg, [&](int64_t m, auto R) {
          tile(R, std::integral_constant<int, 2>{}, g0 + m, 0, s0, s1, tot[m], first);
          first = kNoPrefetch;
        });
        continue;
      }
      for (int h = 0; h < 2; ++h) {
        Prefetch first = prefetch_for(M);
        by_even_rows<MT>(mg, [&](int64_t m, auto R) {
          tile(R, std::integral_constant<int, 1>{}, g0 + m, h, s0, s1, tot[m] + HALF * h, first);
          first = kNoPrefetch;
        });
      }
#endif
    }
    for (int64_t m = 0; m < mg; ++m) store_row(y + (g0 + m) * ldy, bias, n0, n, tot[m]);
  }
}

#if defined(__AVX512F__)

template <typename O>
inline void rows_f32(const float* wb, const float* x, int64_t K, int64_t M, O* y, int64_t ldy, const float* bias,
                     int64_t n0, int64_t n) {
  rows_by_chunk<MT_F32>(K, KC, M, y, ldy, bias, n0, n, [&](auto R, auto, int64_t m, int, int64_t k0, int64_t k1, float* t, Prefetch pf) {
    chunk_f32<decltype(R)::value>(wb, x + m * K, K, k0, k1, t, pf);
  });
}

template <typename O, typename X>  // X: uint16_t (bfloat16 x, AVX512-BF16) or float (x widened, without it)
inline void rows_bf16(const uint16_t* wb, const X* x, int64_t KP, int64_t M, O* y, int64_t ldy,
                      const float* bias, int64_t n0, int64_t n) {
  rows_by_chunk<MT_BF16>(KP, KP_CHUNK, M, y, ldy, bias, n0, n,
                         [&](auto R, auto, int64_t m, int, int64_t p0, int64_t p1, float* t, Prefetch pf) {
                           chunk_bf16<decltype(R)::value>(wb, x + m * KP * 2, KP, p0, p1, t, pf);
                         });
}

#ifdef DS_AMX
// The tile configuration of R <= 16 rows: tiles 0 / 1 = the fp32 sums of the block's columns 0-15 /
// 16-31 (R rows x 64 bytes), 2 = R rows of x over 16 k pairs, 3 / 4 = the block's 16 pairs of
// columns 0-15 / 16-31 (the packed [KP][32][2] layout is the tile unit's pair-interleaved B layout:
// 16 rows of 64 bytes, 128 bytes apart). Per thread: each parallel task loads it.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t R) {
    for (int t : {0, 1, 2}) rows[t] = static_cast<uint8_t>(R), colsb[t] = 64;
    for (int t : {3, 4}) rows[t] = AMX_PAIRS, colsb[t] = 64;
  }
};

// All M rows of x (padded with zero rows to a multiple of R; KP pairs each) through one block: per
// tile of R rows, two R x 16 fp32 accumulators over every k pair in order, then stored (+ bias).
template <typename O>
inline void rows_bf16_amx(const uint16_t* wb, const uint16_t* x, int64_t KP, int64_t M, int64_t R, O* y, int64_t ldy,
                          const float* bias, int64_t n0, int64_t n) {
  alignas(64) float tot[AMX_PAIRS][BLOCK];
  for (int64_t m0 = 0; m0 < M; m0 += R) {
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t* xr = x + m0 * KP * 2;
    for (int64_t p = 0; p < KP; p += AMX_PAIRS) {
      const char* ahead = reinterpret_cast<const char*>(wb + (p + PREFETCH_K) * BLOCK * 2);
#pragma GCC unroll 32
      for (int l = 0; l < 32; ++l) _mm_prefetch(ahead + l * 64, _MM_HINT_T0);  // the 2 KB of a step, PREFETCH_K pairs ahead
      _tile_loadd(2, xr + p * 2, KP * 4);
      _tile_loadd(3, wb + p * BLOCK * 2, BLOCK * 4);
      _tile_loadd(4, wb + p * BLOCK * 2 + 32, BLOCK * 4);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, tot[0], BLOCK * 4);
    _tile_stored(1, tot[0] + 16, BLOCK * 4);
    for (int64_t m = 0; m < R && m0 + m < M; ++m) store_row(y + (m0 + m) * ldy, bias, n0, n, tot[m]);
  }
}
#endif

#else

template <typename O>
inline void rows_f32(const float* wb, const float* x, int64_t K, int64_t M, O* y, int64_t ldy, const float* bias,
                     int64_t n0, int64_t n) {
  rows_by_chunk<MT_F32>(K, KC, M, y, ldy, bias, n0, n,
                        [&](auto R, auto H, int64_t m, int h, int64_t k0, int64_t k1, float* t, Prefetch pf) {
                          chunk_f32<decltype(R)::value, decltype(H)::value>(wb + h * K * HALF, x + m * K, K, k0, k1, t, pf);
                        });
}

template <typename O>
inline void rows_bf16(const uint16_t* wb, const float* x, int64_t KP, int64_t M, O* y, int64_t ldy, const float* bias,
                      int64_t n0, int64_t n) {
  rows_by_chunk<MT_BF16>(KP, KP_CHUNK, M, y, ldy, bias, n0, n,
                         [&](auto R, auto H, int64_t m, int h, int64_t p0, int64_t p1, float* t, Prefetch pf) {
                           chunk_bf16<decltype(R)::value, decltype(H)::value>(wb + h * KP * HALF * 2, x + m * KP * 2, KP,
                                                                              p0, p1, t, pf);
                         });
}

#endif

// Grain: blocks per task, so that a thread's share is at least ~64 KB of weight (fork cost).
int64_t grain(int64_t bytes_per_block) { return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, bytes_per_block)); }

// Every block of 32 output columns, the blocks split over torch's threads: f(block, first column, columns).
template <typename F>
void over_blocks(int64_t NB, int64_t N, int64_t bytes_per_block, F&& f) {
  at::parallel_for(0, NB, grain(bytes_per_block), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK;
      f(b, n0, std::min<int64_t>(BLOCK, N - n0));
    }
  });
}

// The bias as float32 (kept alive by `keep`), or nullptr.
const float* bias_f32(const std::optional<at::Tensor>& bias, at::Tensor& keep) {
  if (!bias || !bias->defined()) return nullptr;
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& wp, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat && wp.dim() == 3,
              "gemv_f32: float32 input and a pack_f32 weight expected");
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu(), "gemv_f32: CPU tensors expected");
  TORCH_CHECK(wp.is_contiguous() && wp.size(2) == BLOCK, "gemv_f32: a pack_f32 weight expected");
  const int64_t K = wp.size(1), NB = wp.size(0);
  TORCH_CHECK(N > (NB - 1) * BLOCK && N <= NB * BLOCK, "gemv_f32: ", N, " outputs do not fit ", NB, " blocks");
  TORCH_CHECK(!bias || !bias->defined() || (bias->numel() == N && bias->device().is_cpu()),
              "gemv_f32: a CPU bias of ", N, " values expected");
  TORCH_CHECK(x.size(-1) == K, "gemv_f32: input has ", x.size(-1), " features, the weight ", K);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::Tensor bc;
  const float* bp = bias_f32(bias, bc);
  over_blocks(NB, N, K * BLOCK * 4, [&](int64_t b, int64_t n0, int64_t n) {
    rows_f32(w + b * K * BLOCK, xp, K, M, yp, N, bp, n0, n);
  });
  return y.view(sizes);
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& wp, int64_t N, int64_t K, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(wp.scalar_type() == at::kBFloat16 && wp.dim() == 4, "gemv_bf16: a pack_bf16 weight expected");
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu(), "gemv_bf16: CPU tensors expected");
  TORCH_CHECK(wp.is_contiguous() && wp.size(2) == BLOCK && wp.size(3) == 2, "gemv_bf16: a pack_bf16 weight expected");
  const int64_t NB = wp.size(0), KP = wp.size(1);
  TORCH_CHECK(N > (NB - 1) * BLOCK && N <= NB * BLOCK && bf16_pairs(K) == KP, "gemv_bf16: [", N, ", ", K,
              "] does not fit the packed weight");
  TORCH_CHECK(!bias || !bias->defined() || (bias->numel() == N && bias->device().is_cpu()),
              "gemv_bf16: a CPU bias of ", N, " values expected");
  TORCH_CHECK(x.size(-1) == K, "gemv_bf16: input has ", x.size(-1), " features, the weight ", K);
  const bool direct = x.scalar_type() == at::kBFloat16;  // bfloat16 in: the sums rounded to bfloat16 in the store
  auto x2 = x.reshape({-1, K});
  if (!direct) x2 = x2.to(at::kBFloat16);
  if (KP * 2 != K) x2 = at::constant_pad_nd(x2, {0, KP * 2 - K});
  x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options().dtype(direct ? at::kBFloat16 : at::kFloat));
#if defined(__AVX512BF16__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr());
#else
  auto xf = x2.to(at::kFloat);  // exact: the tiles without AVX512-BF16 multiply in float32
  const float* xp = xf.data_ptr<float>();
#endif
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  at::Tensor bc;
  const float* bp = bias_f32(bias, bc);
  auto run = [&](auto* yp) {
    using O = std::remove_pointer_t<decltype(yp)>;
#ifdef DS_AMX
    if (amx_ready() && M > 0) {
      const int64_t R = std::min<int64_t>(M, AMX_PAIRS);  // rows per tile; x padded to whole tiles
      const at::Tensor xpad = M % R ? at::constant_pad_nd(x2, {0, 0, 0, R - M % R}) : x2;
      const uint16_t* xa = reinterpret_cast<const uint16_t*>(xpad.data_ptr());
      at::parallel_for(0, NB, grain(KP * BLOCK * 4), [&](int64_t b0, int64_t b1) {
        const TileConfig cfg(R);
        _tile_loadconfig(&cfg);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * BLOCK;
          rows_bf16_amx(w + b * KP * BLOCK * 2, xa, KP, M, R, yp, N, bp, n0, std::min<int64_t>(BLOCK, N - n0));
        }
      });
      return;
    }
#endif
    over_blocks(NB, N, KP * BLOCK * 4, [&](int64_t b, int64_t n0, int64_t n) {
      rows_bf16(w + b * KP * BLOCK * 2, xp, KP, M, yp, N, bp, n0, n);
    });
  };
  if (direct) {
    run(reinterpret_cast<uint16_t*>(y.data_ptr()));
    return y.view(sizes);
  }
  run(y.data_ptr<float>());
  return y.view(sizes).to(x.scalar_type());
}

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

inline void store16(float* p, V16 v) { v16::store(p, v); }
inline void store16(uint16_t* p, V16 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v16::to_bf16(v)); }

// HF's RMSNorm for decode / verify steps, one pass per row instead of torch's composite:
// float32: y = w * (x * r); bfloat16: y = bf16(w * bf16(x * r)) (normalised in float32, rounded,
// then scaled), r = 1 / sqrt(mean(x^2) + eps) in float32. xr: the row in float32.
inline void norm_row(const float* xr, const at::Tensor& wc, bool bf16, int64_t H, float eps, void* out) {
  V16 acc = v16::zero();
  int64_t h = 0;
  for (; h + 16 <= H; h += 16) {
    const V16 v = v16::load(xr + h);
    acc = v16::fmadd(v, v, acc);
  }
  float ss = v16::reduce_add(acc);
  for (; h < H; ++h) ss += xr[h] * xr[h];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  if (bf16) {  // vector and scalar roundings are the same (to nearest even, NaN -> 0x7FC0)
    const uint16_t* wr = reinterpret_cast<const uint16_t*>(wc.data_ptr());
    uint16_t* yr = static_cast<uint16_t*>(out);
    const V16 iv = v16::set1(inv);
    for (h = 0; h + 16 <= H; h += 16)
      store16(yr + h, v16::mul(v16::load(wr + h), v16::round_bf16(v16::mul(v16::load(xr + h), iv))));
    for (; h < H; ++h) yr[h] = f32_to_bf16(bf16_to_f32(wr[h]) * bf16_to_f32(f32_to_bf16(xr[h] * inv)));
  } else {
    const float* wr = wc.data_ptr<float>();
    float* yr = static_cast<float*>(out);
    for (h = 0; h < H; ++h) yr[h] = wr[h] * (xr[h] * inv);
  }
}

// The residual add before a norm too (add_rms_norm): s = x + a rounded to the dtype, y = rms_norm(s).
std::vector<at::Tensor> norm_impl(const at::Tensor& x, const at::Tensor* a, const at::Tensor& w, double eps,
                                  const char* name) {
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H && w.scalar_type() == x.scalar_type(), name, ": weight [", H,
              "] of the input's dtype expected");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, name, ": float32 or bfloat16 input expected");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), name, ": CPU tensors expected");
  TORCH_CHECK(!a || (a->sizes() == x.sizes() && a->scalar_type() == x.scalar_type() && a->device().is_cpu()), name,
              ": the residual and the addend must have one shape and dtype");
  auto xc = x.contiguous();
  auto ac = a ? a->contiguous() : at::Tensor();
  auto wc = w.contiguous();
  auto y = at::empty_like(xc);
  auto s = a ? at::empty_like(xc) : at::Tensor();
  const int64_t rows = H ? xc.numel() / H : 0, es = xc.element_size();
  const float eps_f = static_cast<float>(eps);
  const char* xp = static_cast<const char*>(xc.data_ptr());
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(H, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(bf16 || a ? H : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr;
      if (a && bf16) {
        const uint16_t* x0 = reinterpret_cast<const uint16_t*>(xp) + r * H;
        const uint16_t* a0 = reinterpret_cast<const uint16_t*>(ac.data_ptr()) + r * H;
        uint16_t* s0 = reinterpret_cast<uint16_t*>(s.data_ptr()) + r * H;
        int64_t h = 0;
        for (; h + 16 <= H; h += 16) {
          const V16 sv = v16::add(v16::load(x0 + h), v16::load(a0 + h));
          store16(s0 + h, sv);
          v16::store(buf.data() + h, v16::round_bf16(sv));
        }
        for (; h < H; ++h) {
          s0[h] = f32_to_bf16(bf16_to_f32(x0[h]) + bf16_to_f32(a0[h]));
          buf[h] = bf16_to_f32(s0[h]);
        }
        xr = buf.data();
      } else if (a) {
        const float* x0 = reinterpret_cast<const float*>(xp) + r * H;
        const float* a0 = ac.data_ptr<float>() + r * H;
        float* s0 = s.data_ptr<float>() + r * H;
        for (int64_t h = 0; h < H; ++h) s0[h] = x0[h] + a0[h];
        xr = s0;
      } else if (bf16) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(xp) + r * H;
        int64_t h = 0;
        for (; h + 16 <= H; h += 16) v16::store(buf.data() + h, v16::load(src + h));
        for (; h < H; ++h) buf[h] = bf16_to_f32(src[h]);
        xr = buf.data();
      } else {
        xr = reinterpret_cast<const float*>(xp) + r * H;
      }
      norm_row(xr, wc, bf16, H, eps_f, static_cast<char*>(y.data_ptr()) + r * H * es);
    }
  });
  if (!a) return {y.view(x.sizes())};
  return {s.view(x.sizes()), y.view(x.sizes())};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return norm_impl(x, nullptr, w, eps, "rms_norm")[0];
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& a, const at::Tensor& w,
                                                double eps) {
  auto r = norm_impl(x, &a, w, eps, "add_rms_norm");
  return {r[0], r[1]};
}

// ---- attention of a decode / verify step over the KV cache ----------------------------------
// out[b, s, h] = softmax_j(scale * q[b, h, s] . k[b, h / G, j]) v[b, h / G, j] over the keys j the
// query sees (causal: j <= T - S + s; a bool mask [B or 1, 1, S, T]: where it is true). Each query
// is computed on its own with the same order of operations whatever S is, so a verify block's
// attention equals that of decoding its tokens one by one (torch's SDPA blocks by query length).
// Scores, softmax and the weighted sum in float32; the output rounded once to the input dtype (on
// AVX512-BF16 the bfloat16 weighted sums take the softmax numerators rounded to bfloat16: weighted_values_dp).

// exp for x <= 0 (softmax after subtracting the max): 2^n * p(r), |r| <= ln2 / 2, degree-7 Taylor
// polynomial (relative error < 3e-8 before rounding); x < -87 gives 0.
inline V16 exp_nonpositive(V16 x) {
  const V16 tiny = v16::set1(-87.0f);
  const V16 xc = v16::max(x, tiny);
  const V16 n = v16::round_nearest(v16::mul(xc, v16::set1(1.44269504088896341f)));
  V16 r = v16::fnmadd(n, v16::set1(0.693145751953125f), xc);
  r = v16::fnmadd(n, v16::set1(1.428606765330187045e-06f), r);
  V16 p = v16::set1(1.0f / 5040);
  p = v16::fmadd(p, r, v16::set1(1.0f / 720));
  p = v16::fmadd(p, r, v16::set1(1.0f / 120));
  p = v16::fmadd(p, r, v16::set1(1.0f / 24));
  p = v16::fmadd(p, r, v16::set1(1.0f / 6));
  p = v16::fmadd(p, r, v16::set1(0.5f));
  p = v16::fmadd(p, r, v16::set1(1.0f));
  p = v16::fmadd(p, r, v16::set1(1.0f));
  return v16::zero_where_less(v16::scale2(p, n), x, tiny);
}

// The queries of one (batch row, kv head) read the same keys and values: G heads x S queries of a
// step. They are attended together, QC query rows a task: the scores key tile by key tile (16 keys,
// in L1, for every query row), then each row's softmax, then the weighted sums of values QT rows at
// a time (each value row loaded once for QT rows). A query row's arithmetic is the same whatever
// the rows beside it (the order of every sum is fixed), so a verify block equals decoding its tokens
// one by one. bfloat16 keys and values are widened as they are read (converting a group's once per
// task cost more), values as 32-bit pairs on AVX-512; on AVX512-BF16 the scores are vdpbf16ps dot
// products of the bfloat16 rows themselves (score_tile_dp: subnormal bfloat16 inputs count as zero
// there), and so are the weighted sums of values up to head_dim 128 (weighted_values_dp: key pairs
// against the softmax numerators rounded to bfloat16). Against one query head and query a task (the first version), on 2 Zen 5 cores and 216
// keys: a 16-token verify's attention 47 vs 80 us a layer in float32, 51 vs 114 in bfloat16.

// Scores of keys [j0, j0 + nj) (nj <= 16) for one query row qv, fixed tree, into sc + j0.
#if defined(__AVX512F__)
template <int DV, typename E>
inline void score_tile(const V16* qv, const E* kb, int64_t kst, int64_t j0, int64_t nj, float* sc) {
  V16 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i < nj) {
      const E* kr = kb + (j0 + i) * kst;
      a[i] = v16::mul(qv[0], v16::load(kr));
#pragma GCC unroll 16
      for (int d = 1; d < DV; ++d) a[i] = v16::fmadd(qv[d], v16::load(kr + d * 16), a[i]);
    } else {
      a[i] = v16::zero();
    }
  }
  v16::store_first(sc + j0, v16::hsum16(a), nj);
}

#if defined(__AVX512BF16__)
// bfloat16 q and keys on a CPU with AVX512-BF16 (even head_dim / 16): a key's products by vdpbf16ps,
// dimensions in pairs, straight from the bfloat16 rows (half the instructions of widening and FMAs),
// the tile's 16 sums by hsum16, then scaled: scale * (q . k) where score_tile has (scale * q) . k.
// The step attention with it against score_tile (keys widened per row below kWidenTileRows rows, per
// tile from there), on 2 Zen 4 cores at smollm2's shapes over ~200 keys (an ad-hoc A/B of the two
// builds, stop 65, one run): 1 / 8 / 16 queries 0.79-0.85 / 0.83-0.86 / 0.77-0.86x; with the values as
// pairs too, benchmarks/ab_attention.py (30 layers, two runs): 0.84-0.93 / 0.70-0.75 / 0.73-0.77x.
struct BH {  // 32 bfloat16 (16 pairs) for vdpbf16ps; a struct, as V16 is, to be a std::vector element
  __m512bh v;
};

template <int DV>
inline void score_tile_dp(const BH* qv, const uint16_t* kb, int64_t kst, int64_t j0, int64_t nj, float scale,
                          float* sc) {
  V16 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i < nj) {
      const uint16_t* kr = kb + (j0 + i) * kst;
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0].v, (__m512bh)_mm512_loadu_si512(kr));
#pragma GCC unroll 8
      for (int d = 1; d < DV / 2; ++d) s = _mm512_dpbf16_ps(s, qv[d].v, (__m512bh)_mm512_loadu_si512(kr + d * 32));
      a[i] = {s};
    } else {
      a[i] = v16::zero();
    }
  }
  v16::store_first(sc + j0, v16::mul(v16::hsum16(a), v16::set1(scale)), nj);
}

// The weighted sums of bfloat16 values by vdpbf16ps (AVX512-BF16, even head_dim / 16, head_dim <= 128),
// keys in pairs: the numerators as bfloat16 (row r at pb + r * pst, zero past hi[r] and under a mask; the softmax
// itself and its denominator l[r] stay float32, as in torch's bfloat16 attention), the values of keys
// j and j + 1 interleaved (unpacklo / unpackhi: 16 (v_j, v_j+1) pairs of dimensions a vector), one
// vdpbf16ps per 16 dimensions, row and key pair where the Pairs path takes two FMAs (one per key). A
// row's sums go over its key pairs in order whatever the rows beside it; a pair no row of the pass
// weights is skipped, a key none weights is read as zeros (no load; and key j + 1 may be past the
// cache's end when j is its last), and a row that weights one key of a pair takes the other's values
// as zeros (an unwritten slot may hold NaN, one another row sees may be non-finite): each leaves every
// row's sums as they are (+0 for a zero weight), so a row reads nothing it does not see, as the Pairs
// path, which skips zero weights row by row. acc[r][2c]
// holds chunk c's dimensions 8L + 0..3 of each 128-bit lane L, acc[r][2c + 1] 8L + 4..7; put back in
// order at the end.
template <int DV, int R, typename O>
inline void weighted_values_dp(const uint16_t* vb, int64_t vst, const uint16_t* pb, int64_t pst, const int64_t* hi,
                               const float* l, O* const* orow) {
  static_assert(DV % 2 == 0 && DV <= 8, "weighted_values_dp: even head_dim / 16, at most 128");
  alignas(64) static const uint16_t zeros[DV * 16] = {};
  __m512 acc[R][DV];
  int64_t hmax = 0;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    hmax = std::max(hmax, hi[r]);
#pragma GCC unroll 8
    for (int d = 0; d < DV; ++d) acc[r][d] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < hmax; j += 2) {
    uint32_t w[R], any = 0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      std::memcpy(&w[r], pb + r * pst + j, 4);
      any |= w[r];
    }
    if (any == 0) continue;
    const uint16_t* v0 = (any & 0xFFFFu) ? vb + j * vst : zeros;
    const uint16_t* v1 = (any >> 16) ? vb + (j + 1) * vst : zeros;
    __m512i vv[DV];
#pragma GCC unroll 4
    for (int c = 0; c < DV / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + c * 32), b = _mm512_loadu_si512(v1 + c * 32);
      vv[2 * c] = _mm512_unpacklo_epi16(a, b);
      vv[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (w[r] == 0) continue;
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[r]));
      if ((w[r] & 0xFFFFu) && (w[r] >> 16)) {
#pragma GCC unroll 8
        for (int d = 0; d < DV; ++d) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], (__m512bh)vv[d], pv);
      } else {  // one key of the pair: the other's values as zeros (even 16-bit lanes hold key j)
        const __mmask32 keep = (w[r] & 0xFFFFu) ? 0x55555555u : 0xAAAAAAAAu;
#pragma GCC unroll 8
        for (int d = 0; d < DV; ++d)
          acc[r][d] = _mm512_dpbf16_ps(acc[r][d], (__m512bh)_mm512_maskz_mov_epi16(keep, vv[d]), pv);
      }
    }
  }
  const __m512i perm_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i perm_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (l[r] == 0.0f) {  // no key visible: zeros, not NaN
      std::memset(orow[r], 0, DV * 16 * sizeof(O));
      continue;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
#pragma GCC unroll 4
    for (int c = 0; c < DV / 2; ++c) {
      const __m512 a = _mm512_mul_ps(acc[r][2 * c], inv), b = _mm512_mul_ps(acc[r][2 * c + 1], inv);
      store16(orow[r] + c * 32, V16{_mm512_permutex2var_ps(a, perm_lo, b)});
      store16(orow[r] + c * 32 + 16, V16{_mm512_permutex2var_ps(a, perm_hi, b)});
    }
  }
}
#endif

#else
// AVX2: the same sums (per key: both 8-lane halves over d, the halves added, then hsum8's tree over
// 8 keys), two keys at a time into the tree, so that a tile's 16 keys never hold 32 ymm at once (the
// loop above spilled its sums to the stack). With weighted_values_rows below, Zen 3, 2 threads, 9
// heads / 3 kv heads of 64 (benchmarks/ab_attention.py, the builds A/B in one process, same bits):
// float32, 8 tokens over 300 cached 0.69-0.81x of before in 3 of 4 runs (one 1.12x, a noisy VM),
// over 800 0.82x; 16 tokens 0.79-0.82x; bfloat16 0.79-0.90x; one token 0.90-0.95x.
template <int DV, typename E>
inline __m256 key_sum(const V16* qv, const E* kr) {
  V16 a = v16::mul(qv[0], v16::load(kr));
#pragma GCC unroll 16
  for (int d = 1; d < DV; ++d) a = v16::fmadd(qv[d], v16::load(kr + d * 16), a);
  return _mm256_add_ps(a.a, a.b);
}

template <int DV, typename E>
inline __m256 key_pair(const V16* qv, const E* kb, int64_t kst, int64_t i, int64_t nj) {
  const __m256 z = _mm256_setzero_ps();
  const __m256 s0 = i < nj ? key_sum<DV>(qv, kb + i * kst) : z;
  const __m256 s1 = i + 1 < nj ? key_sum<DV>(qv, kb + (i + 1) * kst) : z;
  return _mm256_hadd_ps(s0, s1);
}

template <int DV, typename E>
inline void score_tile(const V16* qv, const E* kb, int64_t kst, int64_t j0, int64_t nj, float* sc) {
  const E* k0 = kb + j0 * kst;
  for (int64_t g = 0; g < nj; g += 8) {  // hsum8 of keys g .. g + 7
    const __m256 b0 = key_pair<DV>(qv, k0, kst, g, nj), b1 = key_pair<DV>(qv, k0, kst, g + 2, nj);
    const __m256 c0 = _mm256_hadd_ps(b0, b1);
    const __m256 b2 = key_pair<DV>(qv, k0, kst, g + 4, nj), b3 = key_pair<DV>(qv, k0, kst, g + 6, nj);
    const __m256 c1 = _mm256_hadd_ps(b2, b3);
    const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
    if (nj - g >= 8) _mm256_storeu_ps(sc + j0 + g, s);
    else _mm256_maskstore_ps(sc + j0 + g, v16::first8(nj - g), s);  // a masked store is slow on AMD: the tail only
  }
}
#endif

// Softmax numerators of sc[0, hi) in place (masked keys -inf first); returns the denominator, or 0
// and all-zero numerators when no key is visible (a padding query).
inline float softmax_row(float* sc, int64_t hi, const bool* mr) {
  if (mr)
    for (int64_t j = 0; j < hi; ++j) sc[j] = mr[j] ? sc[j] : -INFINITY;
  V16 mxv = v16::set1(-INFINITY);  // max is exact: any order gives the same value
  int64_t j = 0;
  for (; j + 16 <= hi; j += 16) mxv = v16::max(v16::load(sc + j), mxv);  // a NaN score ignored, as std::max
  float mx = v16::reduce_max(mxv);
  for (; j < hi; ++j) mx = std::max(mx, sc[j]);
  if (mx == -INFINITY) {
    std::fill(sc, sc + hi, 0.0f);
    return 0.0f;
  }
  j = 0;
  const V16 mv = v16::set1(mx);
  for (; j + 16 <= hi; j += 16) v16::store(sc + j, exp_nonpositive(v16::sub(v16::load(sc + j), mv)));
  if (j < hi) v16::store_first(sc + j, exp_nonpositive(v16::sub(v16::load_first(sc + j, hi - j), mv)), hi - j);
  V16 lv = v16::zero();  // the softmax denominator, 16 lanes then one fixed reduction
  for (j = 0; j < hi; j += 16) lv = v16::add(lv, v16::load_first(sc + j, hi - j));
  return v16::reduce_add(lv);
}

// The weighted sums of values for R query rows (numerators sc[r], denominators l[r], keys
// [0, hi[r])): per row, even keys into acc, odd keys into acc2 (two chains), keys in order; a key
// whose weight is 0 is skipped (masked: its value may be an unwritten cache slot).
// Pairs (AVX-512, bfloat16 values, even head_dim / 16): each 32 values of a row are loaded as 16
// pairs and widened by a shift (the even dimensions) and a mask (the odd ones), 2 instructions where
// a zero-extension and a shift per 16 values took 4; acc[r][2c] then holds chunk c's even dimensions,
// acc[r][2c + 1] its odd ones, interleaved back once a row at the end: the same sums, so the same
// bits. On 2 Zen 4 cores (an ad-hoc A/B, stop 65): 0.90-0.95x of the widening loads at 1 / 8 / 16 queries.
template <int DV, int R, bool Pairs, typename E, typename O>
inline void weighted_values(const E* vb, int64_t vst, float* const* sc, const int64_t* hi, const float* l,
                            O* const* orow) {
  static_assert(!Pairs || (std::is_same<E, uint16_t>::value && DV % 2 == 0), "pairs: bfloat16, even head_dim / 16");
  V16 acc[R][DV], acc2[R][DV];
  int64_t hmax = 0;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    hmax = std::max(hmax, hi[r]);
#pragma GCC unroll 16
    for (int d = 0; d < DV; ++d) acc[r][d] = acc2[r][d] = v16::zero();
  }
  for (int64_t j = 0; j < hmax; ++j) {
    const E* vr = vb + j * vst;
    V16 vv[DV];
    if constexpr (Pairs) {
#if defined(__AVX512F__)
      const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
#pragma GCC unroll 8
      for (int c = 0; c < DV / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(vr + c * 32);
        vv[2 * c] = {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
        vv[2 * c + 1] = {_mm512_castsi512_ps(_mm512_and_si512(x, odd))};
      }
#else
      static_assert(!Pairs, "weighted_values: Pairs needs AVX-512");
#endif
    } else {
#pragma GCC unroll 16
      for (int d = 0; d < DV; ++d) vv[d] = v16::load(vr + d * 16);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      if (j >= hi[r] || sc[r][j] == 0.0f) continue;
      const V16 pv = v16::set1(sc[r][j]);
      if (j & 1) {
#pragma GCC unroll 16
        for (int d = 0; d < DV; ++d) acc2[r][d] = v16::fmadd(pv, vv[d], acc2[r][d]);
      } else {
#pragma GCC unroll 16
        for (int d = 0; d < DV; ++d) acc[r][d] = v16::fmadd(pv, vv[d], acc[r][d]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    if (l[r] == 0.0f) {  // no key visible: zeros, not NaN
      std::memset(orow[r], 0, DV * 16 * sizeof(O));
      continue;
    }
    const V16 inv = v16::set1(1.0f / l[r]);
    if constexpr (Pairs) {
#if defined(__AVX512F__)
      // dimensions 0-15 of a chunk: even[0], odd[0], even[1], ...; 16-31: even[8], odd[8], ...
      const __m512i perm_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i perm_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#pragma GCC unroll 8
      for (int c = 0; c < DV / 2; ++c) {
        const __m512 e = v16::mul(v16::add(acc[r][2 * c], acc2[r][2 * c]), inv).v;
        const __m512 o = v16::mul(v16::add(acc[r][2 * c + 1], acc2[r][2 * c + 1]), inv).v;
        store16(orow[r] + c * 32, V16{_mm512_permutex2var_ps(e, perm_lo, o)});
        store16(orow[r] + c * 32 + 16, V16{_mm512_permutex2var_ps(e, perm_hi, o)});
      }
#else
      static_assert(!Pairs, "weighted_values: Pairs needs AVX-512");
#endif
    } else {
#pragma GCC unroll 16
      for (int d = 0; d < DV; ++d) store16(orow[r] + d * 16, v16::mul(v16::add(acc[r][d], acc2[r][d]), inv));
    }
  }
}

#if !defined(__AVX512F__)
// AVX2: the same sums as weighted_values (per row: even keys into one chain, odd keys into another,
// keys in order, zero weights skipped; then (even + odd) / l), with at most 4 V16 (8 ymm) of sums in
// registers: 16 ymm registers cannot hold even one row's two chains of a 64-wide head next to a
// value row (the loop above spilled them). Keys go in blocks of kValueBlock (the block's values stay
// in L1 for every row); per block, row and chain the sums are loaded from acc, advanced, stored back
// (a store and a load do not change a float: the same bits as one unbroken chain).
template <int G, typename E>
inline void value_chain(const E* vb, int64_t vst, const float* scr, int64_t ja, int64_t je, float* acc) {
  V16 a[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) a[g] = v16::load(acc + g * 16);
  for (int64_t j = ja; j < je; j += 2) {
    const float p = scr[j];
    if (p == 0.0f) continue;
    const V16 pv = v16::set1(p);
    const E* vr = vb + j * vst;
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) a[g] = v16::fmadd(pv, v16::load(vr + g * 16), a[g]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) v16::store(acc + g * 16, a[g]);
}

constexpr int64_t kValueBlock = 32;  // keys a block: 8 KB of float32 values at head_dim 64

template <int DV, typename E, typename O>
inline void weighted_values_rows(const E* vb, int64_t vst, float* const* sc, const int64_t* hi, const float* l,
                                 O* const* orow, int64_t nr, float* acc) {  // acc: nr x 2 x DV x 16 floats
  std::memset(acc, 0, sizeof(float) * nr * 2 * DV * 16);
  int64_t hmax = 0;
  for (int64_t r = 0; r < nr; ++r) hmax = std::max(hmax, hi[r]);
  for (int64_t j0 = 0; j0 < hmax; j0 += kValueBlock) {
    const int64_t j1 = std::min(hmax, j0 + kValueBlock);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t je = std::min(j1, hi[r]);
      for (int par = 0; par < 2; ++par) {
        float* ar = acc + (r * 2 + par) * DV * 16;
        int d = 0;
        for (; d + 4 <= DV; d += 4) value_chain<4>(vb + d * 16, vst, sc[r], j0 + par, je, ar + d * 16);
        if constexpr (DV % 4 != 0) value_chain<DV % 4>(vb + d * 16, vst, sc[r], j0 + par, je, ar + d * 16);
      }
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    if (l[r] == 0.0f) {
      std::memset(orow[r], 0, DV * 16 * sizeof(O));
      continue;
    }
    const V16 inv = v16::set1(1.0f / l[r]);
    const float* ae = acc + r * 2 * DV * 16;
    const float* ao = ae + DV * 16;
    for (int d = 0; d < DV; ++d)
      store16(orow[r] + d * 16, v16::mul(v16::add(v16::load(ae + d * 16), v16::load(ao + d * 16)), inv));
  }
}
#endif

// Query rows of a task from which a bfloat16 key tile is widened once for all of them (fewer: per row),
// where the scores do not come from score_tile_dp (no AVX512-BF16, or an odd head_dim / 16).
constexpr int64_t kWidenTileRows = 6;

// rows / pos (attention_rows): query (b, s) reads cache row rows[b] of k / v and sees its keys
// 0 .. pos[b, s] (mask and causal unused); otherwise batch row b reads k / v row b.
template <typename E, int DV>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                    int64_t mask_b, bool causal, float scale, at::Tensor& out, const int64_t* rows = nullptr,
                    const int64_t* pos = nullptr) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), KV = k.size(1), T = k.size(2);
  const int64_t G = H / KV, NQ = G * S;  // query rows of one (b, kv head), s-major: row i = (s, head i % G)
  [[maybe_unused]] constexpr bool pairs = std::is_same<E, uint16_t>::value && DV % 2 == 0;  // bfloat16 rows as 32-bit pairs
#if defined(__AVX512BF16__)
  constexpr bool dot_bf16 = pairs;  // scores by vdpbf16ps (score_tile_dp)
#else
  constexpr bool dot_bf16 = false;
#endif
  constexpr bool dp_values = dot_bf16 && DV <= 8;  // values by vdpbf16ps too (weighted_values_dp)
  // rows per weighted_values pass (their sums in registers; a row's sums are the same whatever QT is);
  // weighted_values_dp: QT x DV sums + DV value pairs within 28 zmm, 4 left for the loads, a masked
  // temporary and the weight (8 / 6 / 3 / 2 rows at head_dim 32 / 64 / 96 / 128; 3 rows of 128 spilled 4 sums)
#if defined(__AVX512F__)
  constexpr int QT = dp_values ? std::min(8, (28 - DV) / DV) : DV <= 2 ? 4 : DV <= 4 ? 3 : 1;
#else
  constexpr int QT = DV <= 2 ? 4 : DV <= 4 ? 2 : 1;
#endif
  const E* qp = reinterpret_cast<const E*>(q.data_ptr());  // q: unit stride in D, any other strides
  const int64_t qsb = q.stride(0), qsh = q.stride(1), qss = q.stride(2);
  const E* kp = reinterpret_cast<const E*>(k.data_ptr());
  const E* vp = reinterpret_cast<const E*>(v.data_ptr());
  const int64_t ksb = k.stride(0), ksh = k.stride(1), kst = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vst = v.stride(2);
  E* op = reinterpret_cast<E*>(out.data_ptr());  // [B, S, H, D]
  // Tasks: (b, kv head, a chunk of QC query rows), ~8 per thread where the step has that many rows.
  const int64_t want = std::max<int64_t>(1, (8 * at::get_num_threads() + B * KV - 1) / (B * KV));
  const int64_t chunks = std::min(want, (NQ + QT - 1) / QT);
  const int64_t QC = ((NQ + chunks - 1) / chunks + QT - 1) / QT * QT, per_group = (NQ + QC - 1) / QC;
  // grain: a thread's share at least ~32k key-dimension products (a short step stays on one thread)
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, QC * T * D));
  at::parallel_for(0, B * KV * per_group, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(QC * (T + 16));
    std::vector<V16> qs(dot_bf16 ? 0 : QC * DV);
#if defined(__AVX512BF16__)
    std::vector<BH> qb(dot_bf16 ? QC * DV / 2 : 0);  // q rows as bfloat16 pairs (score_tile_dp)
    const int64_t pst = T + 16;  // numerators as bfloat16 (weighted_values_dp), a row's up to hmax rounded up to 16
    std::vector<uint16_t> pbuf(dp_values ? QC * pst : 0);
#endif
    std::vector<int64_t> hi(QC);
    std::vector<float> l(QC);
    std::vector<float*> sc(QC);
    std::vector<E*> orow(QC);
    std::vector<float> ktile(std::is_same<E, float>::value || dot_bf16 ? 0 : 16 * DV * 16);
#if !defined(__AVX512F__)
    std::vector<float> vacc(QC * 2 * DV * 16);  // value sums (weighted_values_rows)
#endif
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (KV * per_group), g = (t / per_group) % KV, i0 = (t % per_group) * QC;
      const int64_t nr = std::min(QC, NQ - i0);
      int64_t hmax = 0;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t s = (i0 + r) / G, h = g * G + (i0 + r) % G;
        hi[r] = pos ? pos[b * S + s] + 1 : causal ? T - S + s + 1 : T;
        hmax = std::max(hmax, hi[r]);
        sc[r] = scores.data() + r * (T + 16);
        orow[r] = op + ((b * S + s) * H + h) * D;
        const E* qr = qp + b * qsb + h * qsh + s * qss;
#if defined(__AVX512BF16__)
        if constexpr (dot_bf16) {
          for (int d = 0; d < DV / 2; ++d) qb[r * (DV / 2) + d].v = (__m512bh)_mm512_loadu_si512(qr + d * 32);
          continue;
        }
#endif
        for (int d = 0; d < DV; ++d) qs[r * DV + d] = v16::mul(v16::load(qr + d * 16), v16::set1(scale));
      }
      const int64_t kr = rows ? rows[b] : b;
      const E* kb = kp + kr * ksb + g * ksh;
      const E* vb = vp + kr * vsb + g * vsh;
#if defined(__AVX512BF16__)
      if constexpr (dot_bf16) {
        for (int64_t j0 = 0; j0 < hmax; j0 += 16)  // key tile outer: its 16 keys stay in L1 for every row
          for (int64_t r = 0; r < nr; ++r)
            if (j0 < hi[r])
              score_tile_dp<DV>(qb.data() + r * (DV / 2), kb, kst, j0, std::min<int64_t>(16, hi[r] - j0), scale, sc[r]);
      } else
#endif
      if constexpr (!dot_bf16) {
        // bfloat16 keys, many rows: each tile's keys widened once into ktile (exact, so the same scores) rather
        // than once per row; 62 -> ~50 us a layer for 8 queries x 3 heads over 208 keys, one core
        const bool widen_tile = !std::is_same<E, float>::value && nr >= kWidenTileRows;
        for (int64_t j0 = 0; j0 < hmax; j0 += 16) {  // key tile outer: its 16 keys stay in L1 for every row
          if (widen_tile) {
            const int64_t nj = std::min<int64_t>(16, hmax - j0);
            for (int64_t i = 0; i < nj; ++i)
              for (int d = 0; d < DV; ++d) v16::store(ktile.data() + i * DV * 16 + d * 16, v16::load(kb + (j0 + i) * kst + d * 16));
            for (int64_t r = 0; r < nr; ++r)
              if (j0 < hi[r])
                score_tile<DV>(qs.data() + r * DV, ktile.data(), DV * 16, 0, std::min<int64_t>(16, hi[r] - j0), sc[r] + j0);
          } else {
            for (int64_t r = 0; r < nr; ++r)
              if (j0 < hi[r]) score_tile<DV>(qs.data() + r * DV, kb, kst, j0, std::min<int64_t>(16, hi[r] - j0), sc[r]);
          }
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        const bool* mr = mask && !pos ? mask + ((mask_b == 1 ? 0 : b) * S + (i0 + r) / G) * T : nullptr;
        l[r] = softmax_row(sc[r], hi[r], mr);
      }
#if defined(__AVX512BF16__)
      if constexpr (dp_values) {
        for (int64_t r = 0; r < nr; ++r)  // zeros past hi[r] (a padding row's are all zero: softmax_row)
          for (int64_t j = 0; j < hmax; j += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf.data() + r * pst + j),
                                (__m256i)_mm512_cvtneps_pbh(v16::load_first(sc[r] + j, std::clamp<int64_t>(hi[r] - j, 0, 16)).v));
        by_rows<QT>(nr, [&](int64_t r, auto R) {
          weighted_values_dp<DV, decltype(R)::value>(vb, vst, pbuf.data() + r * pst, pst, &hi[r], &l[r], &orow[r]);
        });
      } else
#endif
      if constexpr (!dp_values) {
#if defined(__AVX512F__)
        int64_t r = 0;
        for (; r + QT <= nr; r += QT) weighted_values<DV, QT, pairs>(vb, vst, &sc[r], &hi[r], &l[r], &orow[r]);
        for (; r < nr; ++r) weighted_values<DV, 1, pairs>(vb, vst, &sc[r], &hi[r], &l[r], &orow[r]);
#else
        weighted_values_rows<DV>(vb, vst, sc.data(), hi.data(), l.data(), orow.data(), nr, vacc.data());
#endif
      }
    }
  });
}

// The head_dim as a compile-time constant (the accumulators stay in registers), then the dtype.
void attention_dispatch(const at::Tensor& qc, const at::Tensor& k, const at::Tensor& v, const bool* mp, int64_t mb,
                        bool causal, double scale, at::Tensor& out, const int64_t* rows, const int64_t* pos) {
  auto run = [&](auto dv) {
    constexpr int DV = decltype(dv)::value;
    if (qc.scalar_type() == at::kFloat) {
      attention_impl<float, DV>(qc, k, v, mp, mb, causal, static_cast<float>(scale), out, rows, pos);
    } else {
      attention_impl<uint16_t, DV>(qc, k, v, mp, mb, causal, static_cast<float>(scale), out, rows, pos);
    }
  };
  switch (qc.size(3) / 16) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 5: run(std::integral_constant<int, 5>{}); break;
    case 6: run(std::integral_constant<int, 6>{}); break;
    case 7: run(std::integral_constant<int, 7>{}); break;
    case 8: run(std::integral_constant<int, 8>{}); break;
    case 12: run(std::integral_constant<int, 12>{}); break;
    case 16: run(std::integral_constant<int, 16>{}); break;
    default: TORCH_CHECK(false, "attention: head_dim ", qc.size(3), " is not compiled in");
  }
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q [B, H, S, D], k / v [B, KV, T, D] expected");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attention: CPU tensors expected");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16), "attention: float32 or bfloat16, one dtype");
  const int64_t H = q.size(1), D = q.size(3), KV = k.size(1), T = k.size(2);
  TORCH_CHECK(D > 0 && D % 16 == 0 && (D <= 128 || D == 192 || D == 256),
              "attention: head_dim must be 16, 32, ..., 128, 192 or 256");
  TORCH_CHECK(v.size(0) == k.size(0) && KV > 0 && H % KV == 0 && v.size(1) == KV && v.size(2) == T &&
              k.size(3) == D && v.size(3) == D && k.stride(3) == 1 && v.stride(3) == 1, "attention: k / v shapes");
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                     bool causal, double scale) {
  check_qkv(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), T = k.size(2);
  TORCH_CHECK(k.size(0) == B, "attention: k / v need q's batch size");
  TORCH_CHECK(!causal || T >= S, "attention: causal needs at least S keys");
  auto qc = q.stride(3) == 1 ? q : q.contiguous();  // a view of the fused q/k/v output: no copy
  auto out = at::empty({B, S, H, D}, q.options());
  at::Tensor mc;
  const bool* mp = nullptr;
  int64_t mb = 1;
  if (mask && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(1) == 1 && mask->size(2) == S &&
                mask->size(3) == T && (mask->size(0) == 1 || mask->size(0) == B), "attention: bool mask [B or 1, 1, S, T] expected");
    TORCH_CHECK(mask->device().is_cpu(), "attention: CPU mask expected");
    mc = mask->contiguous();
    mp = mc.data_ptr<bool>();
    mb = mc.size(0);
  }
  attention_dispatch(qc, k, v, mp, mb, causal, scale, out, nullptr, nullptr);
  return out.transpose(1, 2);  // [B, H, S, D] like SDPA, a view of [B, S, H, D]
}

// Attention of a step whose rows sit anywhere in the KV cache, at their own positions, in one call:
// k / v [R, KV, Tmax, D] are a layer's whole cache, query (b, s) reads cache row rows[b] and sees
// its keys 0 .. pos[b, s]. Each row reads only its own keys (no mask over the longest row's, no
// call per run of rows); the same arithmetic as `attention`, so the same bits.
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                          const at::Tensor& pos, double scale) {
  check_qkv(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), R = k.size(0), T = k.size(2);
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == B && rows.scalar_type() == at::kLong && rows.device().is_cpu(),
              "attention_rows: rows must be int64 [B] on the CPU");
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == S && pos.scalar_type() == at::kLong &&
                  pos.device().is_cpu(), "attention_rows: pos must be int64 [B, S] on the CPU");
  auto rc = rows.contiguous();
  auto pc = pos.contiguous();
  const int64_t* rp = rc.data_ptr<int64_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // a plain loop: torch's min / max were 4 more ops a layer
    TORCH_CHECK(rp[b] >= 0 && rp[b] < R, "attention_rows: a row outside the cache's ", R, " rows");
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK(pp[b * S + s] >= 0 && pp[b * S + s] < T, "attention_rows: a position outside the cache's ", T,
                  " positions");
  }
  auto qc = q.stride(3) == 1 ? q : q.contiguous();  // a view of the fused q/k/v output: no copy
  auto out = at::empty({B, S, H, D}, q.options());
  attention_dispatch(qc, k, v, nullptr, 1, false, scale, out, rp, pp);
  return out.transpose(1, 2);
}

// ---- the elementwise ops of a layer, fused: RoPE and SwiGLU's silu(gate) * up ------------------
// Each computes what the torch ops it replaces compute, in the same order, every intermediate
// rounded to the dtype where torch rounds it (only silu's exp is our own: a few float32 ulp from
// torch's); each token's row on its own, so batch-invariant.

inline float ld(const float* p) { return *p; }
inline float ld(const uint16_t* p) { return bf16_to_f32(*p); }
inline void st(float* p, float v) { *p = v; }
inline void st(uint16_t* p, float v) { *p = f32_to_bf16(v); }

template <typename E>
inline float rnd(float v) {  // v as an op producing dtype E leaves it
  if constexpr (std::is_same_v<E, float>) return v; else return bf16_to_f32(f32_to_bf16(v));
}
template <typename E>
inline V16 rnd(V16 v) {
  if constexpr (std::is_same_v<E, float>) return v; else return v16::round_bf16(v);
}

// exp over all floats, for silu: x clamped to [-104, 89] first (below, exp rounds to 0 or a few
// subnormal ulps; above, to inf), so -inf gives 0 and +inf gives inf; NaN gives 0 (silu's NaN comes
// from its numerator). Then 2^n * p(r) as exp_nonpositive.
inline V16 exp_ps(V16 x) {
  x = v16::min(v16::max(x, v16::set1(-104.0f)), v16::set1(89.0f));
  const V16 n = v16::round_nearest(v16::mul(x, v16::set1(1.44269504088896341f)));
  V16 r = v16::fnmadd(n, v16::set1(0.693145751953125f), x);
  r = v16::fnmadd(n, v16::set1(1.428606765330187045e-06f), r);
  V16 p = v16::set1(1.0f / 5040);
  p = v16::fmadd(p, r, v16::set1(1.0f / 720));
  p = v16::fmadd(p, r, v16::set1(1.0f / 120));
  p = v16::fmadd(p, r, v16::set1(1.0f / 24));
  p = v16::fmadd(p, r, v16::set1(1.0f / 6));
  p = v16::fmadd(p, r, v16::set1(0.5f));
  p = v16::fmadd(p, r, v16::set1(1.0f));
  p = v16::fmadd(p, r, v16::set1(1.0f));
  return v16::scale2(p, n);
}

// RoPE in HF's rotate-half convention on the first n heads of x [B, S, heads, D] (the fused q/k/v
// linear's output per head): y = x * cos + roll(x, D / 2) * sin_signed, cos / sin_signed
// [B or 1, S, 1, D] (models/rope.py): two products, each rounded, then their sum. y [B, S, n, D].
template <typename E>
void rope_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t n, at::Tensor& y) {
  const int64_t B = x.size(0), S = x.size(1), D = x.size(3), half = D / 2;
  const int64_t sb = x.stride(0), ss = x.stride(1), sh = x.stride(2);
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), cs = cos.stride(1);
  const E* xp = reinterpret_cast<const E*>(x.data_ptr());
  const E* cp = reinterpret_cast<const E*>(cos.data_ptr());
  const E* sp = reinterpret_cast<const E*>(sin.data_ptr());
  E* yp = reinterpret_cast<E*>(y.data_ptr());
  at::parallel_for(0, B * S, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, n * D)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / S, i = t % S;
      const E* cr = cp + b * cb + i * cs;
      const E* sr = sp + b * cb + i * cs;
      for (int64_t h = 0; h < n; ++h) {
        const E* xr = xp + b * sb + i * ss + h * sh;
        E* yr = yp + (t * n + h) * D;
        int64_t d = 0;
        if (half % 16 == 0) {
          for (; d < D; d += 16) {
            const int64_t e = d < half ? d + half : d - half;
            const V16 u = rnd<E>(v16::mul(v16::load(xr + d), v16::load(cr + d)));
            const V16 v = rnd<E>(v16::mul(v16::load(xr + e), v16::load(sr + d)));
            store16(yr + d, v16::add(u, v));
          }
        }
        for (; d < D; ++d) {
          const int64_t e = d < half ? d + half : d - half;
          st(yr + d, rnd<E>(ld(xr + d) * ld(cr + d)) + rnd<E>(ld(xr + e) * ld(sr + d)));
        }
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed, int64_t n) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0 && n >= 0 && n <= x.size(2),
              "rope: x [B, S, heads, D] with unit stride in D (D even) and n <= heads expected");
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin_signed.device().is_cpu(), "rope: CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rope: float32 or bfloat16 expected");
  const int64_t B = x.size(0), S = x.size(1), D = x.size(3);
  for (const at::Tensor* t : {&cos, &sin_signed})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->dim() == 4 && (t->size(0) == 1 || t->size(0) == B) &&
                    t->size(1) == S && t->size(2) == 1 && t->size(3) == D && t->stride(3) == 1,
                "rope: cos / sin [B or 1, S, 1, D] of x's dtype expected");
  TORCH_CHECK(cos.sizes() == sin_signed.sizes() && cos.strides() == sin_signed.strides(), "rope: cos and sin differ in layout");
  auto y = at::empty({B, S, n, D}, x.options());
  if (x.scalar_type() == at::kFloat) rope_impl<float>(x, cos, sin_signed, n, y);
  else rope_impl<uint16_t>(x, cos, sin_signed, n, y);
  return y;
}

// SwiGLU: y[..., i] = silu(g[..., i]) * u[..., i] for gu = [g | u] [..., 2I] (the fused gate / up
// linear's output); silu(g) = g / (1 + exp(-g)) in float32, rounded, then the product, rounded.
template <typename E>
void silu_mul_impl(const E* gu, E* y, int64_t rows, int64_t I) {
  // a verify step's rows on both threads from 3 rows of smollm2 (I = 1,536): at 8 rows 9.9 -> 6.9 us a layer
  // (runs/kprobe/phase.py, 2 Zen 4 cores, stop 65); one row stays on one thread
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 12) / std::max<int64_t>(1, I)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const E* g = gu + r * 2 * I;
      const E* u = g + I;
      E* yr = y + r * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {
        const V16 gv = v16::load(g + i);
        const V16 e = exp_ps(v16::sub(v16::zero(), gv));
        const V16 sv = rnd<E>(v16::div(gv, v16::add(v16::set1(1.0f), e)));
        store16(yr + i, v16::mul(sv, v16::load(u + i)));
      }
      for (; i < I; ++i) {
        const float gv = ld(g + i);
        st(yr + i, rnd<E>(gv / (1.0f + std::exp(-gv))) * ld(u + i));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "silu_mul: [..., 2 x I] expected (gate, then up)");
  TORCH_CHECK(gu.device().is_cpu(), "silu_mul: a CPU tensor expected");
  TORCH_CHECK(gu.scalar_type() == at::kFloat || gu.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16 expected");
  auto c = gu.contiguous();
  const int64_t I = c.size(-1) / 2, rows = I ? c.numel() / (2 * I) : 0;
  auto sizes = c.sizes().vec();
  sizes.back() = I;
  auto y = at::empty(sizes, c.options());
  if (c.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(c.data_ptr<float>(), y.data_ptr<float>(), rows, I);
  } else {
    silu_mul_impl<uint16_t>(reinterpret_cast<const uint16_t*>(c.data_ptr()), reinterpret_cast<uint16_t*>(y.data_ptr()),
                            rows, I);
  }
  return y;
}

// ---- a whole decoder layer of a decode / verify step in one call -------------------------------
// Llama / Qwen2-style layer (pre-norm, fused q/k/v with optional bias, optional Qwen3-style q / k norm,
// RoPE, GQA attention over the cache, fused gate/up SwiGLU; also the block drafters' KV-injected
// layer, drafters/block_step.py) for rows row0 .. row0 + B - 1 of the cache that all start at `start`:
// the ops above in the order models/decoder.py calls them one by one, so the same bits, without ~20
// Python-level dispatches per layer (~3 ms of a ~40 ms smollm2-135m decode step on 2 Zen 3 cores).
// lin: {weight, n, k} of a pack_f32 / pack_bf16 linear (gemv_f32 / gemv_bf16 by the weight's dtype).
at::Tensor lin(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t k, const std::optional<at::Tensor>& b) {
  return w.scalar_type() == at::kFloat ? gemv_f32(x, w, n, b) : gemv_bf16(x, w, n, k, b);
}

// src [B, S, kv heads, D] (unit stride in D) into cache rows [B, kv heads, T, D] (a view of the cache), positions
// start..: what cache.narrow(2, start, S).copy_(src.transpose(1, 2)) does, one memcpy a head and token
// (torch's copy_ cost ~3 us a call, two a layer, more than the bytes of a decode step's k and v).
void write_kv(const at::Tensor& src, const at::Tensor& cache, int64_t start) {
  TORCH_CHECK(src.scalar_type() == cache.scalar_type() && src.stride(3) == 1 && cache.stride(3) == 1,
              "layer: k / v and the cache must share a dtype, with unit stride in D");
  const int64_t B = src.size(0), S = src.size(1), KV = src.size(2), D = src.size(3), es = src.element_size();
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* cp = static_cast<char*>(cache.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t s = 0; s < S; ++s)
        std::memcpy(cp + (b * cache.stride(0) + h * cache.stride(1) + (start + s) * cache.stride(2)) * es,
                    sp + (b * src.stride(0) + s * src.stride(1) + h * src.stride(2)) * es, D * es);
}

at::Tensor layer(const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                 const at::Tensor& qkv_w, const std::optional<at::Tensor>& qkv_b, const at::Tensor& o_w,
                 const std::optional<at::Tensor>& o_b, const at::Tensor& gu_w, const at::Tensor& down_w,
                 at::IntArrayRef dims, const at::Tensor& kc, const at::Tensor& vc, int64_t row0, int64_t start,
                 const at::Tensor& cos, const at::Tensor& sin_signed, const std::optional<at::Tensor>& mask, bool causal,
                 double scale, const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm) {
  // dims: hidden, heads, kv heads, head_dim, intermediate
  TORCH_CHECK(dims.size() == 5, "layer: dims = (hidden, heads, kv_heads, head_dim, intermediate) expected");
  const int64_t Hd = dims[0], nh = dims[1], nkv = dims[2], D = dims[3], I = dims[4];
  TORCH_CHECK(x.dim() == 3 && x.size(2) == Hd, "layer: x [B, S, hidden] expected");
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(1) == nkv && kc.size(3) == D && row0 >= 0 &&
                  row0 + x.size(0) <= kc.size(0) && start >= 0 && start + x.size(1) <= kc.size(2),
              "layer: the cache rows / positions of this step do not fit the cache");
  const int64_t B = x.size(0), S = x.size(1), T = start + S;
  const int64_t nq = (nh + 2 * nkv) * D;
  auto h = rms_norm(x, ln1, eps);
  auto qkv = lin(h, qkv_w, nq, Hd, qkv_b).view({B, S, nh + 2 * nkv, D});
  const bool qk_norm = q_norm && q_norm->defined();
  TORCH_CHECK(qk_norm == (k_norm && k_norm->defined()), "layer: q_norm and k_norm come together");
  // Qwen3-style q / k RMSNorm over each head's D values, before RoPE
  auto qk = qk_norm ? rope(at::cat({rms_norm(qkv.narrow(2, 0, nh), *q_norm, eps),
                                    rms_norm(qkv.narrow(2, nh, nkv), *k_norm, eps)}, 2),
                           cos, sin_signed, nh + nkv)
                    : rope(qkv, cos, sin_signed, nh + nkv);
  auto rows_k = kc.narrow(0, row0, B), rows_v = vc.narrow(0, row0, B);
  write_kv(qk.narrow(2, nh, nkv), rows_k, start);
  write_kv(qkv.narrow(2, nh + nkv, nkv), rows_v, start);
  auto att = attention(qk.narrow(2, 0, nh).transpose(1, 2), rows_k.narrow(2, 0, T), rows_v.narrow(2, 0, T), mask, causal,
                       scale);
  auto a = lin(att.transpose(1, 2).reshape({B, S, nh * D}), o_w, Hd, nh * D, o_b);
  auto [x2, h2] = add_rms_norm(x, a, ln2, eps);
  auto m = lin(silu_mul(lin(h2, gu_w, 2 * I, Hd, std::nullopt)), down_w, Hd, I, std::nullopt);
  return x2.add_(m);
}

// ---- argmax over the vocabulary --------------------------------------------------------------
// torch.argmax(x, -1) of float32 rows (the greedy token of every verified position): the first
// index of the largest value; a row holding NaN or an infinity takes the exact scalar scan (NaN
// counts as the largest, torch's rule). Two vector passes (the max, then its first lane) instead of
// torch's generic reduction, ~57 us a 49k-vocabulary row on 2 Intel cores.
int64_t argmax_row(const float* x, int64_t V) {
  V16 mx = v16::set1(-INFINITY), bad = v16::zero();
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const V16 v = v16::load(x + i);
    mx = v16::max(v, mx);
    bad = v16::add(bad, v16::sub(v, v));  // NaN once any lane was NaN or infinite
  }
  float m = v16::reduce_max(mx), b = v16::reduce_add(bad);
  for (int64_t j = i; j < V; ++j) {
    b += x[j] - x[j];
    m = std::max(m, x[j]);
  }
  if (!(b == 0.0f)) {  // NaN or an infinity somewhere: torch's rule, one value at a time
    int64_t best = 0;
    for (int64_t j = 0; j < V; ++j) {
      if (std::isnan(x[j])) return j;
      if (x[j] > x[best]) best = j;
    }
    return best;
  }
  for (i = 0; i + 16 <= V; i += 16) {
    const int lanes = v16::equal_lanes(v16::load(x + i), m);
    if (lanes) return i + __builtin_ctz(static_cast<unsigned>(lanes));
  }
  for (; i < V; ++i)
    if (x[i] == m) return i;
  return 0;  // unreachable: m is one of the values
}

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(1) > 0,
              "argmax: float32 CPU rows [N, V > 0] expected");
  auto xc = x.contiguous();
  const int64_t N = xc.size(0), V = xc.size(1);
  auto out = at::empty({N}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, (1 << 17) / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// ---- log-sum-exp over part of a row, and the row's argmax ------------------------------------
// Statistics of the frozen target for training (drafters/block.py target_stats): per row of logits
// x [M, V] (float32 or bfloat16), lse = log sum_v exp(x[v] + add[v]) (add: 0 where a column counts,
// -inf where it does not) and the first index of the largest x. Finite logits expected. One pass
// for both maxima, one for the first index, one for the sum: a 49k-column row (196 KB in float32)
// stays in L2 between them, where torch's masked_fill + logsumexp + argmax (and the float32 copy of
// bfloat16 logits) made ~8 passes over a whole chunk in memory: with the lm_head, 124 -> 42 ms a
// 512-token window of smollm2-135m on 2 Intel cores.
template <typename E>
void lse_argmax_row(const E* x, const float* add, int64_t V, float* lse, int64_t* top) {
  V16 mx = v16::set1(-INFINITY), mc = v16::set1(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const V16 v = v16::load(x + i);
    mx = v16::max(v, mx);
    mc = v16::max(v16::add(v, v16::load(add + i)), mc);
  }
  float m = v16::reduce_max(mx), mcount = v16::reduce_max(mc);
  for (int64_t j = i; j < V; ++j) {
    m = std::max(m, ld(x + j));
    mcount = std::max(mcount, ld(x + j) + add[j]);
  }
  int64_t t = -1;
  for (i = 0; i + 16 <= V && t < 0; i += 16) {
    const int lanes = v16::equal_lanes(v16::load(x + i), m);
    if (lanes) t = i + __builtin_ctz(static_cast<unsigned>(lanes));
  }
  for (int64_t j = i; j < V && t < 0; ++j)
    if (ld(x + j) == m) t = j;
  *top = t < 0 ? 0 : t;
  if (mcount == -INFINITY) {  // no column counts
    *lse = -INFINITY;
    return;
  }
  const V16 mv = v16::set1(mcount);
  V16 acc = v16::zero();
  for (i = 0; i + 16 <= V; i += 16)
    acc = v16::add(acc, exp_nonpositive(v16::sub(v16::add(v16::load(x + i), v16::load(add + i)), mv)));
  float sum = v16::reduce_add(acc);
  for (int64_t j = i; j < V; ++j) sum += std::exp(ld(x + j) + add[j] - mcount);
  *lse = mcount + std::log(sum);
}

std::tuple<at::Tensor, at::Tensor> lse_argmax(const at::Tensor& x, const at::Tensor& add) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lse_argmax: float32 or bfloat16 CPU rows [M, V > 0] expected");
  const int64_t M = x.size(0), V = x.size(1);
  TORCH_CHECK(add.dim() == 1 && add.numel() == V && add.scalar_type() == at::kFloat && add.device().is_cpu(),
              "lse_argmax: add must be float32 [V] on the CPU");
  auto xc = x.contiguous();
  auto ac = add.contiguous();
  auto lse = at::empty({M}, xc.options().dtype(at::kFloat));
  auto top = at::empty({M}, xc.options().dtype(at::kLong));
  const float* ap = ac.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  int64_t* tp = top.data_ptr<int64_t>();
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const void* xp = xc.data_ptr();
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 17) / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bf16)
        lse_argmax_row(static_cast<const uint16_t*>(xp) + r * V, ap, V, lp + r, tp + r);
      else
        lse_argmax_row(static_cast<const float*>(xp) + r * V, ap, V, lp + r, tp + r);
    }
  });
  return {lse, top};
}

// Whether this build has a bfloat16 linear kernel: every build does now (AVX512-BF16 / AMX tiles, or
// bfloat16 weights widened to float32 on AVX-512 without it and on AVX2); kept for KernelStatus.bf16.
bool has_bf16() { return true; }

std::string isa() {  // the instruction set this build's kernels use
#if defined(__AVX512F__)
  if (amx_ready()) return "avx512-bf16+amx";
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#else
  return "avx512";  // its bfloat16 linears widen to float32 (see chunk_bf16)
#endif
#else
  return "avx2";
#endif
}

}  // namespace

TORCH_LIBRARY(draftsmith, m) {
  m.def("pack_f32(Tensor w) -> Tensor", &pack_f32);
  m.def("pack_bf16(Tensor w) -> Tensor", &pack_bf16);
  m.def("gemv_f32(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor", &gemv_f32);
  m.def("gemv_bf16(Tensor x, Tensor wp, int n, int k, Tensor? bias) -> Tensor", &gemv_bf16);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor a, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin_signed, int n) -> Tensor", &rope);
  m.def("silu_mul(Tensor gu) -> Tensor", &silu_mul);
  m.def("has_bf16() -> bool", &has_bf16);
  m.def("argmax(Tensor x) -> Tensor", &argmax);
  m.def("lse_argmax(Tensor x, Tensor add) -> (Tensor, Tensor)", &lse_argmax);
  m.def("isa() -> str", &isa);
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor", &attention);
  m.def("attention_rows(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor pos, float scale) -> Tensor", &attention_rows);
  m.def("layer(Tensor x, Tensor ln1, Tensor ln2, float eps, Tensor qkv_w, Tensor? qkv_b, Tensor o_w, Tensor? o_b, "
        "Tensor gu_w, Tensor down_w, int[] dims, Tensor(a!) kc, Tensor(b!) vc, int row0, int start, Tensor cos, "
        "Tensor sin_signed, Tensor? mask, bool causal, float scale, Tensor? q_norm=None, Tensor? k_norm=None) -> Tensor",
        &layer);
}
