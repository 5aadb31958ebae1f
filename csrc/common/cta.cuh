// Device pieces the SM90 kernels share around their main loops: the aligned
// shared-memory plan, the CTA's place in a (batch, token, head tile) grid,
// Q's head tile by TMA, the fast exp2, and an accumulator's values as the A
// operand of an RS WGMMA.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "gather.cuh"  // bf16, kDimTile, kSmemAlign

namespace attn_dist {

// The kernel's shared-memory plan at the first kSmemAlign boundary of the
// dynamic shared memory (the launch asks for sizeof(Plan) + kSmemAlign).
// The pad is added to smem_raw itself, not formed through an integer: a
// pointer rebuilt from an integer loses its shared-memory provenance, and
// every access through it compiles to a generic LD/ST/ATOM instead of
// LDS/STS/ATOMS.
template <class Plan>
__device__ __forceinline__ Plan& aligned_plan(char* smem_raw) {
  const uintptr_t pad = (kSmemAlign - reinterpret_cast<uintptr_t>(smem_raw) % kSmemAlign) % kSmemAlign;
  return *reinterpret_cast<Plan*>(smem_raw + pad);
}

// Where CTA `linear` of a grid over (batch, query token, head tile) works:
// head tiles fastest (the CTAs that read the same key rows run together),
// then query tokens, then batch elements.
struct HeadTileCta {
  int batch, s, head_tile;
};

__device__ __forceinline__ HeadTileCta head_tile_cta(int linear, int num_head_tiles, int s_q) {
  HeadTileCta t;
  t.head_tile = linear % num_head_tiles;
  linear /= num_head_tiles;
  t.s = linear % s_q;
  t.batch = linear / s_q;
  return t;
}

// Q's head tile of one query token, all kDimTiles 64-dim tiles, by TMA (the
// map of common/host.h's encode_head_tile_map): tile dt lands in
// q + dt * HT * 64 and completes q_ready[dt]. Rows past H are zero-filled;
// Q is read once, so it is evicted first.
template <int HT, int kDimTiles>
__device__ __forceinline__ void load_head_tile_by_tma(bf16* q, uint64_t* q_ready, const CUtensorMap* map,
                                                      const HeadTileCta& c) {
  constexpr uint32_t kTileBytes = HT * kDimTile * sizeof(bf16);
  for (int dt = 0; dt < kDimTiles; ++dt) {
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&q_ready[dt], kTileBytes);
    cute::SM90_TMA_LOAD_4D::copy(map, &q_ready[dt], uint64_t(cute::TMA::CacheHintSm90::EVICT_FIRST),
                                 q + dt * HT * kDimTile, dt * kDimTile, c.head_tile * HT, c.s, c.batch);
  }
}

// 2^x (ftz: tiny results flush to 0; exp2(-inf) = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The bf16 A operand in registers of an RS WGMMA (TiledMma) over a 64 x N
// tile, element i holding element i of the same tile's float accumulator:
// GMMA's A layout of a 64 x 16 block is its C layout, so a 64 x N
// accumulator read in order is N / 16 such blocks.
template <class TiledMma, int N>
__device__ __forceinline__ auto make_accumulator_a_fragment() {
  static_assert(std::is_same_v<typename TiledMma::Atom::Traits::ALayout, cute::GMMA::CLayout_64x16>,
                "the RS A fragment of a 64 x 16 block is laid out as its accumulator");
  static_assert(N % 16 == 0, "whole 64 x 16 blocks");
  return cute::make_tensor<bf16>(
      cute::Layout<cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::Int<N / 16>>>{});
}

}  // namespace attn_dist
