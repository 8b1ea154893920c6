"""The machine code of the row-reduction, transpose and elementwise-chain kernels, compiled for
the H100 (sm_90) on any machine, as their docstrings describe it: 16-byte vector loads,
no spills, and the registers that let the intended number of programs share an SM (the
two-pass kernels' persistent grid places two 512-thread programs an SM, so at most 64
registers; top-k's stage 1 is meant to run three 128-thread programs an SM)."""

import pytest

from triton_sm90 import compile_sm90, spec

R = "kforge.kernels.reductions."


def _ints(*names):
    return {name: "i32" for name in names}


def _specs():
    specs = []
    for dt in ("bf16", "fp32"):
        rows = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", **_ints("n_rows", "n_cols", "x_stride", "out_stride")}
        aligned = ("x_ptr", "out_ptr", "x_stride", "out_stride", "n_cols")
        for module, kernel in (("softmax", "softmax"), ("log_softmax", "log_softmax"), ("cumsum", "cumsum")):
            looped = dict(rows) if module != "cumsum" else {k: v for k, v in rows.items() if k != "n_rows"}
            specs += [spec(f"{kernel} looped {dt}", R + module, f"{kernel}_looped_kernel", looped, {"CHUNK": 8192},
                           aligned=aligned, num_warps=16),
                      spec(f"{kernel} rows 16384 {dt}", R + module, f"{kernel}_rows_kernel", rows,
                           {"BLOCK_ROWS": 1, "BLOCK_COLS": 16384}, aligned=aligned, num_warps=16),
                      spec(f"{kernel} rows 2x1024 {dt}", R + module, f"{kernel}_rows_kernel", rows,
                           {"BLOCK_ROWS": 2, "BLOCK_COLS": 1024}, aligned=aligned, num_warps=4)]
    stats = {"x_ptr": "*bf16", "mean_ptr": "*fp32", "var_ptr": "*fp32", "correction": "fp32"}
    specs += [
        spec("cross_entropy bf16", R + "cross_entropy", "cross_entropy_rows_kernel",
             {"x_ptr": "*bf16", "targets_ptr": "*i64", "loss_ptr": "*fp32",
              **_ints("n_cols", "x_stride", "ignore_index")},
             {"CHUNK": 8192}, aligned=("x_ptr", "x_stride", "n_cols"), num_warps=16),
        spec("row_mean_var rows 8192 bf16", R + "row_reduce", "row_mean_var_rows_kernel",
             {**stats, **_ints("n_rows", "n_cols", "x_stride")}, {"BLOCK_ROWS": 1, "BLOCK_COLS": 8192},
             aligned=("x_ptr", "x_stride", "n_cols"), num_warps=16),
        spec("row_mean_var looped bf16", R + "row_reduce", "row_mean_var_looped_kernel",
             {**stats, **_ints("n_cols", "x_stride")}, {"CHUNK": 8192}, aligned=("x_ptr", "x_stride", "n_cols"),
             num_warps=16),
        spec("topk chunks", R + "topk", "topk_chunks_kernel",
             {"x_ptr": "*fp32", "work_ptr": "*i64", **_ints("n_cols", "x_stride", "k")}, {"CHUNK": 2048, "K_PAD": 64},
             aligned=("x_ptr", "x_stride", "n_cols"), num_warps=4),
        spec("topk merge", R + "topk", "topk_merge_kernel",
             {"work_ptr": "*i64", "values_ptr": "*fp32", "indices_ptr": "*i64", **_ints("n_candidates", "k")},
             {"CANDIDATES": 4096}, num_warps=8),
        spec("transpose bf16", "kforge.kernels.layout.transpose", "transpose_kernel",
             {"x_ptr": "*bf16", "out_ptr": "*bf16", **_ints("n_rows", "n_cols", "x_batch_stride", "x_row_stride")},
             {"TILE_M": 64, "TILE_N": 64, "x_col_stride": 1},
             aligned=("x_ptr", "out_ptr", "n_rows", "n_cols", "x_batch_stride", "x_row_stride"), num_warps=4),
        spec("chain bf16", "kforge.kernels.elementwise.chain", "gated_gelu_residual_kernel",
             {"x_ptr": "*bf16", "gate_ptr": "*bf16", "residual_ptr": "*bf16", "out_ptr": "*bf16", "numel": "i32"},
             {"BLOCK": 2048}, aligned=("x_ptr", "gate_ptr", "residual_ptr", "out_ptr", "numel"), num_warps=8),
    ]
    return specs


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_vector_loads_and_the_registers_their_occupancy_needs():
    found = compile_sm90(_specs())
    for label, kernel in found.items():
        if label != "topk merge":  # its loads are one int64 a thread
            assert kernel["ldg128"] > 0, (label, kernel)
        assert kernel["spills"] == 0 and kernel["local"] == 0, (label, kernel)
    assert found["topk chunks"]["registers"] <= 65536 // (3 * 128), found["topk chunks"]  # three programs an SM
    for dt in ("bf16", "fp32"):
        for kernel in ("softmax", "log_softmax"):
            assert found[f"{kernel} looped {dt}"]["registers"] <= 64, found[f"{kernel} looped {dt}"]
    assert found["cross_entropy bf16"]["registers"] <= 32  # four 512-thread programs an SM
    transpose = found["transpose bf16"]  # turned through shared memory, written in 16-byte vectors
    assert transpose["shared"] >= 64 * 64 * 2 and transpose["stg128"] > 0, transpose
    assert found["chain bf16"]["ldg128"] == 3 and found["chain bf16"]["stg128"] == 1  # one vector a stream a thread
