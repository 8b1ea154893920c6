"""Row reductions in Triton: softmax, log-softmax, cross-entropy, row statistics, cumulative
sums and top-k, each over the last dimension of a (rows, columns) view. Memory-bound: the
target is one read of the input (and one write of the output) at HBM bandwidth."""
