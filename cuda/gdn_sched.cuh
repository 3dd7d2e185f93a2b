// Work by ticket for the GDN recurrences (gated_delta.cu, gdn_grouped.cu), whose items are
// (segment, column block, head) of one level. The grid holds every resident slot (4 blocks an
// SM); a block becomes a worker if its SM has fewer than L workers (L = items / SMs rounded up,
// 1 to 4) and the others exit at once; workers take the items in order by atomic tickets. Why
// not one block an item on a grid sized for the pass's padded segment count: blocks of absent
// segments exit at once, and the block scheduler then stacked up to 4 live blocks on some SMs
// while others had none (one 676-token segment took 0.32 ms in a pass's grid against 0.24
// alone; docs/cuda-kernels.md). An item is computed the same way whichever block takes it, so
// the bits do not depend on the schedule.
// sched: [ticket, finished blocks, workers per SM (GDN_SCHED_SMS)] int32, zeros before a launch
// and again after it (the last block out resets them); launches that share it must not overlap.
#pragma once

#if !defined(GDN_SCHED_SMS)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif

struct GdnWorkers {
    int* slot;  // two shared ints: the ticket just taken, whether this block works
    unsigned smid;
    bool worker;

    // Every thread calls each member (they hold barriers).
    __device__ __forceinline__ void begin(int* shared2, int* sched, int items, int num_sms) {
        slot = shared2;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        smid &= GDN_SCHED_SMS - 1;  // %smid may exceed the SM count (disabled SMs keep their numbers)
        if (threadIdx.x == 0) {
            const int limit = min(4, max(1, (items + num_sms - 1) / num_sms));
            slot[1] = atomicAdd(&sched[2 + smid], 1) < limit;
            if (!slot[1]) atomicSub(&sched[2 + smid], 1);
        }
        __syncthreads();
        worker = slot[1];
    }

    // The next item, or 0x7fffffff once a non-worker asks.
    __device__ __forceinline__ int next(int* sched) {
        if (!worker) return 0x7fffffff;
        if (threadIdx.x == 0) slot[0] = atomicAdd(&sched[0], 1);
        __syncthreads();
        const int item = slot[0];
        __syncthreads();  // every thread read the ticket before thread 0 takes the next
        return item;
    }

    __device__ __forceinline__ void end(int* sched) {
        if (threadIdx.x == 0) {
            if (worker) atomicSub(&sched[2 + smid], 1);
            __threadfence();
            if (atomicAdd(&sched[1], 1) == (int)gridDim.x - 1) sched[0] = sched[1] = 0;  // the last block
        }
    }
};
