// Host check (no GPU): the descriptors wg_desc_add builds are the ones wg_desc builds anew, for every
// 1,024-aligned tile base a block of tree_attention.cu can have and every offset its products use.
//   nvcc -std=c++17 -Icuda -o /tmp/desc_check benchmarks/wgmma_desc_check.cu && /tmp/desc_check
#include <cstdio>
#include "wgmma.cuh"
int main() {
    long bad = 0, n = 0;
    for (u32 base = 0; base + 5 * 32768 <= 232448; base += 1024) {       // every aligned tile base of a block
        for (u32 b = 0; b < 5; ++b) {                                      // Q, K, V, second K, V buffers
            const u32 tile = base + b * 32768;
            for (int ks = 0; ks < 16; ++ks) {                              // Q K^T steps
                const u32 at = (ks >> 2) * (64 * 128) + (ks & 3) * 32;
                bad += wg_desc_rows(tile + at) != wg_desc_add(wg_desc_rows(tile), at); ++n;
            }
            for (int ks = 0; ks < 4; ++ks) for (int db = 0; db < 4; ++db) {  // P V steps
                const u32 at = db * (64 * 128) + ks * 2048;
                bad += wg_desc_cols(tile + at) != wg_desc_add(wg_desc_cols(tile), at); ++n;
            }
        }
    }
    printf("%ld of %ld descriptors differ\n", bad, n);
    return bad != 0;
}
