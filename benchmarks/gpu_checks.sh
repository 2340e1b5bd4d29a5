#!/usr/bin/env bash
# The checks a lent GPU is for, as one script within one time budget: the GPU-only tests (cuDNN attention in
# the model, Pallas kernels on the device), real train steps of `grpo_gpu` at its full shape, the GRPO update
# against PyTorch, profiles and the sampler's decode. Each part gets its own time limit and a part that fails or
# runs out of time does not stop the next; everything is logged to OUTDIR/log.txt and each benchmark writes
# its JSON and markdown to OUTDIR.
#
#   bash benchmarks/gpu_checks.sh OUTDIR [SECONDS [PARTS]]
# A machine whose Python lacks some of guijax's dependencies (a GPU box's stock image had no grain,
# array_record, ml_collections or portpicker) needs them first, e.g. as wheels: pip install --target DIR
# *.whl and PYTHONPATH=DIR; the script adds the repository itself to PYTHONPATH.
# SECONDS: the whole budget (default 560); PARTS: which parts, in which order (default: what has not run on
# a GPU yet or has changed since, machine,grpo_gpu_scan,attention_packed_0_5b,sampler_7b,remat_gui_0_5b,
# vs_torch_gui_0_5b_cudnn,vs_torch_gui_3b,grpo_gpu_frozen_tower_scan). Also:
#   gpu_tests: the GPU-only tests (cuDNN attention, its packed layout, Pallas kernels);
#   grpo_gpu_step: the 7B step training every parameter, its layers unrolled (84.43 GiB: an H200, not an H100);
#   grpo_gpu_scan: the same with its layers under scan, as the recipe runs (68.69 GiB compiled by XLA:GPU
#     without a GPU: one H100);
#   vs_torch_0_5b: the 0.5B update against PyTorch on text rows;
#   grpo_gpu_frozen_tower, grpo_gpu_frozen_tower_scan, grpo_gpu_lora: the 7B step with the vision tower frozen
#     (unrolled, or its layers under scan) or as LoRA r128 (unrolled);
#   train_step_gui_0_5b: the 0.5B update on a row of 5 full-HD screenshots;
#   remat_gui_0_5b: the same update under each remat policy the GPU recipes choose between (full,
#     attention_saveable, dots_saveable), one after the other (the benchmark's 0.5B model has a one-block
#     stand-in vision tower, so this times the decoder's policies, not a 7B recipe's);
#   vs_torch_gui_0_5b, vs_torch_gui_3b: GUI rows against PyTorch, one side after the other (the 3B in bf16);
#   vs_torch_gui_0_5b_cudnn: the 0.5B GUI rows with cuDNN attention named: no run-time layout check (a lax.cond
#     per attention call under `auto`) before each attention;
#   profile_gui_0_5b: a kernel-level profile of the 0.5B GUI step;
#   attention_packed_0_5b: the 0.5B update on one 16,384-token row, unpacked (cuDNN attention under `auto`)
#     against two 8,192-token steps packed into it, under `auto` (cuDNN's packed layout on a Hopper GPU) and
#     the blockwise path (`xla`), which decides whether packing the GPU recipes' rows pays;
#   sampler_7b: the 7B sampler's decode at batch 8 and 64 with screenshot-length prompts (prefilled 8 rows at a
#     time) against its roofline; each batch size's row is written as it finishes.
set -u
out=${1:?usage: gpu_checks.sh OUTDIR [SECONDS [PARTS]]}
budget=${2:-560}
parts=${3:-machine,grpo_gpu_scan,attention_packed_0_5b,sampler_7b,remat_gui_0_5b,vs_torch_gui_0_5b_cudnn,vs_torch_gui_3b,grpo_gpu_frozen_tower_scan}
mkdir -p "$out"
log="$out/log.txt"
start=$(date +%s)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"

part() {  # part NAME SECONDS COMMAND...: run with at most SECONDS, never past the whole budget
  local name=$1 limit=$2; shift 2
  local left=$(( budget - ($(date +%s) - start) ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then echo "== $name: skipped, ${left}s of the budget left" | tee -a "$log"; return; fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$log"
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  echo "== $name: exit $? after $(( $(date +%s) - t0 ))s" | tee -a "$log"
}

run_part() {
  case $1 in
    machine) part machine 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
      python3 -c "import jax, jaxlib, flax, optax; print(jax.devices(), jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__)"' ;;
    gpu_tests) part gpu_tests 150 python3 -m pytest -q -p no:xdist -o addopts="-p no:cacheprovider --import-mode=importlib" \
      -m gpu tests/guijax/test_attention.py tests/guijax/test_cudnn_packed.py tests/guijax/test_kernels.py ;;
    grpo_gpu_step) part grpo_gpu_step 330 python3 benchmarks/recipe_step.py --config=grpo_gpu \
      --config.model.scan_layers=False --steps=3 \
      --json="$out/recipe_step_grpo_gpu.json" --markdown="$out/recipe_step_grpo_gpu.md" ;;
    grpo_gpu_scan) part grpo_gpu_scan 220 python3 benchmarks/recipe_step.py --config=grpo_gpu \
      --config.model.scan_layers=True --steps=3 --json="$out/recipe_step_grpo_gpu_scan.json" \
      --markdown="$out/recipe_step_grpo_gpu_scan.md" ;;
    grpo_gpu_frozen_tower) part grpo_gpu_frozen_tower 220 python3 benchmarks/recipe_step.py --config=grpo_gpu \
      --config.model.frozen='("visual",)' --config.model.scan_layers=False --steps=3 \
      --json="$out/recipe_step_grpo_gpu_frozen_tower.json" --markdown="$out/recipe_step_grpo_gpu_frozen_tower.md" ;;
    grpo_gpu_frozen_tower_scan) part grpo_gpu_frozen_tower_scan 220 python3 benchmarks/recipe_step.py --config=grpo_gpu \
      --config.model.frozen='("visual",)' --config.model.scan_layers=True --steps=3 \
      --json="$out/recipe_step_grpo_gpu_frozen_tower_scan.json" \
      --markdown="$out/recipe_step_grpo_gpu_frozen_tower_scan.md" ;;
    grpo_gpu_lora) part grpo_gpu_lora 220 python3 benchmarks/recipe_step.py --config=grpo_gpu --config.lora.rank=128 \
      --config.model.scan_layers=False --steps=3 --json="$out/recipe_step_grpo_gpu_lora.json" \
      --markdown="$out/recipe_step_grpo_gpu_lora.md" ;;
    attention_packed_0_5b) part attention_packed_0_5b 240 python3 benchmarks/attention_tile.py --preset qwen2_5_0_5b \
      --rows 1 --seq 16384 --examples 0,8192 --attention auto,xla --blocks 512 --dtype bfloat16 --repeats 3 \
      --json="$out/attention_packed_0_5b.json" --markdown="$out/attention_packed_0_5b.md" ;;
    train_step_gui_0_5b) part train_step_gui_0_5b 75 python3 benchmarks/train_step.py --presets qwen2_5_0_5b \
      --batch 1 --screenshots 5 --remat full --repeats 3 --json="$out/train_step_gui_0_5b.json" \
      --markdown="$out/train_step_gui_0_5b.md" ;;
    remat_gui_0_5b) part remat_gui_0_5b 240 bash -c 'for policy in full attention_saveable dots_saveable; do
      python3 benchmarks/train_step.py --presets qwen2_5_0_5b --batch 1 --screenshots 5 --remat $policy --repeats 3 \
        --json="$0/train_step_gui_0_5b_remat_$policy.json" --markdown="$0/train_step_gui_0_5b_remat_$policy.md"; done' "$out" ;;
    vs_torch_gui_0_5b) part vs_torch_gui_0_5b 160 python3 benchmarks/vs_torch.py --device cuda --dtype bfloat16 \
      --preset qwen2_5_0_5b --batch 1 --screenshots 5 --remat full --sequential --repeats 5 \
      --json="$out/vs_torch_gui_qwen2_5_0_5b.json" \
      --markdown="$out/vs_torch_gui_qwen2_5_0_5b.md" ;;
    vs_torch_gui_0_5b_cudnn) part vs_torch_gui_0_5b_cudnn 160 python3 benchmarks/vs_torch.py --device cuda \
      --dtype bfloat16 --preset qwen2_5_0_5b --batch 1 --screenshots 5 --remat full --sequential --attention cudnn \
      --repeats 5 --json="$out/vs_torch_gui_qwen2_5_0_5b_cudnn.json" \
      --markdown="$out/vs_torch_gui_qwen2_5_0_5b_cudnn.md" ;;
    vs_torch_gui_3b) part vs_torch_gui_3b 300 python3 benchmarks/vs_torch.py --device cuda --dtype bfloat16 \
      --param-dtype bfloat16 --sequential --preset qwen2_5_vl_3b --batch 1 --screenshots 5 --remat full \
      --torch-checkpointing --repeats 3 --json="$out/vs_torch_gui_qwen2_5_vl_3b.json" \
      --markdown="$out/vs_torch_gui_qwen2_5_vl_3b.md" ;;
    profile_gui_0_5b) part profile_gui_0_5b 120 python3 benchmarks/profile_step.py --preset qwen2_5_0_5b --batch 1 \
      --screenshots 5 --seq 0 --remat full --steps 2 --top 25 --dtype bfloat16 \
      --json "$out/profile_step_gui_0_5b.json" --md "$out/profile_step_gui_0_5b.md" ;;
    sampler_7b) part sampler_7b 420 python3 benchmarks/rollout.py --parts sampler --sampler-preset qwen2_5_vl_7b \
      --sampler-dtype bfloat16 --batches 8,64 --prompt-len 13952 --new-tokens 256 --prefill-rows 8 --repeats 1 \
      --json "$out/rollout_sampler_7b.json" --markdown "$out/rollout_sampler_7b.md" ;;
    vs_torch_0_5b) part vs_torch_0_5b 120 python3 benchmarks/vs_torch.py --device cuda --dtype bfloat16 \
      --preset qwen2_5_0_5b --batch 8 --seq 1024 --repeats 7 --json="$out/vs_torch_qwen2_5_0_5b.json" \
      --markdown="$out/vs_torch_qwen2_5_0_5b.md" ;;
    *) echo "unknown part $1 (machine, gpu_tests, grpo_gpu_step, grpo_gpu_scan, grpo_gpu_frozen_tower," \
            "grpo_gpu_frozen_tower_scan, grpo_gpu_lora, attention_packed_0_5b," \
            "train_step_gui_0_5b, remat_gui_0_5b, vs_torch_gui_0_5b, vs_torch_gui_0_5b_cudnn, vs_torch_gui_3b, profile_gui_0_5b, sampler_7b," \
            "vs_torch_0_5b)" | tee -a "$log"; exit 2 ;;
  esac
}
for name in ${parts//,/ }; do run_part "$name"; done
echo "== done in $(( $(date +%s) - start ))s" | tee -a "$log"
