// Where key j of batch row b, KV head hk lives: a contiguous cache [B, L, Hk, D], or a page pool
// [pages, 1 << PAGE_SHIFT, Hk, D] addressed through page_table [B, max_pages] (the vLLM /
// FlashInfer layout). Element offsets; -1 where a page id lies outside the pool (its keys are
// neither read nor seen).
#pragma once
#include "common/types.cuh"

template <bool PAGED, int PAGE_SHIFT> struct KvRows {
  const int* page_table;
  int L, Hk, D, max_pages, pages;

  __device__ __forceinline__ int64_t offset(int b, int j, int hk) const {
    if constexpr (PAGED) {
      const int page = __ldg(page_table + static_cast<int64_t>(b) * max_pages + (j >> PAGE_SHIFT));
      if (page < 0 || page >= pages) return -1;
      const int64_t row = (static_cast<int64_t>(page) << PAGE_SHIFT) | (j & ((1 << PAGE_SHIFT) - 1));
      return (row * Hk + hk) * D;
    } else {
      return ((static_cast<int64_t>(b) * L + j) * Hk + hk) * D;
    }
  }
};
