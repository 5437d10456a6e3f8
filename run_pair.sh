#!/usr/bin/env bash
# run_pair.sh: the GRAFT launcher.
#
# Usage:
#   bash run_pair.sh tiny [tiny.py flags]      CPU preset: two tiny models, GRPO vs GRAFT, a table (minutes)
#   bash run_pair.sh pair1 [graft.py flags]    SmolLM3-3B-Base  <-> Qwen3-1.7B-Base      (paper Pair 1)
#   bash run_pair.sh pair2 [graft.py flags]    OctoThinker-3B   <-> Qwen3-1.7B-Base      (paper Pair 2)
#   bash run_pair.sh pair3 [graft.py flags]    SmolLM3-3B-Base  <-> OctoThinker-3B       (paper Pair 3)
#   bash run_pair.sh grpo  [graft.py flags]    single-model GRPO of $MODEL_A on all GPUs (add --rollouts 16 / 32)
#   bash run_pair.sh offline [graft.py flags]  $MODEL_B learns from a finished run's rollout files in $PEER_LOG
#   bash run_pair.sh eval  [graft.py flags]    evaluate $MODEL (a checkpoint folder) on the five benchmarks
#
# Flags after the preset go to every graft.py process, e.g. `bash run_pair.sh pair1 --variant sgt`,
# `--order uniform`, `--no-balance`, `--compat-norm byte`; FLAGS_A / FLAGS_B go to one side only (e.g.
# FLAGS_A=--chat-template for an instruct model paired with a base model). Every variable below has a default and can
# be overridden from the environment (e.g. `GPUS_A=0,1 GPUS_B=2,3 bash run_pair.sh pair1`; FSDP=1 / 0
# forces FSDP2 sharding on / off, default auto: on for GPUs under 80 GB with two or more per side).
# A pair splits the GPUs in two halves (printed); with one GPU both sides share it, with none both run
# on the CPU. When one side exits non-zero the other is stopped at once. Each launch passes both sides
# a fresh --run-id (not with --resume, which keeps the run's), so two pairs started in one exchange
# folder never join each other. After any failure, `bash run_pair.sh pair1 --resume` continues the
# pair from each side's last complete checkpoint. The script prints every command it runs.
set -euo pipefail
cd "$(dirname "$0")"

PRESET=${1:-tiny}
shift || true

PYTHON=${PYTHON:-python}
RUNS=${RUNS:-runs}
DATA=${DATA:-data}
STEPS=${STEPS:-174}
SEED=${SEED:-0}
NGPU=${NGPU:-$( (command -v nvidia-smi >/dev/null && nvidia-smi -L | wc -l) || echo 0)}
# The pair's split: the first half of the GPUs for A, the rest for B; one GPU: both share GPU 0;
# none: both on the CPU (an empty list means CPU below).
if [ "$NGPU" -gt 1 ]; then
  HALF=$((NGPU / 2)); SPLIT_A=$(seq -s, 0 $((HALF - 1))); SPLIT_B=$(seq -s, $HALF $((NGPU - 1)))
elif [ "$NGPU" -eq 1 ]; then
  SPLIT_A=0; SPLIT_B=0
else
  SPLIT_A=; SPLIT_B=
fi
GPUS_A=${GPUS_A-$SPLIT_A}
GPUS_B=${GPUS_B-$SPLIT_B}
SMOL=${SMOL:-HuggingFaceTB/SmolLM3-3B-Base}
QWEN=${QWEN:-Qwen/Qwen3-1.7B-Base}
OCTO=${OCTO:-OctoThinker/OctoThinker-3B-Hybrid-Base}
# FSDP2: auto = shard (--fsdp) when the GPUs have under 80 GB and a side has more than one of them;
# a 3B model needs ~70 GB per GPU under plain data parallel (README, "Running the pair on a GPU node").
FSDP=${FSDP:-auto}
GPU_MEM_MIB=${GPU_MEM_MIB:-$( (command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) || echo 0)}

run() { echo "+ $*" >&2; "$@"; }  # (run exec CMD: prints CMD, then the shell becomes it)
count() { echo "$1" | tr ',' '\n' | grep -c . || true; }
nproc_of() { local c; c=$(count "$1"); echo $(( c > 0 ? c : 1 )); }  # an empty GPU list: one CPU process
device_of() { [ -n "$1" ] && echo cuda || echo cpu; }
fsdp_flag() {  # fsdp_flag GPUS: prints --fsdp when this side should shard its model
  case "$FSDP" in
    1) echo --fsdp ;;
    auto) if [ "$GPU_MEM_MIB" -gt 0 ] && [ "$GPU_MEM_MIB" -lt 79000 ] && [ "$(count "$1")" -gt 1 ]; then echo --fsdp; fi ;;
  esac
}

prepare_data() {
  [ -f "$DATA/math_train.jsonl" ] || run $PYTHON data/prepare.py --out "$DATA"
}

# One side of a pair: torchrun over its GPUs, meeting the other side in the exchange directory.
side() {  # side NAME PEER_NAME MODEL GPUS OUT EXCHANGE [flags...]
  local name=$1 peer=$2 model=$3 gpus=$4 out=$5 ex=$6; shift 6
  local port=$((29500 + RANDOM % 1000))
  # exec: the background job is torchrun itself, so that stopping the side stops its workers too
  CUDA_VISIBLE_DEVICES=$gpus run exec $PYTHON -m torch.distributed.run --nproc_per_node "$(nproc_of "$gpus")" \
    --master_port "$port" graft.py train --model "$model" --name "$name" --peer-name "$peer" \
    --peer-exchange "$ex" --out "$out" --prompts "$DATA/math_train.jsonl" --data-dir "$DATA" \
    --steps "$STEPS" --seed "$SEED" --eval-every 5 --benchmarks all --device "$(device_of "$gpus")" \
    $(fsdp_flag "$gpus") "$@"
}

split_gpus() {  # prints the pair's split; refuses a split that leaves one side without a device
  if [ -z "$GPUS_A" ] && [ -z "$GPUS_B" ]; then
    echo "no GPU found (NGPU=$NGPU): both sides run on the CPU, one process each" >&2
  elif [ -z "$GPUS_A" ] || [ -z "$GPUS_B" ]; then
    echo "run_pair.sh: GPUS_A='$GPUS_A' GPUS_B='$GPUS_B': give each side GPUs, e.g. GPUS_A=0,1 GPUS_B=2,3 (or the same GPU to both: GPUS_A=0 GPUS_B=0)" >&2
    return 2
  elif [ "$GPUS_A" = "$GPUS_B" ]; then
    echo "one GPU list for both sides ($GPUS_A): the two models share it (memory permitting)" >&2
  fi
}

pair() {  # pair TAG MODEL_A MODEL_B [flags...]
  local tag=$1 a=$2 b=$3; shift 3
  split_gpus || return 2
  prepare_data
  local ex="$RUNS/$tag/exchange"
  mkdir -p "$RUNS/$tag"
  local id=()
  case " $* " in *" --resume "*) ;; *) id=(--run-id "${RUN_ID:-$tag-$(date +%Y%m%d-%H%M%S)-$RANDOM}") ;; esac
  echo "pair $tag: A=$a on GPUs ${GPUS_A:-none (CPU)}, B=$b on GPUs ${GPUS_B:-none (CPU)}, exchange $ex" >&2
  # FLAGS_A / FLAGS_B: flags for one side only (e.g. FLAGS_A=--chat-template for an instruct model beside a base one)
  side a b "$a" "$GPUS_A" "$RUNS/$tag/a" "$ex" "${id[@]}" "$@" ${FLAGS_A:-} > "$RUNS/$tag/a.log" 2>&1 &
  local pa=$!
  side b a "$b" "$GPUS_B" "$RUNS/$tag/b" "$ex" "${id[@]}" "$@" ${FLAGS_B:-} > "$RUNS/$tag/b.log" 2>&1 &
  local pb=$!
  trap 'kill $pa $pb 2>/dev/null' INT TERM
  tail -f "$RUNS/$tag/a.log" --pid=$pa &
  # The first side to exit decides: non-zero stops the other at once (it would only wait for a
  # peer that is gone); zero waits for the other to finish too.
  local status=0 done_pid first other rest=0
  wait -n -p done_pid $pa $pb || status=$?
  if [ "$done_pid" = "$pa" ]; then first=a; other=$pb; else first=b; other=$pa; fi
  if [ "$status" -ne 0 ]; then
    echo "pair $tag: side $first exited with status $status; stopping the other side (see $RUNS/$tag/$first.log)" >&2
    kill "$other" 2>/dev/null || true
  fi
  wait "$other" || rest=$?
  [ "$status" -ne 0 ] || status=$rest
  echo "pair $tag finished (status $status); logs $RUNS/$tag/{a,b}.log, best checkpoints $RUNS/$tag/{a,b}/checkpoints/best" >&2
  return $status
}

case "$PRESET" in
  tiny)
    run $PYTHON tiny.py --out "${TINY_OUT:-$RUNS/tiny}" "$@" ;;
  pair1) pair pair1 "$SMOL" "$QWEN" "$@" ;;
  pair2) pair pair2 "$OCTO" "$QWEN" "$@" ;;
  pair3) pair pair3 "$SMOL" "$OCTO" "$@" ;;
  grpo)
    prepare_data
    MODEL_A=${MODEL_A:-$QWEN}
    GPUS=${GPUS:-$(seq -s, 0 $((NGPU > 0 ? NGPU - 1 : 0)))}
    CUDA_VISIBLE_DEVICES=$GPUS run $PYTHON -m torch.distributed.run --nproc_per_node "$(count "$GPUS")" \
      graft.py train --model "$MODEL_A" --out "${OUT:-$RUNS/grpo_$(basename "$MODEL_A")}" \
      --prompts "$DATA/math_train.jsonl" --data-dir "$DATA" --steps "$STEPS" --seed "$SEED" \
      --eval-every 5 --benchmarks all "$@" ;;
  offline)
    prepare_data
    MODEL_B=${MODEL_B:-$QWEN}
    PEER_LOG=${PEER_LOG:?set PEER_LOG to the rollout folder of a finished run, e.g. runs/grpo_SmolLM3-3B-Base/exchange/a}
    GPUS=${GPUS:-$(seq -s, 0 $((NGPU > 0 ? NGPU - 1 : 0)))}
    CUDA_VISIBLE_DEVICES=$GPUS run $PYTHON -m torch.distributed.run --nproc_per_node "$(count "$GPUS")" \
      graft.py train --model "$MODEL_B" --peer-log "$PEER_LOG" \
      --out "${OUT:-$RUNS/offline_$(basename "$MODEL_B")}" --prompts "$DATA/math_train.jsonl" \
      --data-dir "$DATA" --steps "$STEPS" --seed "$SEED" --eval-every 5 --benchmarks all "$@" ;;
  eval)
    prepare_data
    MODEL=${MODEL:?set MODEL to a checkpoint folder or hub id}
    GPUS=${GPUS:-$(seq -s, 0 $((NGPU > 0 ? NGPU - 1 : 0)))}
    CUDA_VISIBLE_DEVICES=$GPUS run $PYTHON -m torch.distributed.run --nproc_per_node "$(count "$GPUS")" \
      graft.py eval --model "$MODEL" --data-dir "$DATA" --benchmarks all --samples 8 --temperature 0.6 --top-p 0.95 "$@" ;;
  -h|--help|help)
    sed -n '2,22p' "$0" ;;
  *)
    echo "run_pair.sh: unknown preset '$PRESET' (tiny, pair1, pair2, pair3, grpo, offline, eval)" >&2; exit 2 ;;
esac
