#!/bin/bash
# Sessions 15-16's device measurements for issues 23 and 24, in parts that each fit one call (600 s).
# From the repository root after ../shared/gpu's setup.sh, with /tmp/stage/env.sh sourced (bench/device_go.sh does
# both, checks the test clients' wheels, then runs parts in order: `bash bench/device_go.sh suite graphs`):
#   bash bench/device_round.sh suite      the GPU suite (bench/device_suite.sh), the 8B model made meanwhile
#   bash bench/device_round.sh persist    bench/persist.py at 32k tokens: this tree, then .gpu/old's (a git
#                                         archive of the tree before) if present: before and after, one machine
#   bash bench/device_round.sh persist-old-first   the same, .gpu/old's first
#   bash bench/device_round.sh turns      bench/http_turns.py over 75k tokens with 131-token turns
#   bash bench/device_round.sh slices     the prefill row at KVWAKE_SLICE_OF_STEP 1.0 and 0.5, alternating
#   bash bench/device_round.sh batching   bench/batching.py, alternating rounds at 8 and 16 sessions
#   bash bench/device_round.sh startup    bench/startup.py on the tiny model: this tree and .gpu/old's, alternating
#   bash bench/device_round.sh prefill    the prefill row, all new and partly restored (--prefill-hit), alternating
#   bash bench/device_round.sh trace      the prefill row with the engine thread's every job and step (its timeline)
#   bash bench/device_round.sh cache      the prefill row's trace at MLX's cache limit 4 GiB (default) and 32 GiB
#   bash bench/device_round.sh growth     bench/decode_growth.py, then the prefill row with KVWAKE_GROW_AHEAD 0 and 1
#   bash bench/device_round.sh server     bench/batching.py at 8 and 16 sessions against mlx_lm.server
#   bash bench/device_round.sh spikes     bench/step_spikes.py: a lone session's slow steps, kvwake's and mlx-lm's loop
#   bash bench/device_round.sh plainfirst bench/plain_first.py: a plain chunk's first attention, kernels or memory
#   bash bench/device_round.sh firstplain the first plain chunk of a process after each kind of warm-up (plain_first.py)
#   bash bench/device_round.sh warmplain  the prefill row's trace, this tree against .gpu/old's, alternating
#   bash bench/device_round.sh hostfree   bench/managed_reuse.py, then the prefill row's trace against .gpu/old's
#   bash bench/device_round.sh hostcopy   the same as warmplain (session 19's name)
#   bash bench/device_round.sh gilwatch   the prefill row's trace with the daemon's waits for the GIL (KVWAKE_GIL_WATCH_MS)
#   bash bench/device_round.sh renders    bench/render_beside.py: 4 new chats rendered at once beside a talker, one at a
#                                         time (KVWAKE_RENDERS_AT_ONCE=1) against the default, alternating
#   bash bench/device_round.sh decodepersist  8 and 16 sessions decoding with persistence on and off, alternating
#                                         (what the daemon's durability costs a batch, beside BatchGenerator's gap)
#   bash bench/device_round.sh clocks     alternating rounds against BatchGenerator at 8 and 16 sessions, the GPU's
#                                         clocks, power and throttle reasons sampled beside (bench/clock_windows.py);
#                                         IN_PROCESS=1: BatchGenerator in the bench's process, loaded once (its
#                                         windows then hold its decoding only)
#   bash bench/device_round.sh poolnice   bench/persist.py at 16k tokens with the pool's workers at the daemon's
#                                         priority and 10 nice levels below (KVWAKE_POOL_NICE), alternating
#   bash bench/device_round.sh graphs     8 and 16 sessions, kvwake and BatchGenerator (in process), under MLX's CUDA-graph
#                                         knobs: MLX_MAX_OPS_PER_BUFFER (100 nodes a graph on the H100), MLX_CUDA_GRAPH_CACHE_SIZE
#                                         (an LRU of 400 graphs) and MLX_USE_CUDA_GRAPHS=0 (kernels launched one by one)
#   bash bench/device_round.sh nographs   kvwake and BatchGenerator (in process) with MLX_USE_CUDA_GRAPHS 1 and 0, alternating
#                                         (SESSIONS=1,4: a lone session's and 4 sessions' steps)
#   bash bench/device_round.sh nographsprefill  the prefill row with MLX_USE_CUDA_GRAPHS 1 and 0, alternating
#   bash bench/device_round.sh daemongap  graphs off: the decoder in process (3 ways) against BatchGenerator, then the daemon
#   bash bench/device_round.sh longsolo   a lone decode over 20k tokens (cuDNN attention), CUDA graphs on and off, alternating
#   bash bench/device_round.sh graphcache the prefill row's trace at MLX_CUDA_GRAPH_CACHE_SIZE 400 (MLX 0.32's default) and
#                                         4000, alternating: are the long decode steps graphs the LRU evicted, made again?
#   bash bench/device_round.sh readback   bench/managed_reuse.py --steps: steps ending in a token read, beside reads
#   bash bench/device_round.sh turnsatonce  bench/turns_at_once.py: 16 chat turns sent at once beside a decoding talker
#                                         (TURNS_RUNS: nopack-K packing off, pack-K on, capN-K on with slices of at most N steps,
#                                         shared-K on with packs sized from their kind's shared costs)
#   bash bench/device_round.sh admitpass  bench/admit_pass.py: 16 calls join a decoding talker; merge, its evaluation, the
#                                         first pass and the steps after, timed apart, with MLX's memory
#   bash bench/device_round.sh admitahead calls sent at once (16, 32), merged caches scheduled ahead of the first pass or not
#   bash bench/device_round.sh resume     bench/device.sh: the resume suite (1k/8k/32k in one process, 8k raw, 32k auto)
#   bash bench/device_round.sh point8     bench/batching.py, 1-32 sessions against BatchGenerator and mlx_lm.server (SESSIONS)
#   bash bench/device_round.sh alternate  bench/batching.py --alternate: kvwake against BatchGenerator, rounds at SIZES
#   bash bench/device_round.sh dropprobe  bench/drop_probe.py: a dropped host copy's way into MLX's cache, or not
#   bash bench/device_round.sh admit      calls sent at once (8, 16, 32 sessions, 128 tokens): this tree against .gpu/old's
#                                         (before session 23's quick joins), alternating; first tokens and tokens/s
# Results in $OUT (or bench/out/device).
set -uo pipefail
out=${OUT:-bench/out/device}
mkdir -p "$out"
model() { [ -f /tmp/m8b/config.json ] || python3 /tmp/stage/make_model.py /tmp/m8b --shape llama8b >"$out/model.txt" 2>&1; }
case "$1" in
  suite)
    model & made=$!
    WORKERS=${WORKERS:-14} timeout 540 bash bench/device_suite.sh
    wait $made ;;
  persist|persist-old-first)  # the first run of a fresh machine pays kernel builds and a disk still writing the
    model                      # model out: run both orders to see what is the code's
    new() { timeout 280 python3 bench/persist.py --model /tmp/m8b --tokens 32768 --out "$out/persist-new" 2>&1 | tail -2; }
    old() {
      [ -d .gpu/old ] || return 0
      rm -rf /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/old .gpu/old >/dev/null
      PYTHONPATH=/tmp/old:${PYTHONPATH:-} timeout 280 python3 bench/persist.py --model /tmp/m8b --tokens 32768 \
        --out "$out/persist-old" 2>&1 | tail -2
    }
    if [ "$1" = persist ]; then new; old; else old; new; fi ;;
  tests)  # the test files named in $TESTS (the suite's settings, no remote tier): what a session changed, on CUDA
    timeout 400 python3 -m pytest -n "${WORKERS:-14}" -p no:benchmark -p no:cacheprovider -q -rfE $TESTS \
      >"$out/tests.txt" 2>&1
    tail -15 "$out/tests.txt" ;;
  turns)
    model
    timeout 560 python3 bench/http_turns.py --model /tmp/m8b --system-words 15000 --turns 8 --turn-words 10 \
      --parts turns --out "$out/turns-131" 2>&1 | tail -6 ;;
  slices)  # the prefill row (a talker beside another session's 8k prefill) at two slice sizes, alternating
    model
    for f in 1.0 0.5 1.0 0.5; do
      KVWAKE_SLICE_OF_STEP=$f timeout 140 python3 bench/batching.py --model /tmp/m8b --sessions 1 --tokens 64 \
        --modes batched --whole "" --no-batch-generator --out "$out/slices-$f-$RANDOM" 2>&1 | grep -o '"p99_during_over_p50_alone": [0-9.]*' | sed "s/^/$f /"
    done ;;
  batching)
    model
    timeout 560 python3 bench/batching.py --model /tmp/m8b --sessions 1,8,16 --tokens 256 --alternate 3 \
      --modes batched --whole "" --no-batch-generator --out "$out/batching" 2>&1 | tail -6 ;;
  startup)  # three starts each (the first of a fresh machine compiles kernels), new and old alternating
    [ -d .gpu/old ] && { rm -rf /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation \
      --target /tmp/old .gpu/old >/dev/null; }
    for round in 1 2; do
      timeout 120 python3 bench/startup.py --model tiny --starts 3 --importtime --top 40 \
        --json "$out/startup-new-$round.json" 2>&1 | grep -E '^(start|imports)' | sed "s/^/new $round /"
      [ -d /tmp/old ] && PYTHONPATH=/tmp/old:${PYTHONPATH:-} timeout 120 python3 bench/startup.py --model tiny --starts 3 \
        --importtime --top 40 --json "$out/startup-old-$round.json" 2>&1 | grep -E '^(start|imports)' | sed "s/^/old $round /"
    done ;;
  prefill)  # the talker's gaps beside an 8k prefill: all new, then partly restored from the store
    model
    for kind in new hit new hit; do
      flag=""; [ $kind = hit ] && flag="--prefill-hit"
      KVWAKE_SLOW_JOB_MS=12 timeout 140 python3 bench/batching.py --model /tmp/m8b --sessions 1 --tokens 64 \
        --modes batched --whole "" --no-batch-generator $flag --out "$out/prefill-$kind-$RANDOM" 2>&1 \
        | grep -o '"prefill_tokens.*"p99_during_over_p50_alone": [0-9.]*' | sed "s/^/$kind /"
    done ;;
  trace)  # the prefill row (all new) with every engine job and step named (the engine's timeline beside the
    model  # talker's): the daemon persisting as it runs (the default) or not (--no-persist), alternating
    for r in 1 2; do
      for persist in on off; do
        flag=""; [ $persist = off ] && flag="--no-persist"
        KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 140 python3 bench/batching.py --model /tmp/m8b \
          --sessions 1 --tokens 64 --modes batched --whole "" --no-batch-generator $flag \
          --out "$out/prefill-trace-persist-$persist-$r" 2>&1 | grep -o '"p99_during_over_p50_alone": [0-9.]*' \
          | sed "s/^/trace persist=$persist $r /"
      done
    done ;;
  cache)  # the prefill row's trace with MLX's buffer cache at its default limit (4 GiB) and at 32 GiB, alternating
    model
    for limit in 4294967296 34359738368; do
      KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 140 python3 bench/batching.py --model /tmp/m8b \
        --sessions 1 --tokens 64 --modes batched --whole "" --no-batch-generator --daemon-config "mlx_cache_bytes = $limit" \
        --out "$out/prefill-trace-cache-$limit" 2>&1 | grep -o '"p99_during_over_p50_alone": [0-9.]*' | sed "s/^/cache=$limit /"
    done ;;
  growth)  # a lone session's decode steps where its KV buffer grows: all layers at once, or one a step ahead
    model
    timeout 300 python3 bench/decode_growth.py --model /tmp/m8b --prompt 200 --tokens 1100 --rounds 3 \
      --json "$out/growth.json" 2>&1 | tail -1
    for ahead in 0 1; do  # and the prefill row, whose talker meets its buffer's 265th token during the prefill
      KVWAKE_GROW_AHEAD=$ahead KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 140 python3 bench/batching.py \
        --model /tmp/m8b --sessions 1 --tokens 64 --modes batched --whole "" --no-batch-generator \
        --out "$out/prefill-trace-ahead-$ahead" 2>&1 | grep -o '"p99_during_over_p50_alone": [0-9.]*' | sed "s/^/ahead=$ahead /"
    done ;;
  spikes)
    model
    timeout 300 python3 bench/step_spikes.py --model /tmp/m8b --prompt 200 --tokens 1100 --rounds 2 \
      --json "$out/step_spikes.json" 2>&1 | tail -1 ;;
  plainfirst)
    model
    timeout 300 python3 bench/plain_first.py --model /tmp/m8b --context 7680 --chunk 318 --rounds 2 \
      --json "$out/plain_first.json" 2>&1 | grep -o '"variant.*' ;;
  firstplain)  # the first plain chunk of a process after the engine's warm-ups, each variant in a fresh process
    model
    for r in 1 2; do
      for v in "random" "random --clear" "model" "model --clear" "none" "shapes"; do
        timeout 100 python3 bench/plain_first.py --model /tmp/m8b --context 7680 --chunk 318 --first-only --warm $v \
          2>&1 | tail -1
      done
    done ;;
  hostfree)  # host copies freed to the driver (this tree) or into MLX's cache (.gpu/old's): bench/managed_reuse.py,
    model & made=$!  # then the prefill row's trace, alternating, and one run without persistence, while time lasts
    timeout 90 python3 bench/managed_reuse.py --mib 4 --count 32 --rounds 5 --json "$out/managed_reuse-4.json" 2>&1 | tail -4
    timeout 90 python3 bench/managed_reuse.py --mib 64 --count 8 --rounds 5 --json "$out/managed_reuse-64.json" 2>&1 | tail -4
    wait $made
    rm -rf /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/old .gpu/old >/dev/null
    for run in new-1 old-1 new-2 old-2 off-1 new-3 old-3; do
      [ $SECONDS -gt 470 ] && break
      path="" flag=""; [ "${run%%-*}" = old ] && path=/tmp/old:; [ "${run%%-*}" = off ] && flag=--no-persist
      PYTHONPATH=$path${PYTHONPATH:-} KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 110 python3 bench/batching.py \
        --model /tmp/m8b --sessions 1 --tokens 64 --modes batched --whole "" --no-batch-generator $flag \
        --out "$out/prefill-trace-hostfree-$run" >/dev/null 2>&1
      python3 bench/trace_summary.py "$run" "$out/prefill-trace-hostfree-$run/batching.json"
    done ;;
  warmplain|hostcopy)  # the prefill row's trace, this tree against .gpu/old's, alternating, while time lasts
    model
    rm -rf /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/old .gpu/old >/dev/null
    for run in new-1 old-1 new-2 old-2 new-3 old-3 new-4 old-4; do
      [ $SECONDS -gt ${UNTIL_S:-480} ] && break
      path=""; [ "${run%%-*}" = old ] && path=/tmp/old:
      PYTHONPATH=$path${PYTHONPATH:-} KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 100 python3 bench/batching.py \
        --model /tmp/m8b --sessions 1 --tokens 64 --modes batched --whole "" --no-batch-generator \
        --out "$out/prefill-trace-$1-$run" >/dev/null 2>&1
      python3 bench/trace_summary.py "$run" "$out/prefill-trace-$1-$run/batching.json"
    done ;;
  gilwatch)  # the prefill row's trace with the daemon watching the GIL (daemon/gilwatch.py: waits of 4 ms or more,
    model      # each with every thread's stack), while time lasts: on a machine with long decode steps, did the
    for watch in "" 2; do  # engine thread wait for the GIL in them, and who held it. First 8 and 16 sessions
      KVWAKE_GIL_WATCH_MS=$watch KVWAKE_GIL_WATCH_KEPT=5000 timeout 150 python3 bench/batching.py --model /tmp/m8b --sessions 8,16 --tokens 256 \
        --modes batched --whole "" --prefill 0 --no-batch-generator --out "$out/batching-gilwatch-${watch:-off}" 2>&1 \
        | grep -o '"sessions": [0-9]*\|"steady_tokens_per_s": [0-9.]*\|"gap_p99_ms": [0-9.]*\|"gil_wait[a-z_]*": [0-9a-z.]*' \
        | tr '\n' ' ' | sed "s/^/watch=${watch:-off} /"; echo
    done  # decoding (steady tok/s with the watch off and on: its cost; the GIL's waits meanwhile)
    for r in 1 2 3 4 5 6; do
      [ $SECONDS -gt ${UNTIL_S:-480} ] && break
      KVWAKE_GIL_WATCH_MS=4 KVWAKE_GIL_WATCH_KEPT=5000 KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 100 \
        python3 bench/batching.py --model /tmp/m8b --sessions 1 --tokens 64 --modes batched --whole "" \
        --no-batch-generator --out "$out/prefill-trace-gilwatch-$r" >/dev/null 2>&1
      python3 bench/trace_summary.py "gilwatch-$r" "$out/prefill-trace-gilwatch-$r/batching.json"
    done ;;
  renders)  # bench/render_beside.py: 4 readers append new 28k-token chats at once beside a talker, renders one at
    model     # a time against the default (a quarter of the cores: 4 of 16), alternating
    for r in $(seq ${RENDER_ROUNDS:-2}); do
      for n in 1 default; do
        env=""; [ $n = 1 ] && env="KVWAKE_RENDERS_AT_ONCE=1"
        env $env timeout 140 python3 bench/render_beside.py --model /tmp/m8b --together 4 --chat --rounds 1 \
          --appends 6 --text-tokens 30000 --out "$out/renders-$n-$r" 2>&1 | grep -A12 '"summary"' | tr -d ' \n' \
          | sed "s/^/at_once=$n round $r /"; echo
      done
    done ;;
  decodepersist)  # 8 and 16 sessions, 256 tokens a call, the daemon persisting as the rows fill blocks or not
    model
    for r in 1 2; do
      for p in on off; do
        [ $SECONDS -gt ${UNTIL_S:-450} ] && break 2
        flag=""; [ $p = off ] && flag="--no-persist"
        timeout 150 python3 bench/batching.py --model /tmp/m8b --sessions 8,16 --tokens 256 --modes batched --whole "" \
          --prefill 0 --no-batch-generator $flag --out "$out/batching-persist-$p-$r" 2>&1 \
          | grep -o '"sessions": [0-9]*\|"steady_tokens_per_s": [0-9.]*\|"gap_p50_ms": [0-9.]*\|"gap_p99_ms": [0-9.]*' \
          | tr '\n' ' ' | sed "s/^/persist=$p round $r /"; echo
      done
    done ;;
  clocks)  # does the speed that drifts between rounds (12 to 18 ms a step on one machine) go with the GPU's clocks?
    model
    q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active
    nvidia-smi --query-gpu=$q --format=csv,noheader -lms 250 >"$out/clocks.csv" 2>&1 & smi=$!
    timeout ${UNTIL_S:-520} python3 -u bench/batching.py --model /tmp/m8b --sessions 8 --tokens 256 --alternate 4 \
      --modes batched --whole "" --prefill 0 --no-batch-generator ${IN_PROCESS:+--alternate-in-process} \
      --out "$out/batching-clocks" >"$out/rounds.txt" 2>&1
    kill $smi
    grep -E "^round|^at " "$out/rounds.txt" | tail -24
    python3 bench/clock_windows.py "$out/clocks.csv" "$out/rounds.txt" ;;
  poolnice)  # a host-bound decode step against 16 workers encoding a persisting neighbour's blocks: does running
    model     # the workers nicer keep the neighbour's p99 gap down? (daemon/kv/pool.py)
    for r in 1 2; do
      for nice in 0 10; do
        [ $SECONDS -gt ${UNTIL_S:-420} ] && break 2
        KVWAKE_POOL_NICE=$nice timeout 170 python3 bench/persist.py --model /tmp/m8b --tokens 16384 \
          --out "$out/persist-nice$nice-$r" 2>&1 | tail -2 | sed "s/^/nice=$nice round $r /"
      done
    done ;;
  graphs)  # MLX on CUDA records a step's kernels into CUDA graphs of MLX_MAX_OPS_PER_BUFFER nodes (H100: 100; 20 below) and
    model   # keeps MLX_CUDA_GRAPH_CACHE_SIZE of them (an LRU of 400 in 0.32): a host-bound step (session 21: the GPU
    for r in $(seq ${ROUNDS:-1}); do  # busy 39-65%) pays a commit (a graph's update or instantiation, and launch)
      for cfg in "MLX_MAX_OPS_PER_BUFFER=20" "MLX_MAX_OPS_PER_BUFFER=100" \
                 "MLX_MAX_OPS_PER_BUFFER=100 MLX_CUDA_GRAPH_CACHE_SIZE=4000" "MLX_USE_CUDA_GRAPHS=0"; do
        [ $SECONDS -gt ${UNTIL_S:-380} ] && break 2
        env $cfg timeout 200 python3 bench/batching.py --model /tmp/m8b --sessions 8,16 --tokens 256 --modes batched \
          --whole "" --prefill 0 --out "$out/graphs-$r-${cfg// /-}" 2>&1 \
          | grep -o '"sessions": [0-9]*\|"steady_tokens_per_s": [0-9.]*\|"gpu_busy_pct": [0-9.]*\|"tokens_per_s": [0-9.]*' \
          | tr '\n' ' ' | sed "s/^/[$cfg] round $r /"; echo
      done
    done ;;
  nographs)  # kvwake and BatchGenerator (in process) with MLX's CUDA graphs on (default) and off, alternating
    model      # (session 22: p99 gaps shorter off, 16 rows' tok/s 7-8% lower off, in two pairs)
    for r in 1 2 3; do
      for g in 1 0; do
        [ $SECONDS -gt ${UNTIL_S:-420} ] && break 2
        MLX_USE_CUDA_GRAPHS=$g timeout 170 python3 bench/batching.py --model /tmp/m8b --sessions ${SESSIONS:-8,16} \
          --tokens 256 --modes batched --whole "" --prefill 0 --out "$out/nographs-$g-$r" >"$out/nographs-$g-$r.txt" 2>&1
        grep -o '"sessions": [0-9]*\|"steady_tokens_per_s": [0-9.]*\|"gpu_busy_pct": [0-9.]*\|"tokens_per_s": [0-9.]*\|"gap_p50_ms": [0-9.]*\|"gap_p99_ms": [0-9.]*' \
          "$out/nographs-$g-$r.txt" | tr '\n' ' ' | sed "s/^/graphs=$g round $r /"; echo
      done
    done ;;
  nographsprefill)  # the prefill row (a talker beside another session's 8k prefill) with MLX's CUDA graphs on and
    model             # off, alternating: the talker's p99 over its median, and the prefill's own time
    for r in 1 2; do
      for g in 1 0; do
        [ $SECONDS -gt ${UNTIL_S:-300} ] && break 2
        MLX_USE_CUDA_GRAPHS=$g timeout 140 python3 bench/batching.py --model /tmp/m8b --sessions 1 --tokens 64 \
          --modes batched --whole "" --no-batch-generator --out "$out/nographsprefill-$g-$r" 2>&1 \
          | grep -o '"p99_during_over_p50_alone": [0-9.]*\|"prefill_s": [0-9.]*\|"prefill_alone_s": [0-9.]*' \
          | tr '\n' ' ' | sed "s/^/graphs=$g round $r /"; echo
      done
    done ;;
  daemongap)  # with CUDA graphs off (session 22) BatchGenerator in process kept the GPU
    model       # 83-89% busy at 8 rows and kvwake's daemon 56%, the same mlx-lm step (batch_next 14-15 ms a step of 15 ms):
                # is it the daemon's process? The decoder in process (main thread, the daemon's MLX limits, an
                # EngineThread) against BatchGenerator, then the daemon over RPC, in one call on one machine
    MLX_USE_CUDA_GRAPHS=0 timeout 300 python3 bench/step_profile.py --model /tmp/m8b --sessions 8,16 --tokens 256 \
      --rounds 2 --limits-ab --engine-thread --out "$out/daemongap" 2>&1 | grep "^{'sessions'" | cut -c1-400
    MLX_USE_CUDA_GRAPHS=0 timeout 180 python3 bench/batching.py --model /tmp/m8b --sessions 8,16 --tokens 256 \
      --modes batched --whole "" --prefill 0 --out "$out/daemongap" 2>&1 \
      | grep -o '"sessions": [0-9]*\|"steady_tokens_per_s": [0-9.]*\|"gpu_busy_pct": [0-9.]*\|"tokens_per_s": [0-9.]*\|"batch_next": [0-9.]*' \
      | tr '\n' ' '; echo ;;
  longsolo)  # a lone session decoding over 20k tokens (its buffer past kv/capacity.py's CUDNN_MIN: cuDNN attention,
    model     # which with graphs off instantiates a CUDA graph per call, per layer) with MLX's CUDA graphs on and off,
    for r in 1 2; do  # alternating: kvwake's Solo steps and mlx-lm's generate_step (bench/step_spikes.py)
      for g in 1 0; do
        [ $SECONDS -gt ${UNTIL_S:-420} ] && break 2
        MLX_USE_CUDA_GRAPHS=$g timeout 150 python3 bench/step_spikes.py --model /tmp/m8b --prompt 20000 --tokens 300 \
          --rounds 1 --json "$out/longsolo-$g-$r.json" 2>&1 | tail -1 | sed "s/^/graphs=$g round $r /"
      done
    done ;;
  graphcache)  # MLX keeps MLX_CUDA_GRAPH_CACHE_SIZE CUDA graphs (an LRU); a prefill's slices (layer ranges, chunk
    model       # sizes) make new graphs that can evict a decode step's, which then instantiates them again (below
    for r in 1 2 3 4; do  # Python, as the long decode steps are: session 21's GIL watch)
      for size in 400 4000; do
        [ $SECONDS -gt ${UNTIL_S:-480} ] && break 2
        MLX_CUDA_GRAPH_CACHE_SIZE=$size KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 100 python3 \
          bench/batching.py --model /tmp/m8b --sessions 1 --tokens 64 --modes batched --whole "" --no-batch-generator \
          --out "$out/prefill-trace-graphcache-$size-$r" >/dev/null 2>&1
        python3 bench/trace_summary.py "cache=$size-$r" "$out/prefill-trace-graphcache-$size-$r/batching.json"
      done
    done ;;
  readback)  # bench/managed_reuse.py --steps: GPU steps, ending in a token read or not, while 1 or 4 threads read
    for r in 1 4; do  # host copies (their first reads migrate them)
      timeout 100 python3 bench/managed_reuse.py --mib 4 --count 32 --rounds 5 --steps 60 --readers $r \
        --json "$out/managed_reuse-readback-4-$r.json" 2>&1 | grep while | sed "s/^/4MiB readers=$r /"
      timeout 100 python3 bench/managed_reuse.py --mib 64 --count 8 --rounds 3 --steps 100 --readers $r \
        --json "$out/managed_reuse-readback-64-$r.json" 2>&1 | grep while | sed "s/^/64MiB readers=$r /"
    done ;;
  admitahead)  # calls sent at once, a merged batch's caches scheduled ahead of its first pass (joining.schedule) or
    model       # computed inside it (KVWAKE_ADMIT_AHEAD=0), alternating; first the host-copy drop test alone, twice
    for i in 1 2; do python3 -m pytest -q -p no:cacheprovider -p no:xdist tests/test_pipeline.py -k dropping_host 2>&1 | tail -1; done
    for run in ahead0-1 ahead1-1 ahead0-2 ahead1-2 ahead0-3 ahead1-3; do
      [ $SECONDS -gt ${UNTIL_S:-400} ] && break
      ahead=${run#ahead}; ahead=${ahead%%-*}
      KVWAKE_ADMIT_AHEAD=$ahead timeout 150 python3 bench/batching.py --model /tmp/m8b --sessions 16,32 --tokens 64 \
        --prefill 0 --modes batched --whole "" --no-batch-generator --out "$out/admitahead-$run" >/dev/null 2>&1
      python3 - "$run" "$out/admitahead-$run/batching.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[2]))["decode"]["batched"]:
    print(sys.argv[1], r["sessions"], "tok/s", r["tokens_per_s"], "first token", r.get("first_token_ms"))
PY
    done | tee "$out/admitahead.txt" ;;
  admit)  # calls sent at once join at one step (quick jobs) or one a step (.gpu/old): this tree and the old, alternating
    model
    rm -rf /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/old .gpu/old >/dev/null
    for run in new-1 old-1 new-2 old-2 new-3 old-3; do
      [ $SECONDS -gt ${UNTIL_S:-400} ] && break
      path=""; [ "${run%%-*}" = old ] && path=/tmp/old:
      PYTHONPATH=$path${PYTHONPATH:-} timeout 150 python3 bench/batching.py --model /tmp/m8b --sessions 8,16,32 --tokens 128 \
        --prefill 0 --modes batched --whole "" --no-batch-generator --out "$out/admit-$run" >/dev/null 2>&1
      python3 - "$run" "$out/admit-$run/batching.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[2]))["decode"]["batched"]:
    print(sys.argv[1], r["sessions"], "tok/s", r["tokens_per_s"], "steady", r["steady_tokens_per_s"], "first token",
          r.get("first_token_ms"), r.get("daemon_turns"), "gap p50/p99", r["gap_p50_ms"], r["gap_p99_ms"])
PY
    done ;;
  turnsatonce)  # 16 agents send their next chat turn at once beside a decoding talker: first tokens, jobs and steps;
    model        # their short chunks packed in one forward pass (model/packing.py) or not, alternating
    for run in ${TURNS_RUNS:-nopack-1 pack-1 nopack-2 pack-2}; do  # a fresh machine's first process: packing off (session 24's stalls)
      [ $SECONDS -gt ${UNTIL_S:-400} ] && break
      pack=1; [ "${run%%-*}" = nopack ] && pack=0
      cap=0; case "$run" in cap*) cap=${run%%-*}; cap=${cap#cap} ;; esac  # capN-K: slices of at most N steps
      own=1; [ "${run%%-*}" = shared ] && own=0  # shared-K: packs sized from their kind's shared costs
      KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 KVWAKE_PACK_PREFILL=$pack KVWAKE_PACK_SHARE_MAX=$cap \
        KVWAKE_PACK_OWN_COSTS=$own timeout 200 python3 bench/turns_at_once.py --model /tmp/m8b --sessions 16 --rounds 2 \
        --out "$out/turnsatonce-$run" 2>&1 | grep '^{' | sed "s/^/$run /"
    done ;;
  admittrace)  # every engine job and step named while 8/16/32 calls join at once and while 16 chat turns come at once
    model       # (slow_engine_work in each JSON): where the calls' 7-12 steps to a first token go
    KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 150 python3 bench/batching.py --model /tmp/m8b \
      --sessions 8,16,32 --tokens 128 --prefill 0 --modes batched --whole "" --no-batch-generator \
      --out "$out/admittrace" >/dev/null 2>&1
    KVWAKE_SLOW_JOB_MS=0 KVWAKE_SLOW_JOBS_KEPT=20000 timeout 200 python3 bench/turns_at_once.py --model /tmp/m8b \
      --sessions 16 --rounds 2 --out "$out/turnstrace" 2>&1 | grep '^{' ;;
  admitpass)  # bench/admit_pass.py: the first step after 16 calls join a decoding talker, merge and pass apart
    model
    timeout 240 python3 bench/admit_pass.py --model /tmp/m8b --rows 16 --talker 1000 --out "$out/admitpass" 2>&1 | grep '^{' ;;
  resume)  # issue 23's wake targets: bench/device.sh (the resume suite 1k/8k/32k planes-zstd in one process, 8k raw,
    model    # 32k with codec "auto"), the JSONs in $out/new, $out/raw, $out/auto
    OUT=$out timeout 500 bash bench/device.sh 2>&1 | grep -vE '^\s*$' | tail -30 ;;
  point8)  # issue 24 point 8's one run: 1-32 sessions streamed against BatchGenerator in process and mlx_lm.server,
    model   # gaps, the prefill row (session 23's command)
    timeout 560 python3 bench/batching.py --model /tmp/m8b --sessions ${SESSIONS:-1,4,8,16,32} --tokens 128 \
      --mlx-server --modes batched --whole "" --out "$out/point8" 2>&1 | tail -8 ;;
  alternate)  # kvwake's steady tok/s and BatchGenerator's (a fresh process each round), ROUNDS rounds at SIZES sessions
    model
    timeout 560 python3 bench/batching.py --model /tmp/m8b --sessions 8 --tokens 256 --prefill 0 --alternate ${ROUNDS:-3} \
      --alternate-sizes ${SIZES:-8,16,32} --modes batched --whole "" --no-batch-generator --out "$out/alternate" 2>&1 | tail -12 ;;
  dropprobe)  # bench/drop_probe.py: where a host copy dropped under drop_hosted goes (test_pipeline's GPU failure)
    timeout 120 python3 bench/drop_probe.py 2>&1 | tee "$out/dropprobe.txt" | head -40 ;;
  server)
    model
    timeout 560 python3 bench/batching.py --model /tmp/m8b --sessions 8,16 --tokens 128 --mlx-server \
      --modes batched --whole "" --no-batch-generator --out "$out/server" 2>&1 | tail -4 ;;
esac
