// Hopper parts: the TMA + mbarrier pipeline. A ring of Stages shared-memory stages, each with two
// mbarriers: `full[s]` completes a phase when the stage's bytes have landed (the producer arrives once
// with the byte count; TMA counts the bytes down) and `empty[s]` when every consumer warp that reads the
// stage has released it. Positions are counted from the start of the kernel, across tiles: position `it`
// is stage it % Stages in lap it / Stages, whose phase parity is (it / Stages) & 1 on `full` and the
// opposite on `empty` (the first lap finds every stage free). A parity wait cannot tell phase p from
// p + 2, so no waiter may fall a whole lap behind: the ring's users keep that by construction.
// Why a part: the producer/consumer handshake is the same in every warp-specialized Hopper kernel, and
// a wrong parity or a missed release hangs the GPU; written once, it is checked once.
#pragma once
#include "common.cuh"

// ---- mbarriers: a phase completes when its expected arrivals and bytes have all come ----

__device__ __forceinline__ void mbar_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals));
}
// Makes the initialised barriers visible to the copy engine and to the other CTAs of a cluster.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Arrive once and tell the barrier `bytes` more will land through TMA in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Arrive on the barrier at the same offset in CTA `cta` of this cluster (possibly this one).
__device__ __forceinline__ void mbar_arrive_cluster(u64* bar, u32 cta) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_u32(bar)),
        "r"(cta)
        : "memory");
}
// Spin until the phase with this parity (0, 1, 0, ...) has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// ---- the stage ring ----

// The ring's 2 x Stages barriers (full, then empty) at `barriers`, in shared memory. Cluster > 1: the
// stages are loaded by multicast into every CTA of a cluster, so a consumer frees a stage in all of them.
template <int Stages, int Cluster = 1>
struct StageRing {
    u64* full;
    u64* empty;
    __device__ __forceinline__ explicit StageRing(u64* barriers) : full(barriers), empty(barriers + Stages) {}

    // One thread, before anyone uses the ring (then fence_barrier_init and a CTA or cluster barrier):
    // `arrivals` producers' arrivals complete a full phase (besides the bytes), `releases` an empty one.
    __device__ __forceinline__ void init(u32 arrivals, u32 releases) const {
        for (int s = 0; s < Stages; ++s) {
            mbar_init(&full[s], arrivals);
            mbar_init(&empty[s], releases);
        }
    }
    // Producer: wait until position `it`'s stage is free (its previous lap released); returns the stage.
    __device__ __forceinline__ int acquire(int it) const {
        const int s = it % Stages;
        mbar_wait(&empty[s], ((it / Stages) & 1) ^ 1);
        return s;
    }
    // Producer: arrive on stage s's full barrier, `bytes` to come by TMA (whose loads name full_bar(s)).
    __device__ __forceinline__ void expect(int s, u32 bytes) const { mbar_arrive_expect_tx(&full[s], bytes); }
    __device__ __forceinline__ u64* full_bar(int s) const { return &full[s]; }

    // Consumer: wait until stage s's phase `parity` has landed.
    __device__ __forceinline__ void wait(int s, u32 parity) const { mbar_wait(&full[s], parity); }
    // Consumer: the same by position; returns the stage.
    __device__ __forceinline__ int wait_at(int it) const {
        const int s = it % Stages;
        mbar_wait(&full[s], (it / Stages) & 1);
        return s;
    }
    // Consumer warp (lane 0 arrives): done reading stage s, in every CTA it was loaded for.
    __device__ __forceinline__ void release(int s, int lane) const {
        if (lane != 0) return;
        if (Cluster == 1) mbar_arrive(&empty[s]);
        else
            for (int r = 0; r < Cluster; ++r) mbar_arrive_cluster(&empty[s], r);
    }
};

// A consumer's place in the ring as a stage and a phase bit, advanced once a k-tile (cheaper than
// dividing a position).
template <int Stages>
struct RingCursor {
    int stage = 0;
    u32 phase = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == Stages) stage = 0, phase ^= 1;
    }
};
