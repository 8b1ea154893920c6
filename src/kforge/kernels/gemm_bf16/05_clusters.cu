// Rung 5: thread-block clusters with TMA multicast, and a tile order that keeps L2 warm.
// What changed: rung 4's kernel with CLUSTER_M = 2. Two CTAs on neighbouring SMs form a
// cluster and take two vertically adjacent tiles that need the same B panel: each loads
// its own A tile but only half of the B tile, multicast into both CTAs' shared memory
// (one L2 read feeds two SMs). A stage is free only when the consumers of both CTAs are
// done with it, so consumers arrive on the "empty" barriers of every CTA in the cluster
// (mapa + a cluster-scope arrive). Grouped tile order (GROUP_M row-blocks at a time) keeps
// the A and B panels of the tiles in flight resident in L2.
// Why: at 128 x 256 tiles and BK 64 each SM pulls ~48 KB per k-tile through L2; halving
// the B traffic lowers L2 bandwidth pressure, which shows at the largest sizes.
// Predicted: a few % over rung 4 at 8192^3; little at 4096^3.
#define CLUSTER_M 2
#include "04_persistent.cu"
