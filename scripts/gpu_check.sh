#!/usr/bin/env bash
# The one GPU call: tests marked gpu, the roofline, the examples, the GEMM ladder, the attention and serving benches.
# On the device machine: bash scripts/gpu_check.sh   (writes under $OUT, or ./gpu-out)
# PARTS picks what runs (default: all): any of  tests examples ladder sweep ladder-bf16 sweep-bf16 bench-gemm
#   tests-attention sweep-attention bench-attention   ("tests" already includes tests-attention)
#   tests-serving bench-serving   (SERVING_SHAPES picks the serving groups, default all)
#   profile-gemm profile-fp8 profile-quant-gemv (ncu of the GEMMs at 4096^3; of the block-scaled FP8 GEMM;
#                                               of the 4-bit GEMVs beside a read stream; not in the default)
#   tests-gemm-bf16 variants-bf16 host-overhead   (the bf16 GEMM's GPU tests, device-time variants (VARIANT_SET
#                                                  split or epilogue, VARIANT_ROUNDS), host time per call)
#   tests-quant bench-quant   (the quantized formats and kernels; QUANT_SHAPES picks bench groups, default all)
#   fp8-variants   (the block-scaled FP8 GEMM's tile, ring and cluster variants beside Triton and _scaled_mm)
#   suite-level1 suite-level2 suite-level3   (kforge's suites with its own solutions, vs eager and torch.compile)
#   fused-linear host-profile-level3   (fused_linear_bench.py; host and device time of the Level 3 blocks)
#   gemv-rows   (the decode GEMV: its GPU tests and gemv_sweep.py, tiles, the one-token CUDA kernel, ceilings)
#   quant-gemv   (the 4-bit GEMVs: their GPU tests and quant_gemv_sweep.py, CUDA variants, Triton, ceilings)
#   machine   (the machine loop's GPU test: a CUDA-backend reply built in the confined worker and judged end to end)
#   harness   (the judge's tests on the GPU: hostile candidates, defences, the judge's clock and probe)
#   gate2   (gate 2 and gate 1's precision on the GPU: KernelBench's adversarial kernels, a 3% win, an identity;
#            KernelBench's own 23_Softmax and 1_Square_matrix_multiplication_ against hostile candidates,
#            from KB_DIR, default .kb/KernelBench: carry it, it is not in the repository)
#   identity-sample   (scripts/identity_sample.py on every 4th KernelBench problem of KB_LEVELS, default 1,2,3)
#   judge-overhead   (scripts/judge_overhead.py against the tree in OLD_SRC; OVERHEAD_REPEATS, default 2)
#   models   (the Llama engine's GPU tests: 1B against transformers, decode graphs, bottom-right varlen; a generate)
#   bench-model   (kforge bench model on llama3-8b: decode, batch, trace, prefill; BENCH_MODEL_SECONDS, default 360)
#   decode-profile   (scripts/decode_profile.py: one graphed llama3-8b decode step kernel by kernel, in bf16, W4A16, FP8)
#   decode-fused   (the decode fusions' GPU tests: GEMV epilogues (bf16; FP8, W4A16 residual), RoPE + append,
#                   one-launch decode attention, the engine's graphs; then decode_profile.py fused and --unfused,
#                   alternating, twice, in DECODE_WEIGHTS, default bf16; a quantized format also runs with
#                   --quantize-head)
#   decode-ab   (scripts/decode_ab.py: the decode step with FUSED_DECODE on and off in one process, alternating
#                rounds, in DECODE_AB_WEIGHTS, default "bf16 w4a16 fp8")
#   judge-tails   (scripts/judge_tails.py: the judge's raw clocks, the synchronize's tail past each call's stream)
#   decode-sweep   (scripts/paged_decode_sweep.py: batch-1 decode attention's partitions and reduces as a step runs
#                   them, 32 calls in a graph)
#   batch-decode   (llama3-8b at batch 64 x 4k: the skinny-M norm + QKV path's GPU tests, decode_profile.py
#                   --batch 64 --prompt 4000, kforge bench model --parts batch against the compiled baseline;
#                   scripts/paged_decode_batch_sweep.py, attention's tilings against SDPA over a dense cache)
#   mla-sweep   (scripts/mla_decode_sweep.py: MLA decode's tiles, warps, stages and splits at FlashMLA's shapes)
#   mla-ab   (MLA decode's CUDA kernel: its GPU tests, then scripts/mla_backend_ab.py, CUDA against Triton)
#   mla-stages   (scripts/mla_hopper_stages.py: the CUDA MLA kernel with one stage of its tile left out, timed)
#   moe   (the MoE family's GPU tests: routers, dispatch and combine, the grouped GEMMs)
#   moe-fp8-cuda   (the CUDA grouped FP8 GEMM's GPU tests first, under a 300 s timeout (a hung mbarrier must not
#                   take the call), then scripts/moe_fp8_grouping_cost.py and kforge bench moe on the fp8 group)
#   fp8-gemv   (the FP8 decode GEMV's GPU tests, and the engine's FP8 decode through it)
#   deepseek   (chain and tree speculative sampling, MLA decode, DSA's indexer and sparse MLA, the
#               DeepSeek-shaped model's GPU tests and its speculative generation, on the GPU)
#   dsa   (scripts/dsa_sweep.py: DSA against dense MLA decode by context length, the crossover; the FP8 latent cache;
#          DSA prefill (indexer, top-k, sparse MLA) against a dense causal prefill at 4k-32k prompts)
#   abstraction   (the abstraction ladder's GPU tests, then kforge ladder abstraction for the GEMM and the softmax)
#   fp8-attention   (scripts/fp8_attention_speed.py: the FP8 forward with and without its quantization against our
#                    bf16 forward, SDPA flash and cuDNN, one run; then --sweep, the kernel's tiles)
#   tune   (kforge tune gemm: this GPU's GEMM dispatch table, 28 shapes x 6 kernels against cuBLAS; TUNE_ARGS
#           adds options, e.g. "--time-budget 0.5 --shapes '4096,4096,4096'")
#   attention-backward   (the FlashAttention backward's and the FP8 forward's GPU tests, then kforge bench attention
#                         --backward on ATTENTION_BACKWARD_SHAPES: ours, ours with atomic dQ, SDPA flash and cuDNN)
#   flash-hopper   (the CUDA FlashAttention forward's GPU tests and the attention op's, then kforge bench attention
#                   at B 8, H 16, N 4096, hd 128, full and causal: ours, ours-cuda, SDPA flash and cuDNN in one run,
#                   efficient and naive too)
#   bench-mla   (kforge bench mla: FlashMLA's shapes against the eager and compiled compositions; MLA_SHAPES)
#   bench-moe   (kforge bench moe: the grouped GEMMs in bf16 and FP8 against torch._grouped_mm and per-expert loops,
#                DeepSeek-V3's MoE layer against a _grouped_mm composition, split by stage; MOE_SHAPES picks groups
#                or labels, default all: bf16, fp8, gemm, layer, deepgemm, experts; cut at MOE_SECONDS, default 420,
#                then the table is redrawn from the records that landed)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=150
export KFORGE_CACHE_DIR="${KFORGE_CACHE_DIR:-/tmp/kforge-cache}"
parts=" ${PARTS:-tests examples ladder sweep ladder-bf16 sweep-bf16 bench-gemm bench-attention bench-serving} "
out="${OUT:-$PWD/gpu-out}"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check.sh: no NVIDIA GPU on this machine (nvidia-smi finds none): it runs on the device machine" >&2
  exit 2
fi
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$out/nvidia-smi.csv"
python3 -c "import torch, triton, cuda.core; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'cuda.core', cuda.core.__version__)"
# `kforge roofline` measures and caches the ceilings every evaluation below reads.
python3 -m kforge roofline 2>&1 | tee "$out/cli_roofline.txt"
if [[ $parts == *" tests "* ]]; then
  python3 -m pytest -q -m gpu tests 2>&1 | tail -25 | tee "$out/pytest-gpu.txt"
fi
if [[ $parts == *" examples "* ]]; then
  python3 -m kforge eval examples/problems/softmax.py examples/triton/softmax.py --no-save 2>&1 | tee "$out/cli_eval.txt"
  python3 scripts/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.txt"
fi
if [[ $parts == *" sweep "* ]]; then
  python3 -m kforge ladder gemm --dtype fp32 --size 4096 --sweep --time-budget 2 \
    --results "$out/ladder-gemm-fp32-sweep.jsonl" 2>&1 | tee "$out/ladder-sweep.txt"
fi
if [[ $parts == *" ladder "* ]]; then
  python3 -m kforge ladder gemm --dtype fp32 --size 4096 --results "$out/ladder-gemm-fp32.jsonl" 2>&1 \
    | tee "$out/ladder.txt"
fi
if [[ $parts == *" sweep-bf16 "* ]]; then
  python3 -m kforge ladder gemm --dtype bf16 --size 4096 --sweep --time-budget 2 \
    --results "$out/ladder-gemm-bf16-sweep.jsonl" 2>&1 | tee "$out/ladder-bf16-sweep.txt"
fi
if [[ $parts == *" bench-gemm "* ]]; then
  python3 -m kforge bench gemm --results "$out/bench-gemm.jsonl" 2>&1 | tee "$out/bench-gemm.txt"
fi
if [[ $parts == *" ladder-bf16 "* ]]; then
  for size in 4096 8192; do
    python3 -m kforge ladder gemm --dtype bf16 --size $size --results "$out/ladder-gemm-bf16-$size.jsonl" 2>&1 \
      | tee "$out/ladder-bf16-$size.txt"
  done
fi
if [[ $parts == *" tests-gemm-bf16 "* ]]; then
  python3 -m pytest -q -m gpu tests/kernels/test_gemm_bf16.py 2>&1 | tail -25 | tee "$out/pytest-gpu-gemm-bf16.log"
fi
if [[ $parts == *" variants-bf16 "* ]]; then
  python3 scripts/gemm_bf16_variants.py "${VARIANT_ROUNDS:-50}" "${VARIANT_SET:-split}" 2>&1 | tee "$out/gemm-bf16-variants.txt"
fi
if [[ $parts == *" host-overhead "* ]]; then
  python3 scripts/gemm_host_overhead.py 2>&1 | tee "$out/host-overhead.txt"
fi
if [[ $parts == *" fused-linear "* ]]; then
  python3 scripts/fused_linear_bench.py 2>&1 | tee "$out/fused-linear-bench.txt"
fi
if [[ $parts == *" host-profile-level3 "* ]]; then
  python3 scripts/host_profile.py level3.vit_block_bf16 level3.gpt_small_bf16 level3.mlp_stack_bf16 2>&1 \
    | tee "$out/host-profile-level3.txt"
fi
if [[ $parts == *" gemv-rows "* ]]; then
  python3 -m pytest -q -m gpu tests/kernels/test_gemv.py 2>&1 | tail -15 | tee "$out/pytest-gpu-gemv.log"
  python3 scripts/gemv_sweep.py 2>&1 | tee "$out/gemv-sweep.txt"
fi
if [[ $parts == *" quant-gemv "* ]]; then
  python3 -m pytest -q -m gpu tests/kernels/test_w4a16.py tests/kernels/test_nvfp4_gemv.py 2>&1 | tail -15 \
    | tee "$out/pytest-gpu-quant-gemv.log"
  (cd scripts && python3 quant_gemv_sweep.py) 2>&1 | tee "$out/quant-gemv-sweep.txt"
fi
if [[ $parts == *" fp8-variants "* ]]; then
  (cd scripts && python3 fp8_block_variants.py) 2>&1 | tee "$out/fp8-variants.txt"
fi
if [[ $parts == *" tests-quant "* ]]; then
  python3 -m pytest -q -m gpu tests/kernels/test_quant_formats.py tests/kernels/test_w4a16.py \
    tests/kernels/test_nvfp4_gemv.py tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_block_gemm.py 2>&1 | tail -30 | tee "$out/pytest-gpu-quant.log"
fi
if [[ $parts == *" bench-quant "* ]]; then
  python3 -m kforge bench quant --shapes "${QUANT_SHAPES:-all}" --results "$out/bench-quant.jsonl" 2>&1 \
    | tee "$out/bench-quant.txt"
fi
for level in level1 level2 level3; do
  if [[ $parts == *" suite-$level "* ]]; then
    python3 -m kforge suite $level --solutions builtin --baseline both --time-budget "${SUITE_BUDGET:-2}" \
      --results "$out/suite-$level.jsonl" 2>&1 | tail -80 | tee "$out/suite-$level.txt"
  fi
done
if [[ $parts == *" tests-attention "* ]]; then
  python3 -m pytest -q -m gpu tests/kernels/test_attention.py 2>&1 | tail -25 | tee "$out/pytest-gpu-attention.log"
fi
if [[ $parts == *" sweep-attention "* ]]; then
  python3 -m kforge bench attention --sweep --shapes "full N=4096 D=128,causal N=4096 D=128" \
    --results "$out/bench-attention-sweep.jsonl" 2>&1 | tee "$out/bench-attention-sweep.txt"
fi
if [[ $parts == *" bench-attention "* ]]; then
  python3 -m kforge bench attention --results "$out/bench-attention.jsonl" 2>&1 | tee "$out/bench-attention.txt"
fi
if [[ $parts == *" flash-hopper "* ]]; then
  # one small call first, under a short timeout and blocking launches, so a hang costs a minute
  CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 -c "
import torch
from kforge.kernels.attention.flash_hopper import flash_attention_hopper
q, k, v = (torch.randn(1, 1, 128, 64, device='cuda', dtype=torch.bfloat16) for _ in range(3))
out, lse = flash_attention_hopper(q, k, v)
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
print('flash-hopper smoke: max abs error', (out.float() - ref).abs().max().item())" 2>&1 | tail -5 \
    | tee "$out/flash-hopper-smoke.txt"
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider -rfEs -m gpu tests/kernels/test_flash_hopper.py \
    tests/kernels/test_attention.py::test_op_on_the_gpu_takes_the_cuda_forward_at_head_dim_128_and_its_backward_agrees \
    2>&1 \
    | tail -25 | tee "$out/pytest-flash-hopper-gpu.txt"
  timeout 420 python3 -m kforge bench attention --shapes "full N=4096 D=128,causal N=4096 D=128" \
    --results "$out/bench-attention-hopper.jsonl" 2>&1 | tee "$out/bench-attention-hopper.txt"
fi
if [[ $parts == *" tests-serving "* ]]; then
  python3 -m pytest -q -m gpu tests/kernels/test_norms.py tests/kernels/test_swiglu.py tests/kernels/test_rope.py \
    tests/kernels/test_gemv.py tests/kernels/test_norm_qkv.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_flash_varlen.py tests/bench 2>&1 | tail -30 | tee "$out/pytest-gpu-serving.log"
fi
if [[ $parts == *" bench-serving "* ]]; then
  python3 -m kforge bench serving --shapes "${SERVING_SHAPES:-all}" --results "$out/bench-serving.jsonl" 2>&1 \
    | tee "$out/bench-serving.txt"
fi
if [[ $parts == *" profile-fp8 "* ]]; then
  ncu --clock-control none --profile-from-start off --set full -f -o "$out/fp8-block" \
    python3 scripts/profile_fp8_block.py 2>&1 | tail -5 | tee "$out/profile-fp8.log"
  ncu -i "$out/fp8-block.ncu-rep" --page raw --csv \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" > "$out/profile-fp8-stalls.csv" 2>&1
  ncu -i "$out/fp8-block.ncu-rep" --page details > "$out/profile-fp8.txt" 2>&1
  grep -E "fp8_block_gemm|sm90|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Issue Slots|Tensor|Shared|Stall|Registers|Achieved" "$out/profile-fp8.txt" | head -80
fi
if [[ $parts == *" profile-quant-gemv "* ]]; then
  (cd scripts && ncu --clock-control none --profile-from-start off --set full -f -o "$out/quant-gemv" \
    python3 profile_quant_gemv.py) 2>&1 | tail -5 | tee "$out/profile-quant-gemv.log"
  ncu -i "$out/quant-gemv.ncu-rep" --page raw --csv \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" > "$out/profile-quant-gemv-stalls.csv" 2>&1
  ncu -i "$out/quant-gemv.ncu-rep" --page details > "$out/profile-quant-gemv.txt" 2>&1
  kernels="nvfp4_gemv|w4a16_gemv|w4a16_mma|fp8_gemv|read_stream"
  metrics="Duration|Memory Throughput|DRAM Throughput|Issue Slots|Executed Ipc A|Registers|Achieved Occupancy"
  metrics+="|Theoretical Occupancy|No Eligible|Eligible Warps"
  grep -E "$kernels|$metrics" "$out/profile-quant-gemv.txt" | head -130
fi
if [[ $parts == *" profile-gemm "* ]]; then
  ncu --clock-control none --profile-from-start off --set full -f -o "$out/gemm-4096" \
    python3 scripts/profile_gemm.py 2>&1 | tail -5 | tee "$out/profile-gemm.log"
  ncu -i "$out/gemm-4096.ncu-rep" --page details --print-units base --csv > "$out/profile-gemm.csv" 2>&1
  # Why warps wait: cycles per issued instruction spent in each stall reason, per kernel
  ncu -i "$out/gemm-4096.ncu-rep" --page raw --csv \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" > "$out/profile-gemm-stalls.csv" 2>&1
  ncu -i "$out/gemm-4096.ncu-rep" --page details \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section Occupancy --section LaunchStats 2>&1 | tee "$out/profile-gemm.txt" | tail -60
fi
if [[ $parts == *" harness "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs tests/harness/test_hostile.py tests/harness/test_defences.py \
    tests/harness/test_judge_gpu.py tests/harness/test_gpu.py tests/harness/test_profile.py 2>&1 \
    | tee "$out/pytest-harness-gpu.txt" | tail -60  # the whole log kept: a failure's traceback is in it
fi
if [[ $parts == *" judge-tails "* ]]; then
  python3 scripts/judge_tails.py "$out/judge-tails.json" 2>&1 | tee "$out/judge-tails.txt"
fi
if [[ $parts == *" machine "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/machine 2>&1 | tee "$out/pytest-machine-gpu.txt" | tail -30
fi
kb="${KB_DIR:-$PWD/.kb/KernelBench}"
if [[ $parts == *" gate2 "* ]]; then
  judge_tests=tests/harness/test_judge_gpu.py
  [[ $parts == *" harness "* ]] && judge_tests=  # the harness part has run them
  python3 -m pytest -q -p no:cacheprovider -rfEs tests/harness/test_gate2_gpu.py $judge_tests 2>&1 \
    | tail -40 | tee "$out/pytest-gate2-gpu.txt"
  python3 -m kforge eval "$kb/level1/23_Softmax.py" tests/fixtures/candidates/softmax_of_zeros.py --no-save \
    --time-budget 2 2>&1 | tee "$out/eval-kb-softmax-of-zeros.txt"
  python3 -m kforge eval "$kb/level1/1_Square_matrix_multiplication_.py" tests/fixtures/candidates/matmul_fp16.py \
    --no-save --time-budget 2 2>&1 | tee "$out/eval-kb-matmul-fp16.txt"
fi
if [[ $parts == *" identity-sample "* ]]; then
  python3 scripts/identity_sample.py "$kb" "$out" --levels "${KB_LEVELS:-1,2,3}" --budget "${KB_BUDGET:-2}" \
    --only "${KB_ONLY:-}" 2>&1 \
    | tee "$out/identity-sample.txt"
fi
if [[ $parts == *" judge-overhead "* ]]; then
  python3 scripts/judge_overhead.py "${OLD_SRC:?set OLD_SRC to the src folder of the tree to compare with}" "$out" \
    "${OVERHEAD_REPEATS:-2}" 2>&1 | tee "$out/judge-overhead.txt"
fi
if [[ $parts == *" models "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/models \
    "tests/kernels/test_flash_varlen.py::test_bottom_right_causal_on_the_gpu_matches_float64" 2>&1 | tail -20 \
    | tee "$out/pytest-models-gpu.txt"
  python3 -m kforge generate --model llama3-1b --prompt-ids 128000,791,6864,315,9822,374 --max-tokens 128 --json \
    2>&1 | tee "$out/generate-llama3-1b.json"
fi
if [[ $parts == *" moe "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/kernels/test_moe_gating.py tests/kernels/test_moe_dispatch.py \
    tests/kernels/test_moe.py tests/kernels/test_moe_grouped_gemm.py 2>&1 | tail -20 | tee "$out/pytest-moe-gpu.txt"
fi
if [[ $parts == *" moe-fp8-cuda "* ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/kernels/test_moe_grouped_gemm.py \
    -k "cuda_fp8 or contiguous_on_the_gpu" 2>&1 | tail -20 | tee "$out/pytest-moe-fp8-cuda-gpu.txt"
  PYTHONPATH="$PWD/src:$PWD/scripts" timeout 120 python3 scripts/moe_fp8_grouping_cost.py 2>&1 \
    | tee "$out/moe-fp8-grouping-cost.txt"
  timeout 420 python3 -m kforge bench moe --shapes fp8 --results "$out/bench-moe-fp8.jsonl" 2>&1 \
    | tee "$out/bench-moe-fp8.txt" | tail -30
fi
if [[ $parts == *" fp8-gemv "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/kernels/test_fp8_gemv.py tests/models/test_decode_graphs.py \
    -k "fp8 or gemv" 2>&1 | tail -15 | tee "$out/pytest-fp8-gemv-gpu.txt"
fi
if [[ $parts == *" attention-backward "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/kernels/test_flash_backward.py \
    tests/kernels/test_flash_fp8.py 2>&1 | tail -25 | tee "$out/pytest-attention-backward-gpu.txt"
  python3 -m kforge bench attention --backward \
    --shapes "${ATTENTION_BACKWARD_SHAPES:-full N=4096 D=128,causal N=4096 D=128}" \
    --results "$out/bench-attention-backward.jsonl" 2>&1 | tee "$out/bench-attention-backward.txt"
fi
if [[ $parts == *" fp8-attention "* ]]; then
  python3 scripts/fp8_attention_speed.py --results "$out/fp8-attention-speed.jsonl" 2>&1 | tee "$out/fp8-attention-speed.txt"
  python3 scripts/fp8_attention_speed.py --sweep 2>&1 | tee "$out/fp8-attention-sweep.txt"
fi
if [[ $parts == *" tune "* ]]; then  # the GEMM dispatch table of this GPU: 28 shapes x 6 kernels against cuBLAS
  python3 -m kforge tune gemm ${TUNE_ARGS:-} --results "$out/tune-gemm.jsonl" --out "$out/dispatch-gemm-bf16.json" 2>&1 \
    | tail -35 | tee "$out/tune-gemm.txt"
fi
if [[ $parts == *" deepseek "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/kernels/test_speculative_sampling.py \
    tests/kernels/test_speculative_draws.py tests/kernels/test_tree_verification.py tests/kernels/test_mla_decode.py \
    tests/kernels/test_mla_sparse.py tests/kernels/test_mla_sparse_prefill.py \
    tests/models/test_deepseek.py tests/models/test_deepseek_engine.py 2>&1 | tail -8 | tee "$out/pytest-deepseek-gpu.txt"
  python3 -m kforge.models.deepseek --k 1,2,4 --device cuda --dtype bfloat16 2>&1 | tail -12 \
    | tee "$out/deepseek-speculation.txt"
  python3 -m kforge.models.deepseek --requests 32 --slots 8 --k 1,2 --device cuda --dtype bfloat16 2>&1 \
    | tail -6 | tee "$out/deepseek-engine.txt"
fi
if [[ $parts == *" dsa "* ]]; then
  PYTHONPATH=src:scripts timeout 540 python3 scripts/dsa_sweep.py 2>&1 | tee "$out/dsa-sweep.txt"
fi
if [[ $parts == *" abstraction "* ]]; then
  # CuTe DSL and TileLang where scripts/carry_tools/unpack.sh installed them (docs/abstraction.md)
  [[ -f /tmp/tools/env.sh ]] && . /tmp/tools/env.sh
  python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/kernels/test_abstraction.py 2>&1 | tail -8 \
    | tee "$out/pytest-abstraction-gpu.txt"
  for kernel in gemm softmax; do
    python3 -m kforge ladder abstraction --kernel "$kernel" --results "$out/ladder-abstraction-$kernel.jsonl" \
      2>&1 | tee "$out/ladder-abstraction-$kernel.txt"
  done
fi
if [[ $parts == *" bench-mla "* ]]; then
  python3 -m kforge bench mla --shapes "${MLA_SHAPES:-all}" --results "$out/bench-mla.jsonl" 2>&1 | tee "$out/bench-mla.txt"
fi
if [[ $parts == *" bench-moe "* ]]; then
  timeout "${MOE_SECONDS:-420}" python3 -m kforge bench moe --shapes "${MOE_SHAPES:-all}" \
    --results "$out/bench-moe.jsonl" 2>&1 | tee "$out/bench-moe.txt"
  if [[ ${PIPESTATUS[0]} == 124 && -s "$out/bench-moe.jsonl" ]]; then
    echo "bench-moe: cut at ${MOE_SECONDS:-420} s; the records that landed:" | tee -a "$out/bench-moe.txt"
    python3 -m kforge bench moe --replot --results "$out/bench-moe.jsonl" 2>&1 | tee -a "$out/bench-moe.txt"
  fi
fi
if [[ $parts == *" decode-profile "* ]]; then
  for weights in bf16 w4a16 fp8; do
    python3 scripts/decode_profile.py --model llama3-8b --weights $weights 2>&1 | grep -v "UserWarning\|_warn_once" \
      | tee "$out/decode-profile-$weights.txt"
  done
fi
if [[ $parts == *" decode-fused "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemv.py tests/kernels/test_rope_append.py \
    tests/kernels/test_paged_attention.py tests/models/test_decode_graphs.py tests/models/test_llama_gpu.py \
    tests/kernels/test_fp8_gemv.py tests/kernels/test_w4a16.py 2>&1 \
    | tee "$out/pytest-decode-fused-gpu.txt" | tail -30
  for weights in ${DECODE_WEIGHTS:-bf16}; do
    for run in 1 2; do
      for fusions in fused unfused; do
        python3 scripts/decode_profile.py --model llama3-8b --weights $weights $([ $fusions = unfused ] && echo --unfused) \
          2>&1 | grep -v "UserWarning\|_warn_once" > "$out/decode-$weights-$fusions-$run.txt"
        echo "$weights $fusions run $run: $(grep -m1 "^# step" "$out/decode-$weights-$fusions-$run.txt")"
      done
      if [[ $weights != bf16 ]]; then  # the LM head in the same format (quantize_head): what its bytes cost
        python3 scripts/decode_profile.py --model llama3-8b --weights $weights --quantize-head 2>&1 \
          | grep -v "UserWarning\|_warn_once" > "$out/decode-$weights-head-$run.txt"
        echo "$weights head quantized run $run: $(grep -m1 "^# step" "$out/decode-$weights-head-$run.txt")"
      fi
    done
  done
fi
if [[ $parts == *" decode-ab "* ]]; then
  for weights in ${DECODE_AB_WEIGHTS:-bf16 w4a16 fp8}; do
    python3 scripts/decode_ab.py --model llama3-8b --weights $weights 2>&1 | grep -v "UserWarning\|_warn_once" \
      | tee "$out/decode-ab-$weights.txt" | tail -2
  done
fi
if [[ $parts == *" decode-sweep "* ]]; then
  python3 scripts/paged_decode_sweep.py 2>&1 | tee "$out/paged-decode-sweep.txt"
fi
if [[ $parts == *" batch-decode "* ]]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_norm_qkv.py 2>&1 | tail -3 \
    | tee "$out/pytest-norm-qkv-gpu.txt"
  python3 scripts/decode_profile.py --model llama3-8b --batch 64 --prompt 4000 2>&1 | grep -v "UserWarning\|_warn_once" \
    > "$out/decode-profile-bf16-batch64.txt"
  grep "^# step\|^layer\|^kernels" "$out/decode-profile-bf16-batch64.txt"
  timeout 200 python3 -m kforge bench model --model llama3-8b --parts batch --compile-mode reduce-overhead \
    --results "$out/bench-model-batch.jsonl" 2>&1 | grep -v "UserWarning\|_warn_once" | tee "$out/bench-model-batch.txt" \
    | grep "batch ours\|batch compiled"
  (cd scripts && python3 paged_decode_batch_sweep.py) 2>&1 | tee "$out/paged-decode-batch-sweep.txt" | tail -6
fi
if [[ $parts == *" mla-ab "* ]]; then
  timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_mla_decode_hopper.py 2>&1 | tail -25 \
    | tee "$out/pytest-gpu-mla-hopper.txt"
  PYTHONPATH=src:scripts timeout 400 python3 scripts/mla_backend_ab.py ${MLA_AB_LENGTHS:-4096 8192} 2>&1 \
    | tee "$out/mla-backend-ab.txt"
fi
if [[ $parts == *" mla-stages "* ]]; then
  PYTHONPATH=src:scripts timeout 300 python3 scripts/mla_hopper_stages.py 2>&1 | tee "$out/mla-hopper-stages.txt"
fi
if [[ $parts == *" mla-sweep "* ]]; then
  (cd scripts && python3 mla_decode_sweep.py) 2>&1 | grep -v "UserWarning\|_warn_once" | tee "$out/mla-decode-sweep.txt"
fi
if [[ $parts == *" bench-model "* ]]; then
  timeout 540 python3 -m kforge bench model --model llama3-8b --parts "${BENCH_MODEL_PARTS:-decode,batch,trace,prefill}" \
    --compile-mode reduce-overhead --max-seconds "${BENCH_MODEL_SECONDS:-360}" --results "$out/bench-model.jsonl" 2>&1 \
    | tee "$out/bench-model.txt"
fi
