// Hopper parts: the persistent tile scheduler. One CTA per SM (or per cluster of Cluster CTAs on
// consecutive row tiles sharing one column of B) walks a list of jobs; a job is one output tile and a
// range [k0, k1) of its k-tiles. The order is grouped (tile_coords: GROUP_M rows of tiles at a time,
// column by column inside a group), so the tiles in flight share panels of A and B in L2. How a tile's
// K is shared out is the Reduction policy:
//   WholeTiles  every job a whole tile: tiles blockIdx.x, + gridDim.x, ...;
//   SplitK      every tile `splits` times, one K range each (for shapes with fewer tiles than SMs);
//   StreamK<N>  whole tiles while every CTA has one (the full waves); the remaining tiles' k-tiles,
//               taken in order, are cut into gridDim.x equal shares (at least N k-tiles each, else the
//               partial wave runs as whole tiles), so no CTA idles through a partial last wave. A share
//               is shorter than a tile, so it covers the end of one tile and the start of the next at most.
// Split and shared tiles leave fp32 partials that the last arrival adds up (the kernel's fix-up).
// Why a part: which tile a CTA does next is independent of how it computes one; the producer and the
// consumers walk the same list, each with its own copy of the scheduler.
#pragma once
#include "common.cuh"

// Which output tile the `tile`-th job is: GROUP_M rows of tiles at a time, walked column
// by column inside a group, so the CTAs running together share A and B panels in L2.
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int group_m, int& tm, int& tn) {
    const int per_group = group_m * tiles_n, first = (tile / per_group) * group_m;
    const int rows = min(tiles_m - first, group_m), in_group = tile % per_group;
    tm = first + in_group % rows;
    tn = in_group / rows;
}

struct WholeTiles {
    static constexpr bool split_k = false, stream_k = false;
    static constexpr int stream_k_min = 0;
};
struct SplitK {
    static constexpr bool split_k = true, stream_k = false;
    static constexpr int stream_k_min = 0;
};
template <int MinKTiles>  // k-tiles a CTA's share must reach, else the partial wave runs as whole tiles
struct StreamK {
    static constexpr bool split_k = false, stream_k = true;
    static constexpr int stream_k_min = MinKTiles;
};
// The policy named by a kernel's split-K and stream-K switches: one or the other, never both (no such type).
template <int SplitK_, int StreamK_, int MinKTiles> struct ReductionOf;
template <int Min> struct ReductionOf<0, 0, Min> { using type = WholeTiles; };
template <int Min> struct ReductionOf<1, 0, Min> { using type = SplitK; };
template <int Min> struct ReductionOf<0, 1, Min> { using type = StreamK<Min>; };

struct Job { int tile, split, k0, k1; };

// This CTA's jobs in order (see above); `tiles` counts jobs of a cluster (one tile per CTA of it).
template <int Cluster, class Reduction>
struct TileScheduler {
    static constexpr bool stream_k = Reduction::stream_k;
    static_assert(!stream_k || Cluster == 1, "stream-K: one CTA a tile");
    int k_tiles, splits, next_job, end_job, whole_tiles;
    long long shared_next, shared_end;
    __device__ TileScheduler(int tiles, int k_tiles_, int splits_) : k_tiles(k_tiles_), splits(splits_) {
        const int ctas = gridDim.x / Cluster, rest = tiles % ctas;
        whole_tiles = stream_k && (long long)rest * k_tiles >= (long long)ctas * Reduction::stream_k_min ? tiles - rest
                                                                                                         : tiles;
        next_job = blockIdx.x / Cluster, end_job = whole_tiles * splits;
        shared_next = share_start(blockIdx.x, tiles), shared_end = share_start(blockIdx.x + 1, tiles);
    }
    __device__ long long share_start(int cta, int tiles) const {  // the first shared k-tile of a CTA's share
        return stream_k ? (long long)(tiles - whole_tiles) * k_tiles * cta / gridDim.x : 0;
    }
    __device__ bool next(Job& job) {
        if (next_job < end_job) {
            job.tile = next_job / splits, job.split = next_job % splits;
            job.k0 = job.split * k_tiles / splits, job.k1 = (job.split + 1) * k_tiles / splits;
            next_job += gridDim.x / Cluster;
            return true;
        }
        if (!stream_k || shared_next >= shared_end) return false;
        job.tile = whole_tiles + int(shared_next / k_tiles), job.split = 0;
        job.k0 = int(shared_next % k_tiles), job.k1 = int(min((long long)k_tiles, job.k0 + shared_end - shared_next));
        shared_next += job.k1 - job.k0;
        return true;
    }
};
