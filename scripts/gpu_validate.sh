#!/usr/bin/env bash
# GPU validation and benchmarks, in parts that each fit one device call (< 10 minutes on the H100).
#
#   bash scripts/gpu_validate.sh PART [PART ...]      (from the repository root, on the GPU machine)
#
# Results go to $OUT (the device tool's output folder; ./gpu_out when unset), one sub-folder per part.
# Every part's output goes to $OUT/<part>/log.txt as it runs (and to stdout), so a killed call keeps it.
# Parts:
#   smoke      clean smoke of the main kernel variants and the split-key decode (~1 min)
#   tests      GPU tests of both kernels under one forced block config
#   autotuned  the GPU attention tests that compare with fp32 attention and count false positives, with the
#              autotuner's own configs (the "tests" part forces one; a config the autotuner or the repairing
#              launch derives can fail to load, as 254 KB of shared memory once did; ~5 min on a fresh machine)
#   attention  scripts/bench_attention.py (all shapes, fp16 + bf16; ~6 min) -> bench_attention.csv/png
#   quick      scripts/bench_attention.py --quick (fp16, 12 shapes; ~2 min with compilation)
#   quickgraph the same timed under CUDA graphs (kernel time without host launch overhead)
#   coverage   EFTA coverage campaign: 1,000 flips per site x bit class, 100,000 clean calls over four
#              distributions, a protected MiniLM run (carry .gpucarry/minilm, see efta_coverage.py)
#   linear     V-ABFT: calibration, GPU tests, bench_linear, the V-ABFT specification study (docs/vabft.md)
#   gemm       the checked GEMM's GPU tests and bench_linear with CUDA-graph and pointer-load columns
#   parts      a decode GEMM call in parts (plain, GEMM launch alone, two launches, one launch), fp16
#   profile    torch.profiler tables of Qwen2-0.5B's compiled decode (attention-only and full protection)
#   compiled   Qwen2-0.5B's compiled decode (CUDA graphs), variants interleaved (issue 7's decode target)
#   generate   scripts/bench_generate.py (end to end, issue 7)
#   campaign   the issue-5 campaign on the qwen2-0.5b-config model, fp16, Triton paths
#   falsepos   every attention / Linear call of fp16 generations (GPT-2 124M and Qwen2-0.5B configs)
#   kvtables   a KV cache's stored checksum tables: their GPU tests, then decode on stored tables against
#              tables made per call (CUDA graphs, quick shapes)
#   lmhead     lm_head tightness of the shipped thresholds, fp16 and bf16 (issue 38's 0.05 target)
#   cublasform the checked GEMM as cuBLAS's fp32-output product plus the group check (Qwen2 layer shapes)
#   reliability issue 38's GPU measurements, spread over the visible GPUs (4 on nvidia-h100-x4; ~9 min): the
#              token-level campaign on the qwen2-0.5b-config model (fp16 and bf16; protection on 10,000 trials,
#              off 2,000; stores resumed from $RESUME/<name>.jsonl when present), the tightness of Qwen2-0.5B and
#              Qwen2-7B dims, clean generations; everything packed into reliability.tar.gz (REL_JOBS: a subset of
#              "tokens tight falsepos"; TOKENS_ARMS: "on", "off" or both; a campaign still in its clean phase after
#              4 minutes gets SIGUSR1 and writes its threads' stacks into its log)
#   tpratio    issue 41's ratio: Qwen2-7B dims at tp = 1, then tp = 4 against it, eager and compiled decode (CUDA
#              graphs), no flips (4 GPUs: nvidia-h100-x4; ~9 min); TP_TOKENS, TP_PROFILE=1, TP_WORKLOADS (tp_check's
#              --workloads, e.g. decode_compiled; TP_NPROC: the second size, default 4); a fresh machine spends ~80 s compiling the kernels per variant
#   split      the threshold's variance terms with their own unit error (issue 38): calibrates fp16/bf16 (x's
#              outlier estimate, with the K trend; into the device's table, copied to the part's folder), then
#              the Linear classes' tightness of Qwen2-0.5B and Qwen2-7B dims and clean generations with it (~9 min);
#              SPLIT_DTYPES (e.g. bfloat16): the dtypes whose table entries take the split (default fp16 and bf16)
#   cprobe     where a clean check's difference comes from, the sums or the checksum C (q, down, lm_head of Qwen2-0.5B
#              and 7B dims, fp16 and bf16; scripts/checksum_error_probe.py, ~2 min)
#   verifyab   the group verification against an older tree in $BASELINE (default .baseline; `git archive <commit>
#              ft_transformers kernels patches scripts tests pyproject.toml | tar -x -C .baseline`, carried): the
#              repeated-call checksum test and the real-shape test, the fp16 lm_head checksum probe, then
#              bench_linear's short and layer shapes under CUDA graphs through gpu_ab.sh (~6 min)
#   fusedab    the group checksums as checksum tiles of the GEMM's launch (the default) against the verification's
#              own K loop (Options.gemm_fused False), side by side: the GPU tests of the tile and persistent forms,
#              then bench_linear --unfused (FUSED_KINDS, FUSED_DTYPES, FUSED_MODELS, FUSED_ROUNDS; ~7 min)
#   caltrend   the accumulator e_max's slack per distribution and K, past k_ref (fp16, bf16, x's outlier estimate;
#              written to the part's folder, the shipped tables untouched)
#   xvar       x's outlier variance estimate in the GEMM threshold (FTT_GEMM_XVAR=1, issue 38), ~9 min: its own
#              accumulator e_max (fp16, bf16; written into the device's e_max table, copied to the part's folder),
#              then lm_head tightness and clean generations (GPT-2 124M and Qwen2-0.5B configs) with it
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || {
  echo "pip install -e . failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"

run_part() {
  local part=$1 dir="$OUT/$1"
  mkdir -p "$dir"
  echo "=== $part ($(date +%H:%M:%S))"
  case $part in
    smoke)  # a minute: clean smoke of the main variants and the split-key decode
      for dt in float16 bfloat16 float32; do
        FTT_EFTA_CONFIG=64,64,4,3 timeout 90 python3 scripts/efta_gpu_smoke.py $dt 1 gqa 2>&1 | grep -E "^OK|Error" | tail -1
      done
      FTT_EFTA_CONFIG=128,64,8,3 timeout 90 python3 scripts/efta_gpu_smoke.py float16 1 big 2>&1 | grep -E "^OK|Error" | tail -1
      for s in 1 4; do  # split-key decode against the unsplit kernel's float64 check
        FTT_EFTA_CONFIG=16,64,4,3 FTT_EFTA_SPLIT=$s timeout 90 python3 scripts/efta_gpu_smoke.py float16 1 decode \
          2>&1 | grep -E "^OK|Error" | tail -1
      done
      ;;
    autotuned)  # no FTT_EFTA_CONFIG: each shape's candidates timed, the winners and their repairing launches run
      FTT_ABFT_GEMM_TUNE=0 timeout ${TESTS_TIMEOUT:-480} python3 -m pytest -q -x -m gpu -p no:cacheprovider \
        tests/test_efta_triton.py -k "gpu_matches_fp32_attention or gpu_no_false_positives" 2>&1 | tail -15 ;;
    tests)  # one forced block config: autotuning every test's variants would take far over 10 minutes
      FTT_EFTA_CONFIG=64,64,4,3 FTT_ABFT_GEMM_TUNE=0 timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -x -m gpu -p no:cacheprovider \
        tests/test_efta_triton.py tests/test_abft_gemm.py 2>&1
      ;;
    attention)
      python3 scripts/bench_attention.py --out "$dir" 2>&1 | grep -v Warning | tail -80 ;;
    quick)
      timeout ${QUICK_TIMEOUT:-600} python3 scripts/bench_attention.py --out "$dir" --quick 2>&1 | grep --line-buffered -v Warning ;;
    quickgraph)  # the same under CUDA graphs: kernel time without the host's launch overhead
      timeout ${QUICK_TIMEOUT:-600} python3 scripts/bench_attention.py --out "$dir" --quick --cudagraph 2>&1 \
        | grep --line-buffered -v Warning ;;
    coverage)
      local model=""
      [ -d .gpucarry/minilm ] && model="--model .gpucarry/minilm"
      python3 scripts/efta_coverage.py --device cuda --dtype float16 --shape 2,8,2,128,512,64 --n 1000 \
        --classes sign,exponent,mantissa --clean-calls 100000 $model --no-progress \
        --json "$dir/efta_coverage.json" --csv "$dir/efta_coverage.csv" 2>&1 | tail -25 ;;
    linear)
      FTT_ABFT_GEMM_TUNE=0 python3 scripts/calibrate_emax.py --device cuda --trials 200 --slack-trials 10 2>&1 | tail -12
      cp ft_transformers/emax_tables/*.json "$dir/" 2>/dev/null
      python3 scripts/bench_linear.py --out "$dir/bench_linear" 2>&1 | tail -30
      python3 scripts/vabft_study.py --device cuda --trials 100000 --big-trials 20 --out "$dir/vabft_study" \
        --plot "$dir/vabft_detection.png" 2>&1 | tail -20 ;;
    gemm)  # the checked GEMM alone: its GPU tests, then bench_linear with CUDA-graph and pointer-load columns
      FTT_ABFT_GEMM_TUNE=0 timeout ${TESTS_TIMEOUT:-180} python3 -m pytest -q -x -m gpu -p no:cacheprovider \
        tests/test_abft_gemm.py 2>&1
      timeout ${BENCH_TIMEOUT:-420} python3 scripts/bench_linear.py --no-torch-checked --graph --pointer \
        --out "$dir/bench_linear" 2>&1 | grep --line-buffered -v Warning ;;
    parts)  # where a decode GEMM call's time goes: scripts/bench_gemm_parts.py (graphs of 16 calls)
      FTT_ABFT_GEMM_TUNE=0 timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_gemm_parts.py --out "$dir" 2>&1 \
        | grep --line-buffered -v Warning ;;
    profile)  # where a protected compiled decode step's time goes (issue 7)
      python3 scripts/bench_generate.py --out "$dir" --models qwen2-0.5b --prefill --decode-batch 1 \
        --new-tokens 16 --variants attn_only full --compile reduce-overhead --profile --no-progress 2>&1 | tail -30
      head -40 "$dir"/profile_*full*.txt ;;
    compiled)  # one model copy per variant, each with its own compiled step, timed in turn
      python3 scripts/bench_generate.py --quick --interleave --models qwen2-0.5b --prefill --variants attn_only full \
        --compile reduce-overhead --repeats 5 --no-progress --budget-s 480 --out "$dir" 2>&1 | tail -20 ;;
    generate)
      python3 scripts/bench_generate.py --out "$dir" --budget-s 480 --no-progress 2>&1 | tail -40 ;;
    campaign)
      python3 scripts/campaign.py run --out "$dir/qwen2_campaign.jsonl" --model qwen2-0.5b-config --device cuda \
        --dtype float16 --sites attn.scores attn.probs attn.output linear.output --bits exponent mantissa \
        --trials 200 --max-new-tokens 8 --no-progress --report-dir "$dir" 2>&1 | tail -30 ;;
    falsepos)
      for dt in float16 bfloat16; do
        python3 scripts/false_positives.py --calls 0 --skip-models --configs gpt2-124m-config qwen2-0.5b-config \
          --device cuda --dtype $dt --prompts 3 --max-new-tokens 32 --json "$dir/false_positives_$dt.json" 2>&1 | tail -12
      done ;;
    kvtables)  # stored tables: GPU tests (one forced EFTA config), then decode timings with them and without
      FTT_EFTA_CONFIG=16,64,4,3 timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -x -m gpu -p no:cacheprovider \
        tests/test_kv_checksums.py 2>&1 | tail -5
      timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_attention.py --quick --kinds decode --cudagraph --rounds 3 \
        --variants sdpa_flash,ours_off,efta_correct,efta_stored,efta_stored_step --out "$dir" 2>&1 | grep --line-buffered -v Warning | tail -30 ;;
    lmhead)
      for dt in float16 bfloat16; do
        timeout 140 python3 scripts/tightness.py --lmhead --device cuda --dtype $dt --flips 1500 --budget 10 --no-plot \
          --out "$dir/lmhead_$dt" 2>&1 | grep -v Warning | tail -12
      done ;;
    xvar)  # the outlier estimate needs its own e_max (the threshold's slack depends on the estimate)
      FTT_ABFT_GEMM_TUNE=0 timeout 75 python3 scripts/calibrate_emax.py --device cuda --modes accumulator \
        --dtypes float16,bfloat16 --trials 30 --slack-trials 4 --xvar 2>&1 | grep -v Warning | tail -4
      cp ft_transformers/emax_tables/*.json "$dir/" 2>/dev/null
      for dt in float16 bfloat16; do
        FTT_GEMM_XVAR=1 timeout 110 python3 scripts/tightness.py --lmhead --device cuda --dtype $dt --flips 1500 \
          --budget 5 --no-plot --out "$dir/lmhead_$dt" 2>&1 | grep -v Warning | tail -12
      done
      for dt in float16 bfloat16; do
        FTT_GEMM_XVAR=1 timeout 100 python3 scripts/false_positives.py --calls 0 --skip-models \
          --configs gpt2-124m-config qwen2-0.5b-config --device cuda --dtype $dt --prompts 2 --max-new-tokens 16 \
          --json "$dir/false_positives_$dt.json" 2>&1 | grep -v Warning | tail -8
      done ;;
    reliability)  # independent jobs, job i on GPU i mod n (host-bound: two or three share a GPU well)
      local n w=/tmp/reliability i=0 pids=() limit=${REL_LIMIT:-500}
      n=$(nvidia-smi -L | wc -l)
      mkdir -p $w
      job() {  # job NAME CMD...: on the next GPU, its log in $w/NAME.log, stopped at the part's limit
        local name=$1; shift
        CUDA_VISIBLE_DEVICES=$((i % n)) timeout $limit "$@" > "$w/$name.log" 2>&1 &
        pids+=($!); i=$((i + 1))
      }
      spread() {  # spread NAME CMD...: every GPU visible (a campaign's workers take them in turn)
        local name=$1; shift
        timeout $limit "$@" > "$w/$name.log" 2>&1 &
        pids+=($!)
      }
      local jobs=${REL_JOBS:-tokens tight falsepos}
      local common="--model qwen2-0.5b-config --device cuda --uniform --max-new-tokens 4 --seed 0 --threads 1 --no-progress"
      for arm in ${TOKENS_ARMS:-on off}; do
        for dt in float16 bfloat16; do
          [[ " $jobs " == *" tokens "* ]] || continue
          local name=tokens_${dt}_$arm trials=10000 workers=${TOKENS_WORKERS:-3}
          [ $arm = off ] && trials=2000 && workers=$(( (workers + 2) / 3 ))
          [ -f "${RESUME:-/nonexistent}/$name.jsonl" ] && cp "$RESUME/$name.jsonl" $w/
          spread $name python3 scripts/campaign.py run --out $w/$name.jsonl $common --dtype $dt --arms $arm \
            --trials $trials --workers $workers
        done
      done
      for dt in ${REL_DTYPES:-float16 bfloat16}; do
        [[ " $jobs " == *" tight "* ]] || continue
        job tight_q05_$dt python3 scripts/tightness.py --dims qwen2-0.5b --layers 4 --device cuda --dtype $dt \
          --prompts 4 --tokens 128 --max-rows 128 --flips 10000 --budget ${TIGHT_BUDGET:-20} --out $w/tight_q05_$dt \
          ${TIGHT_ONLY:+--only $TIGHT_ONLY}
        job tight_q7b_$dt python3 scripts/tightness.py --dims qwen2-7b --layers 2 --device cuda --dtype $dt \
          --prompts 4 --tokens 128 --max-rows 128 --flips 10000 --budget ${TIGHT_BUDGET:-20} --out $w/tight_q7b_$dt \
          ${TIGHT_ONLY:+--only $TIGHT_ONLY}
      done
      for dt in ${REL_DTYPES:-float16 bfloat16}; do  # clean generations under the device's shipped thresholds
        [[ " $jobs " == *" falsepos "* ]] || continue
        job falsepos_$dt python3 scripts/false_positives.py --calls 0 --skip-models --configs gpt2-124m-config \
          qwen2-0.5b-config --device cuda --dtype $dt --prompts 2 --max-new-tokens 16 --json $w/falsepos_$dt.json
      done
      local tick=0
      while sleep 60; do  # progress: the last line of every log
        local alive=0; for p in "${pids[@]}"; do kill -0 $p 2>/dev/null && alive=$((alive + 1)); done
        echo "--- $(date +%H:%M:%S): $alive of ${#pids[@]} jobs running"
        tick=$((tick + 1))
        if [ $tick = 4 ]; then  # a campaign still in its clean phase after 4 minutes: its stacks into its log
          for f in $w/tokens_*.log; do
            tail -1 $f 2>/dev/null | grep -q "clean runs" || continue
            for q in $(pgrep -f "$(basename $f .log).jsonl"); do  # the campaign's python, not its `timeout`
              [ "$(cat /proc/$q/comm 2>/dev/null)" = timeout ] || kill -USR1 $q 2>/dev/null
            done
          done
        fi
        for f in $w/*.log; do echo "$(basename $f .log): $(tr '\r' '\n' < $f | grep -v Warning | tail -1 | cut -c1-160)"; done
        [ $alive = 0 ] && break
      done
      wait
      for f in $w/*.log; do echo "=== $(basename $f)"; grep -v Warning $f | tail -15; done
      tar -czf "$dir/reliability.tar.gz" -C $w . && ls -la "$dir" ;;
    tpratio)  # the flips were checked at every size already: --no-injection leaves the time to the compiled steps
      local tpa="--model qwen2-7b --compile reduce-overhead --no-injection --new-tokens ${TP_TOKENS:-64} --out $dir"
      tpa="$tpa ${TP_PROFILE:+--profile}"  # TP_PROFILE=1: each workload once more under torch.profiler, every rank
      tpa="$tpa ${TP_WORKLOADS:+--workloads $TP_WORKLOADS}"  # e.g. decode_compiled: the compiled step alone
      FTT_ABFT_GEMM_TUNE=0 timeout ${TP1_TIMEOUT:-330} python3 scripts/tp_check.py $tpa 2>&1 \
        | grep --line-buffered -v Warning | grep -E "tp_check |^\||OK|FAILED|Error"
      local ref="$dir/tp_check_qwen2-7b_float16_tp1.json"
      FTT_ABFT_GEMM_TUNE=0 timeout ${TP4_TIMEOUT:-330} python3 -m torch.distributed.run --standalone --nproc-per-node ${TP_NPROC:-4} \
        scripts/tp_check.py $tpa $( [ -f $ref ] && echo --reference $ref ) 2>&1 | grep --line-buffered -v Warning \
        | grep -E "tp_check |^\||OK|FAILED|Error"
      grep -h "compiled step" "$dir"/tp_check_*.md 2>/dev/null  # its graphs, breaks and CUDA-graph skips per size
      if ls "$dir"/profile_*.txt > /dev/null 2>&1; then  # ($OUT brings back a few files: the tables in one)
        tar -czf "$dir/profiles.tar.gz" -C "$dir" $(cd "$dir" && ls profile_*.txt) && rm -f "$dir"/profile_*.txt
      fi ;;
    probslp)  # bf16 P_lp checked bit for bit: its GPU tests, then the attention sites' tightness and clean runs
      # (on CUDA these run the compiled kernel: no gpu mark; the whole file's variants take over 300 s to compile)
      FTT_EFTA_CONFIG=64,64,4,3 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_attention_sites.py -k "bf16 or probabilities or low_precision or clean_calls" 2>&1 | tail -4
      REL_JOBS="${PROBSLP_JOBS:-tight falsepos}" TIGHT_ONLY="${TIGHT_ONLY:-attn.scores attn.rowmax attn.exponent \
attn.probs attn.probs_lp attn.alpha attn.rowsum attn.acc attn.checksum attn.output}" REL_DTYPES=bfloat16 \
        run_part reliability ;;
    split)
      FTT_ABFT_GEMM_TUNE=0 timeout ${CAL_TIMEOUT:-200} python3 scripts/calibrate_emax.py --device cuda \
        --modes accumulator --dtypes float16,bfloat16 --xvar --trials 30 --slack-trials 4 \
        --trend-k 4096,8192,18944,29568 ${SPLIT_DTYPES:+--split-dtypes $SPLIT_DTYPES} 2>&1 | grep -v Warning | tail -4
      cp ft_transformers/emax_tables/*.json "$dir/" 2>/dev/null
      REL_JOBS="${SPLIT_JOBS:-tight falsepos}" TIGHT_ONLY="q k v o gate up down lm_head" run_part reliability ;;
    cprobe)
      timeout ${BENCH_TIMEOUT:-300} python3 scripts/checksum_error_probe.py 2>&1 | grep -v Warning | tee "$dir/probe.txt" ;;
    verifyab)
      FTT_ABFT_GEMM_TUNE=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_abft_gemm.py \
        -k "bit_for_bit or real_shapes" 2>&1 | tail -4
      timeout 120 python3 scripts/checksum_error_probe.py --dims qwen2-0.5b --dtypes float16 --classes lm_head 2>&1 \
        | grep -v Warning | tee "$dir/probe.txt"
      OUT="$dir" timeout 260 bash scripts/gpu_ab.sh "${BASELINE:-.baseline}" 1 -- python3 scripts/bench_linear.py \
        --kinds short,layer --graph --no-torch-checked --dtypes float16 --rounds 3 --out @OUT@/lin 2>&1 \
        | grep -E "===|short|layer" ;;
    caltrend)
      FTT_ABFT_GEMM_TUNE=0 timeout ${BENCH_TIMEOUT:-400} python3 scripts/calibrate_emax.py --device cuda \
        --modes accumulator --dtypes float16,bfloat16 --xvar --trials 30 --slack-trials 4 \
        --trend-k 1024,4096,8192,18944,29568 --out-dir "$dir" 2>&1 | grep -v Warning | tail -6 ;;
    fusedab)  # the checksum tiles in the GEMM's launch against the verification's own K loop, one process
      FTT_ABFT_GEMM_TUNE=0 timeout ${TESTS_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_abft_gemm.py -k "bit_for_bit or real_shapes or group_verification" 2>&1 | tail -4
      timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench_linear.py --kinds ${FUSED_KINDS:-square,short,layer} \
        ${FUSED_MODELS:+--models $FUSED_MODELS} --graph --unfused --no-torch-checked \
        --dtypes ${FUSED_DTYPES:-float16} --rounds ${FUSED_ROUNDS:-3} --out "$dir/lin" 2>&1 \
        | grep --line-buffered -E "square|short|layer|target" ;;
    cublasform)
      FTT_ABFT_GEMM_TUNE=0 timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_gemm_cublas_form.py --rounds 3 \
        --out "$dir/gemm_cublas_form_fp16.csv" 2>&1 | grep --line-buffered -v Warning | tail -40 ;;
    *)
      echo "unknown part $part"; return 2 ;;
  esac
}

for part in "$@"; do mkdir -p "$OUT/$part"; run_part "$part" 2>&1 | tee "$OUT/$part/log.txt"; done
