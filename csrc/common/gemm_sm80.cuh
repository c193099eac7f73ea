// The sm_80 tensor-core GEMM every GEMM kernel of this extension is: one CTA computes a BM x BN tile
// of C = A B^T (A: M x K, B: N x K, fp16/bf16 in, fp32 accumulate) with CuTe's mma.sync m16n8k16
// atoms, ldmatrix from swizzled shared memory, and a multistage cp.async pipeline.  The kernels
// differ only in their Args (see gemm_kernel): how the operands are addressed in global memory (each
// operand's lines, see index.h: 8 contiguous elements per (mn, k) chunk, so head-split and transposed
// tensors are read in place) and their epilogue (a store taking pairs of adjacent columns).
//
// Operands are K-major (8 elements contiguous along K, e.g. x rows in the QKV forward) or
// MN-major (contiguous along M or N, e.g. the weight in the input gradient); each gets the swizzled
// shared-memory atom and the ldmatrix flavour (plain or transposed) of its majorness.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "index.h"

namespace tk {

using namespace cute;

template <class T>
struct Sm80MmaAtom;
template <>
struct Sm80MmaAtom<cutlass::half_t> {
  using type = SM80_16x8x16_F32F16F16F32_TN;
};
template <>
struct Sm80MmaAtom<cutlass::bfloat16_t> {
  using type = SM80_16x8x16_F32BF16BF16F32_TN;
};

// Shared-memory atom and ldmatrix for an operand tile of K slice 32 (CUTLASS's sm_80 choices):
// the swizzle keeps each 16-byte chunk whole, so one cp.async fills one chunk, and spreads the
// rows that one ldmatrix reads over all banks.
template <Major M>
struct SmemOperand;
template <>
struct SmemOperand<Major::K> {
  using Atom = decltype(composition(Swizzle<2, 3, 3>{}, Layout<Shape<_8, _32>, Stride<_32, _1>>{}));
  using Ldsm = SM75_U32x4_LDSM_N;
};
template <>
struct SmemOperand<Major::MN> {
  using Atom = decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_64, _8>, Stride<_1, _64>>{}));
  using Ldsm = SM75_U16x8_LDSM_T;
};

// 128 x 128 tiles, K slices of 32, 3 stages, 8 warps (4 along M, 2 along N): 64 fp32 accumulators
// per thread, 48 KiB of shared memory.
template <class T, Major MajorA, Major MajorB>
struct GemmTraits {
  using Element = T;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kBlockK = 32;
  static constexpr int kStages = 3;
  static constexpr int kThreads = 256;
  static constexpr Major kMajorA = MajorA;
  static constexpr Major kMajorB = MajorB;

  using TiledMma = TiledMMA<MMA_Atom<typename Sm80MmaAtom<T>::type>, Layout<Shape<_4, _2, _1>>, Tile<_64, _32, _16>>;
  using SmemLayoutA = decltype(tile_to_shape(typename SmemOperand<MajorA>::Atom{},
                                             Shape<Int<kBlockM>, Int<kBlockK>, Int<kStages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(typename SmemOperand<MajorB>::Atom{},
                                             Shape<Int<kBlockN>, Int<kBlockK>, Int<kStages>>{}));
  using SmemCopyA = Copy_Atom<typename SmemOperand<MajorA>::Ldsm, T>;
  using SmemCopyB = Copy_Atom<typename SmemOperand<MajorB>::Ldsm, T>;

  static constexpr int kSmemElementsA = cosize_v<SmemLayoutA>;
  static constexpr int kSmemElementsB = cosize_v<SmemLayoutB>;
  static constexpr int kSmemBytes = (kSmemElementsA + kSmemElementsB) * int(sizeof(T));
  static_assert(size(TiledMma{}) == kThreads, "one thread per MMA slot");
};

// One 16-byte chunk global -> shared, zero-filled when `valid` is false (then `src` is not read).
template <class T>
__device__ __forceinline__ void cp_async_chunk(T* smem_dst, const T* gmem_src, bool valid) {
  SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(gmem_src),
                                                   *reinterpret_cast<uint128_t*>(smem_dst), valid);
}

// Which chunks of a stage tile (ROWS, BK) thread `tid` copies: its i-th at (mn(tid, i), k(tid, i)).
// Consecutive threads take consecutive chunks along the contiguous dimension, so a warp reads whole
// 64-byte (K-major) or 256-byte (MN-major) runs.  A thread's chunks keep their mn from stage to stage.
template <Major M, int ROWS, int BK, int kThreads>
struct StageChunks {
  static constexpr int kPerThread = ROWS * BK / 8 / kThreads;
  static_assert(ROWS * BK / 8 % kThreads == 0, "every thread copies the same number of chunks");
  __device__ __forceinline__ static int mn(int tid, int i) {
    const int chunk = tid + i * kThreads;
    return M == Major::K ? chunk / (BK / 8) : chunk % (ROWS / 8) * 8;
  }
  __device__ __forceinline__ static int k(int tid, int i) {
    const int chunk = tid + i * kThreads;
    return M == Major::K ? chunk % (BK / 8) * 8 : chunk / (ROWS / 8);
  }
};

// The operand's lines through thread `tid`'s chunks of the CTA's tile at mn0, made once, before the K loop.
template <class Chunks, class Operand>
__device__ __forceinline__ auto thread_lines(const Operand& op, int mn0, int tid) {
  cute::array<typename Operand::Line, Chunks::kPerThread> lines;
  CUTE_UNROLL
  for (int i = 0; i < Chunks::kPerThread; ++i) lines[i] = op.line(mn0 + Chunks::mn(tid, i));
  return lines;
}

// Issues the cp.asyncs of one stage: K slice [k0, k0 + BK) of the thread's lines into `tile`.
template <class Chunks, class Lines, class SmemTile>
__device__ __forceinline__ void load_stage(const Lines& lines, SmemTile tile, int k0, int tid) {
  CUTE_UNROLL
  for (int i = 0; i < Chunks::kPerThread; ++i) {
    const int k = Chunks::k(tid, i);
    bool valid;
    const auto* src = lines[i].chunk(k0 + k, valid);
    cp_async_chunk(&tile(Chunks::mn(tid, i), k), src, valid);
  }
}

// Issues the cp.asyncs of a whole tile (ROWS, COLS) of `op` at (mn0, k0), its lines made on the spot:
// the attention kernels' tiles move along mn from one load to the next.
template <Major M, int ROWS, int COLS, int kThreads, class Operand, class SmemTile>
__device__ __forceinline__ void load_tile(const Operand& op, SmemTile tile, int mn0, int k0, int tid) {
  using Chunks = StageChunks<M, ROWS, COLS, kThreads>;
  load_stage<Chunks>(thread_lines<Chunks>(op, mn0, tid), tile, k0, tid);
}

// The main loop: accumulates the CTA's tile at (m0, n0) over K into `acc` (the TiledMma's C
// fragment).  `on_stage(sA_stage, k0)` runs once per K slice after it is in shared memory and
// before it can be overwritten (the weight gradient sums its bias there).
template <class Traits, class OperandA, class OperandB, class Acc, class OnStage>
__device__ __forceinline__ void gemm_mainloop(const OperandA& a, const OperandB& b, int m0, int n0, int k_size,
                                              typename Traits::Element* smem, Acc& acc, OnStage&& on_stage) {
  using T = typename Traits::Element;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN, BK = Traits::kBlockK, S = Traits::kStages;
  const int tid = threadIdx.x;

  Tensor sA = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem + Traits::kSmemElementsA), typename Traits::SmemLayoutB{});

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(tid);
  Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, 0));
  Tensor tCrB = thr_mma.partition_fragment_B(sB(_, _, 0));

  auto s2r_a = make_tiled_copy_A(typename Traits::SmemCopyA{}, tiled_mma);
  auto s2r_b = make_tiled_copy_B(typename Traits::SmemCopyB{}, tiled_mma);
  auto s2r_thr_a = s2r_a.get_slice(tid);
  auto s2r_thr_b = s2r_b.get_slice(tid);
  Tensor tXsA = s2r_thr_a.partition_S(sA);
  Tensor tXrA = s2r_thr_a.retile_D(tCrA);
  Tensor tXsB = s2r_thr_b.partition_S(sB);
  Tensor tXrB = s2r_thr_b.retile_D(tCrB);

  using ChunksA = StageChunks<Traits::kMajorA, BM, BK, Traits::kThreads>;
  using ChunksB = StageChunks<Traits::kMajorB, BN, BK, Traits::kThreads>;
  const auto lines_a = thread_lines<ChunksA>(a, m0, tid);
  const auto lines_b = thread_lines<ChunksB>(b, n0, tid);

  const int k_tiles = ceil_div(k_size, BK);
  CUTE_UNROLL
  for (int stage = 0; stage < S - 1; ++stage) {
    if (stage < k_tiles) {
      load_stage<ChunksA>(lines_a, sA(_, _, stage), stage * BK, tid);
      load_stage<ChunksB>(lines_b, sB(_, _, stage), stage * BK, tid);
    }
    cp_async_fence();
  }

  for (int k_tile = 0; k_tile < k_tiles; ++k_tile) {
    cp_async_wait<S - 2>();
    __syncthreads();  // stage k_tile % S has landed; every thread is done with the stage refilled below
    const int next = k_tile + S - 1;
    if (next < k_tiles) {
      load_stage<ChunksA>(lines_a, sA(_, _, next % S), next * BK, tid);
      load_stage<ChunksB>(lines_b, sB(_, _, next % S), next * BK, tid);
    }
    cp_async_fence();

    const int stage = k_tile % S;
    on_stage(sA(_, _, stage), k_tile * BK);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      copy(s2r_a, tXsA(_, _, k, stage), tXrA(_, _, k));
      copy(s2r_b, tXsB(_, _, k, stage), tXrB(_, _, k));
      gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    }
  }
  cp_async_wait<0>();
}

template <class Traits>
__device__ __forceinline__ auto make_accumulator() {
  typename Traits::TiledMma tiled_mma;
  auto acc = partition_fragment_C(tiled_mma, Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>{});
  clear(acc);
  return acc;
}

// Hands the accumulator to `store(m, n, v0, v1)` as pairs of adjacent columns (n even, n + 1 may
// lie past N: the functor checks).  The m16n8 C fragment gives each thread two adjacent columns.
template <class Traits, class Acc, class Store>
__device__ __forceinline__ void for_each_column_pair(const Acc& acc, int m0, int n0, Store&& store) {
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(threadIdx.x);
  Tensor coord = thr_mma.partition_C(make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>{}));
  static_assert(size<0, 0>(decltype(acc.layout()){}) == 2, "C fragment values pair adjacent columns");
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    store(m0 + get<0>(coord(i)), n0 + get<1>(coord(i)), acc(i), acc(i + 1));
  }
}

// The kernel of every GEMM.  Args provides:
//   using A, B            the operand types (each with kMajor and line(mn), see index.h);
//   a(), b()              the operands;
//   rows(), cols(), depth()  M, N and K;
//   store(m, n, v0, v1)   the epilogue for columns n, n + 1 of row m (it checks the bounds);
//   kSumsRowsOfA, sums_rows_of_a(), store_row_sum(m, sum)
//                         a bias gradient fused into the first column of tiles: its CTAs also sum
//                         the rows of A from the tiles already in shared memory.
// Tiles are visited in grouped order (index.h) for L2 reuse.  Two CTAs share an SM (128 registers
// a thread, 2 x 48 KiB of shared memory): each warp's 32 x 64 tile leaves it little independent
// work to hide the ldmatrix and barrier latencies with, so a second CTA's warps fill the gaps.
// Capped at 128, ptxas spilled nothing and the main loops kept their length (sm_90a, the QKV GEMMs:
// 139-168 registers before).
constexpr int kTileGroupM = 8;
constexpr int kCtasPerSm = 2;

template <class Traits, class Args>
__global__ void __launch_bounds__(Traits::kThreads, kCtasPerSm) gemm_kernel(const __grid_constant__ Args args) {
  using T = typename Traits::Element;
  extern __shared__ __align__(128) unsigned char smem[];
  TileCoord tile = grouped_tile(blockIdx.x, ceil_div(args.rows(), Traits::kBlockM),
                                ceil_div(args.cols(), Traits::kBlockN), kTileGroupM);
  const int m0 = tile.m * Traits::kBlockM, n0 = tile.n * Traits::kBlockN;

  float row_sum = 0.f;
  bool sums_rows = false;
  if constexpr (Args::kSumsRowsOfA) sums_rows = args.sums_rows_of_a() && tile.n == 0;
  auto sum_rows = [&](const auto& a_tile, int) {
    if constexpr (Args::kSumsRowsOfA) {
      if (sums_rows && threadIdx.x < Traits::kBlockM) {
        CUTE_UNROLL
        for (int k = 0; k < Traits::kBlockK; ++k) row_sum += float(a_tile(threadIdx.x, k));  // zero-filled past K
      }
    }
  };

  auto acc = make_accumulator<Traits>();
  gemm_mainloop<Traits>(args.a(), args.b(), m0, n0, args.depth(), reinterpret_cast<T*>(smem), acc, sum_rows);
  for_each_column_pair<Traits>(acc, m0, n0, [&](int m, int n, float v0, float v1) { args.store(m, n, v0, v1); });
  if constexpr (Args::kSumsRowsOfA) {
    if (sums_rows && threadIdx.x < Traits::kBlockM) args.store_row_sum(m0 + threadIdx.x, row_sum);
  }
}

// Launches gemm_kernel for Args on elements T, one CTA per tile.
template <class T, class Args>
cudaError_t launch_gemm(const Args& args, cudaStream_t stream) {
  using Traits = GemmTraits<T, Args::A::kMajor, Args::B::kMajor>;
  static_assert(Traits::kSmemBytes <= 48 * 1024, "within the default dynamic shared memory limit");
  const int tiles = ceil_div(args.rows(), Traits::kBlockM) * ceil_div(args.cols(), Traits::kBlockN);
  if (tiles == 0) return cudaSuccess;
  gemm_kernel<Traits, Args><<<tiles, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace tk
