// Probe of compute-sanitizer racecheck (tests/sanitize.py runs it): the hand-off of the next tile
// index through shared memory in upstream FA-3's DynamicPersistentTileScheduler::get_next_work
// (hopper/tile_scheduler.hpp, v2.8.3), reduced to its protocol. One producer warp and two consumer
// warpgroups (as FA-3's warp-specialised kernel), 288 threads on two named barriers:
//   producer: bar.sync EMPTY; lane 0 writes the slot; bar.arrive FULL
//   consumers: bar.sync FULL; read the slot; bar.arrive EMPTY
// PTX orders each write before the reads of that round (arrive FULL -> sync FULL) and each read
// before the next round's write (arrive EMPTY -> sync EMPTY), so the ordered form has no race.
// `racy` drops the barriers: a real race, the control that the tool reports one.
// Usage: named_barrier_handoff ordered|racy; exits 1 if the consumers saw a wrong sum.
#include <cstdio>
#include <cstring>

constexpr int kProducerThreads = 32;
constexpr int kConsumerThreads = 256;
constexpr int kParticipants = kProducerThreads + kConsumerThreads;
constexpr int kEmpty = 1, kFull = 2;  // barrier 0 is __syncthreads'
constexpr int kRounds = 64;

__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(kParticipants) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(kParticipants) : "memory"); }

__global__ void handoff(int* sums, bool ordered) {
    __shared__ volatile int slot;
    const int warp = threadIdx.x / 32;
    if (warp == 0) {  // the producer warp (FA-3: warp 0 of the producer warpgroup)
        for (int round = 0; round < kRounds; ++round) {
            if (ordered) bar_sync(kEmpty);
            if (threadIdx.x == 0) slot = round + 1;
            if (ordered) bar_arrive(kFull);
        }
    } else if (warp >= 4) {  // the consumer warpgroups (FA-3: the MMA warpgroups)
        if (ordered) bar_arrive(kEmpty);  // init_consumer: the slot starts empty
        int sum = 0;
        for (int round = 0; round < kRounds; ++round) {
            if (ordered) bar_sync(kFull);
            sum += slot;
            if (ordered) bar_arrive(kEmpty);
        }
        sums[threadIdx.x - 128] = sum;
    }
}

int main(int argc, char** argv) {
    const bool ordered = argc > 1 && std::strcmp(argv[1], "ordered") == 0;
    int* sums;
    cudaMalloc(&sums, kConsumerThreads * sizeof(int));
    handoff<<<1, 384>>>(sums, ordered);
    int host[kConsumerThreads];
    cudaMemcpy(host, sums, sizeof(host), cudaMemcpyDeviceToHost);
    if (cudaGetLastError() != cudaSuccess) return 2;
    int wrong = 0;
    for (int s : host) wrong += s != kRounds * (kRounds + 1) / 2;
    std::printf("%s: %d of %d consumer sums wrong\n", ordered ? "ordered" : "racy", wrong, kConsumerThreads);
    return ordered && wrong ? 1 : 0;
}
