"""Layout kernels: moving data without arithmetic, judged by the share of copy bandwidth."""
