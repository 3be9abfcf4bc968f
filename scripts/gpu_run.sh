#!/usr/bin/env bash
# Runs on a lent GPU machine, from the repository root, with .gpu/ (scripts/gpu_kit.sh)
# carried: every check that needs a GPU, in two calls that fit one 15-minute loan with its
# start (defaults: tests 360 s, perf 230 s; `--plan` prints each phase's steps and limits).
#   tests: nvidia-smi, gpu_probe (a device, an allocation, a kernel, a copy), the CUDA suite
#          one tests/ folder at a time (a fault that poisons the context costs one folder),
#          the main example for one epoch, the NCCL test as a job of one rank, and
#          compute-sanitizer memcheck and racecheck on the riskiest kernels' tests, where a
#          short probe shows that the sanitizer accepts the device (on some machines it
#          answers "Device not supported": then the summary says it is unavailable)
#   perf:  the main example under every policy, eager and with --cuda-graph; the benchmarks
#          docs/performance.md waits for; PyTorch's counterparts where PyTorch is there;
#          then, on what is left, the other examples
#
#   bash scripts/gpu_run.sh [--plan] [all|tests|perf]
#
# Every step's limit is cut to what is left of GPU_RUN_BUDGET seconds, so the summary is
# written inside it; --plan checks that the steps' limits (extras aside) fit the budget.
#
# What comes back: the device tool returns at most 8 files from $OUT, so a run leaves there
# summary-PHASE.txt (what happened, step by step), logs-PHASE.tar.gz (every step's full
# log: tar -xzf) and, only while a step runs, step-running.log. The summary and the archive
# are rewritten after every step, so a run cut off still returns what it did. The summary
# is also printed last. Exit status: 0 when no step failed (skipped steps are no failure).
#
# Libraries: before the first step, ldd lists what the phase's programs cannot load; each
# missing library is looked for in the kit, the CUDA toolkit (/usr/local/cuda*/lib64),
# Python's nvidia-* packages (site-packages/nvidia/*/lib) and ldconfig's cache, then in the
# kit's fallback CUDA runtime. The folders found go into LD_LIBRARY_PATH for mpx's programs
# only; python3 (PyTorch) runs with the machine's own. The summary names what is still
# missing.
#
# Hooks for the dry run (tests/scripts/test_gpu_kit_dry_run.sh), unset on a real run:
# GPU_RUN_NVIDIA_SMI and GPU_RUN_SANITIZER (a program, or 'none'), GPU_RUN_WORK (the scratch
# folder, default /tmp/mpx-gpu), GPU_RUN_STEP_LIMIT (caps every step, in seconds).
set -uo pipefail
planning=''
[ "${1:-}" != --plan ] || { planning=1; shift; }
phase=${1:-all}
case $phase in
  all|tests|perf) ;;
  *) echo "usage: bash scripts/gpu_run.sh [--plan] [all|tests|perf]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/mpx-gpu-out}
mkdir -p "$OUT"
kit=$PWD/.gpu
work=${GPU_RUN_WORK:-/tmp/mpx-gpu}
programs=$work/programs
bin=$programs/bin
logs=$work/logs-$phase
# A 15-minute loan holds a machine's start (a minute or two), the tests phase, the perf
# phase and the transfers: the phases' defaults leave it four minutes to spare.
case $phase in tests) default_budget=360 ;; perf) default_budget=230 ;; all) default_budget=590 ;; esac
budget=${GPU_RUN_BUDGET:-$default_budget}
overhead=20  # unpacking the kit, finding libraries, the summary and the archive at the end
step_cap=${GPU_RUN_STEP_LIMIT:-}
summary_file=$OUT/summary-$phase.txt
archive=$OUT/logs-$phase.tar.gz
live=$OUT/step-running.log
machine_ld=${LD_LIBRARY_PATH:-}  # what python3 and the machine's tools keep
mpx_ld=$machine_ld               # what mpx's programs get, once the libraries are resolved

notes=()     # lines above the table: kit, device, libraries, sanitizer
rows=()      # one per step
failures=0

write_summary() {  # write_summary [LINE]: rewrites $OUT/summary-PHASE.txt
  {
    echo "== mpx GPU run: phase $phase on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC'), ${SECONDS}s in"
    [ ${#notes[@]} -eq 0 ] || printf '%s\n' "${notes[@]}"
    printf '%-22s %-52s %6s\n' step outcome time
    [ ${#rows[@]} -eq 0 ] || printf '%s\n' "${rows[@]}"
    [ -z "${1:-}" ] || echo "$1"
    echo "full logs: $(basename "$archive") in \$OUT ($(find "$logs" -type f | wc -l) files; tar -xzf to read)"
  } > "$summary_file.tmp" && mv -f "$summary_file.tmp" "$summary_file"
}
pack_logs() {  # rewrites $OUT/logs-PHASE.tar.gz from the logs so far
  tar -czf "$archive.tmp" -C "$logs" . 2> /dev/null && mv -f "$archive.tmp" "$archive"
}
note() { notes+=("$1"); echo "$1"; }
record() {  # record NAME OUTCOME [SECONDS]
  rows+=("$(printf '%-22s %-52s %6s' "$1" "$2" "${3:+${3}s}")")
}
cap_log() {  # keeps a log to its first 2 MiB and last 6 MiB, so the archive stays small
  local size
  size=$(stat -c %s "$1" 2> /dev/null || echo 0)
  [ "$size" -gt 8388608 ] || return 0
  { head -c 2097152 "$1"; printf '\n[... gpu_run.sh cut %s bytes here ...]\n' $((size - 8388608)); tail -c 6291456 "$1"; } > "$1.cut" &&
    mv -f "$1.cut" "$1"
}

# --plan: the steps a phase would run and each one's limit, none run. The limits of the
# steps that are not extras must fit the budget, so a slow step never starves a later one.
plan_rows=()
planned=0
extra=''    # set around the steps that run only on what the budget has left
plan_add() {  # plan_add NAME SECONDS
  if [ -n "$extra" ]; then plan_rows+=("$(printf '%-22s %4ss  extra: runs on what is left' "$1" "$2")")
  else plan_rows+=("$(printf '%-22s %4ss' "$1" "$2")"); planned=$((planned + $2)); fi
}

step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, logs it, records the outcome; returns its status
  local name=$1 limit=$2
  shift 2
  if [ -n "$planning" ]; then plan_add "$name" "$limit"; return 0; fi
  local left=$((budget - SECONDS - 15))  # 15 s kept for the summary and the archive
  if [ $left -lt 10 ]; then
    record "$name" "not run: out of time (GPU_RUN_BUDGET=${budget}s)"
    write_summary
    return 125
  fi
  [ "$limit" -le $left ] || limit=$left
  [ -z "$step_cap" ] || [ "$limit" -le "$step_cap" ] || limit=$step_cap
  write_summary "running now: $name (limit ${limit}s); its output so far: step-running.log"
  printf '$ %s\n(limit %ss)\n' "$*" "$limit" > "$live"
  local start=$SECONDS rc
  timeout -k 10 "$limit" "$@" >> "$live" 2>&1
  rc=$?
  local verdict
  case $rc in
    0) verdict=ok ;;
    77) verdict="skipped: no usable GPU (exit 77)" ;;
    124) verdict="TIMED OUT after ${limit}s"; failures=$((failures + 1)) ;;
    137) if [ $((SECONDS - start)) -ge "$limit" ]; then verdict="TIMED OUT after ${limit}s, then killed"
         else verdict="FAILED: killed (signal 9; out of memory?)"; fi
         failures=$((failures + 1)) ;;
    126|127) verdict="FAILED rc=$rc: cannot run (program or library missing)"; failures=$((failures + 1)) ;;
    *) if [ $rc -gt 128 ]; then verdict="FAILED: killed by signal $((rc - 128))"; else verdict="FAILED rc=$rc"; fi
       failures=$((failures + 1)) ;;
  esac
  mv -f "$live" "$logs/$name.log"
  cap_log "$logs/$name.log"
  record "$name" "$verdict" $((SECONDS - start))
  echo "-- $name: $verdict"
  tail -n 4 "$logs/$name.log" | sed "s/^/  [$name] /"
  write_summary
  pack_logs
  return $rc
}
mpx_step() {  # mpx_step NAME SECONDS PROGRAM ARGS...: a step running one of the kit's programs, with mpx's libraries
  local name=$1 limit=$2 program=$3
  shift 3
  if [ -z "$planning" ] && [ ! -x "$bin/$program" ]; then
    record "$name" "not run: $program is not in the kit"
    return 125
  fi
  step "$name" "$limit" env "LD_LIBRARY_PATH=$mpx_ld" "$bin/$program" "$@"
}

# The CUDA suite's groups: a line per tests/ folder, its name and the Catch2 filter that
# selects its files (--filenames-as-tags gives each case the tag [#file]), read from
# tests/meson.build, the list the suite is built from.
suite_folders() {
  python3 - tests/meson.build <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
block = re.search(r"test_folders = \{(.*?)\n\}", text, re.S).group(1)
for folder, files in re.findall(r"'(\w+)':\s*\[([^\]]*)\]", block):
    names = re.findall(r"'(\w+)\.cpp'", files)
    print(folder, ",".join("[#%s]" % n for n in names))
PY
}

if [ -n "$planning" ]; then
  # The plan: the same code path as a run (below), with step() recording instead of running.
  probe_rc=0
  plan_add device 10
  plan_add probe 15
  source <(sed -n '/^# ---- the tests phase/,/^# ---- end of the steps/p' "$0")
  echo "gpu_run.sh --plan $phase: budget ${budget}s (GPU_RUN_BUDGET), of which ${overhead}s for the kit and the summary"
  printf '%s\n' "${plan_rows[@]}"
  echo "planned: $((planned + overhead))s of ${budget}s"
  [ $((planned + overhead)) -le "$budget" ] || { echo "gpu_run.sh --plan: the steps' limits exceed the budget" >&2; exit 1; }
  exit 0
fi

rm -rf "$work" && mkdir -p "$programs" "$logs"
rm -f "$live"
if ! tar -xJf "$kit/programs.tar.xz" -C "$programs"; then
  note "kit: cannot unpack $kit/programs.tar.xz: run scripts/gpu_kit.sh here and carry .gpu"
  write_summary
  cat "$summary_file"
  exit 1
fi
note "kit: $(tr '\n' ';' < "$kit/info" 2> /dev/null | sed 's/;$//; s/;/; /g')"
# What the suite reads at fixed paths, where this machine lacks it: the fortunes
# (test_text_corpus.cpp), Fashion-MNIST (test_data.cpp), and the docs its doc-quote cases
# read under the source path the suite was built in.
link_if_absent() {  # link_if_absent PATH TARGET
  if [ -e "$1" ] || [ ! -e "$2" ]; then return 0; fi
  if mkdir -p "$(dirname "$1")" 2> /dev/null && ln -s "$2" "$1" 2> /dev/null; then
    note "linked $1 to $2 (the suite reads it there)"
  else
    note "cannot link $1 to $2: the cases that read $1 will fail"
  fi
}
link_if_absent /usr/share/games/fortunes "$kit/data/fortunes"
link_if_absent /usr/share/datasets/fashion-mnist "$kit/data/fashion-mnist"
built_in=$(sed -n 's/^source //p' "$kit/info" 2> /dev/null)
[ -z "$built_in" ] || [ "$built_in" = "$PWD" ] || link_if_absent "$built_in" "$PWD"

# The programs this phase runs, for the library check.
phase_programs=()
for p in "$bin"/*; do
  case "$phase:$(basename "$p")" in
    tests:gpu_probe|tests:mpx_tests_cuda|tests:mpx_tests_nccl|tests:fashion_mnist|all:*) phase_programs+=("$p") ;;
    tests:*|perf:mpx_tests_cuda|perf:mpx_tests_nccl) ;;
    perf:*) phase_programs+=("$p") ;;
  esac
done

# ---- libraries: find what the programs cannot load, and where it is on this machine ----
lib_dirs=()  # LD_LIBRARY_PATH for mpx's programs, before the machine's own
join_ld() { local IFS=:; echo "${lib_dirs[*]}${machine_ld:+${lib_dirs[*]:+:}$machine_ld}"; }
search_dirs=("$programs/lib")
shopt -s nullglob
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
         /usr/local/cuda-*/lib64 /usr/local/cuda-*/lib /usr/local/cuda-*/targets/x86_64-linux/lib \
         /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
  [ -d "$d" ] && search_dirs+=("$d")
done
# Python's nvidia-* wheels (nvidia-cuda-runtime, nvidia-cublas: site-packages/nvidia/*/lib);
# python3 only prints its path here, under the machine's own environment.
while IFS= read -r p; do
  for d in "$p"/nvidia/*/lib "$p"/nvidia/*/lib64; do [ -d "$d" ] && search_dirs+=("$d"); done
done < <(timeout 30 python3 -c 'import sys; print("\n".join(p for p in sys.path if p))' 2> /dev/null)
shopt -u nullglob
ldconfig_bin=$(command -v ldconfig || echo /sbin/ldconfig)
find_library() {  # find_library NAME: prints the folder that holds it
  local d path
  for d in "${search_dirs[@]}"; do
    if [ -e "$d/$1" ]; then echo "$d"; return 0; fi
  done
  path=$("$ldconfig_bin" -p 2> /dev/null | awk -v n="$1" '$1 == n { print $NF; exit }')
  if [ -n "$path" ] && [ -e "$path" ]; then dirname "$path"; return 0; fi
  if [ -e "$programs/fallback/$1" ]; then echo "$programs/fallback"; return 0; fi
  return 1
}
missing_libraries() {  # the libraries some program of the phase cannot load, one a line
  [ ${#phase_programs[@]} -gt 0 ] || return 0
  LD_LIBRARY_PATH=$(join_ld) ldd "${phase_programs[@]}" 2> /dev/null | awk '/=> not found/ { print $1 }' | sort -u
}
resolve_libraries() {
  local log=$logs/libraries.log round lib dir added found=() missing=''
  {
    echo "glibc here: $(ldd --version 2>&1 | head -n 1)"
    echo "searched, in order: ${search_dirs[*]}, ldconfig -p, $programs/fallback"
  } > "$log"
  if ! command -v ldd > /dev/null; then
    note "libraries: not checked (no ldd on this machine); LD_LIBRARY_PATH for mpx: the kit's libraries"
    lib_dirs=("$programs/lib")
    mpx_ld=$(join_ld)
    return
  fi
  for round in 1 2 3 4; do  # a library found can need others: look again
    added=0
    while read -r lib; do
      [ -n "$lib" ] || continue
      if dir=$(find_library "$lib"); then
        case ":$(join_ld):" in *":$dir:"*) continue ;; esac
        lib_dirs+=("$dir")
        found+=("$lib from $dir")
        echo "round $round: $lib found in $dir" >> "$log"
        added=1
      fi
    done < <(missing_libraries)
    [ $added -eq 1 ] || break
  done
  mpx_ld=$(join_ld)
  echo "LD_LIBRARY_PATH for mpx's programs: $mpx_ld" >> "$log"
  local p out
  for p in "${phase_programs[@]}"; do
    out=$(LD_LIBRARY_PATH=$mpx_ld ldd "$p" 2>&1)
    printf '\n== ldd %s\n%s\n' "$(basename "$p")" "$out" >> "$log"
    missing+=$(printf '%s\n' "$out" | awk -v prog="$(basename "$p")" -v OFS='\t' '
      /=> not found/ { print $1, prog } /version .* not found/ { sub(/^[ \t]*/, ""); print $0, prog }')$'\n'
  done
  missing=$(printf '%s' "$missing" | sed '/^$/d')
  [ ${#found[@]} -eq 0 ] || note "libraries found outside the loader's path: $(printf '%s, ' "${found[@]}" | sed 's/, $//')"
  if [ -z "$missing" ]; then
    note "libraries: all found; LD_LIBRARY_PATH for mpx's programs: ${mpx_ld:-(none)} (python3 keeps the machine's)"
  else
    note "libraries: MISSING, so those programs cannot start: $(printf '%s\n' "$missing" | awk -F '\t' '
      { need[$1] = need[$1] (need[$1] ? ", " : "") $2 } END { for (l in need) printf "%s (needed by %s); ", l, need[l] }' |
      sed 's/; $//')"
    note "libraries: looked in the kit, /usr/local/cuda*/lib64, Python's nvidia/*/lib, ldconfig -p; details in libraries.log"
  fi
}

# ---- the run ------------------------------------------------------------------------
write_summary "starting"
resolve_libraries
# Which versions of the libraries mpx was built against (cuDNN 9.19, cuBLAS 13.1, NCCL
# 2.28 here) this machine gives it: an older cuDNN may refuse graphs cudnn-frontend builds.
versions=()
for l in libcudart.so.13 libcublasLt.so.13 libcudnn.so.9 libnccl.so.2 libnvrtc.so.13; do
  if dir=$(LD_LIBRARY_PATH=$mpx_ld find_library "$l"); then versions+=("$(basename "$(readlink -f "$dir/$l")")"); fi
done
[ ${#versions[@]} -eq 0 ] || note "library versions: ${versions[*]}"
write_summary
pack_logs

smi=${GPU_RUN_NVIDIA_SMI:-$(command -v nvidia-smi || echo /usr/local/nvidia/bin/nvidia-smi)}
if [ -x "$smi" ]; then step device 10 "$smi"; else record device "unavailable: no nvidia-smi"; fi
probe_rc=none
if [ -x "$bin/gpu_probe" ]; then
  mpx_step probe 15 gpu_probe
  probe_rc=$?
  note "device: $(grep -m 1 '^gpu_probe:' "$logs/probe.log" 2> /dev/null || echo "gpu_probe printed nothing")"
else
  record probe "not run: no gpu_probe in the kit (gpu_kit.sh had no nvcc)"
fi

# ---- the tests phase: the verdict on the CUDA path, most valuable first -------------------
if [ "$phase" != perf ]; then
# The CUDA suite, one process per tests/ folder: a fault that poisons a CUDA context (an
# illegal address) costs one folder's verdict, not the rest of the suite's. Host suite: 15 s
# on two cores for all of it; each limit is a few times what a folder should take.
while read -r folder tags; do
  case $folder in layers) limit=45 ;; kernels|model) limit=30 ;; exec|numerics|losses|data) limit=10 ;; docs) limit=5 ;; *) limit=15 ;; esac
  # (--warn NoTests: a file the binary lacks fails rather than passing as nothing run)
  mpx_step "suite_$folder" "$limit" mpx_tests_cuda --filenames-as-tags "$tags" --reporter compact --warn NoTests < /dev/null
done < <(suite_folders)
# The main example on the GPU, one epoch under its default policy (mixed_float16).
data=$kit/data/fashion-mnist
if [ -n "$planning" ] || [ -f "$data/train-images-idx3-ubyte.gz" ]; then
  mpx_step fashion_mnist_epoch 30 fashion_mnist --executor cuda --epochs 1 --data "$data"
else
  record fashion_mnist_epoch "not run: no Fashion-MNIST in the kit (gpu_kit.sh packs it with the tests)"
fi
# NCCL data parallelism: one rank per GPU would be `mpirun -np <GPUs>`; alone it is a job
# of one rank, which runs every code path of the communicator and data_parallel.
gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
if [ -x "$bin/mpx_tests_nccl" ] && [ "${gpus:-0}" -gt 1 ] && command -v mpirun > /dev/null 2>&1; then
  step tests_nccl 20 env "LD_LIBRARY_PATH=$mpx_ld" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun -np "$gpus" "$bin/mpx_tests_nccl" --reporter compact
else
  mpx_step tests_nccl 20 mpx_tests_nccl --reporter compact
fi

# compute-sanitizer refuses some devices ("Device not supported", then error 999): a short
# run on gpu_probe (or, without it, the suite's listing) decides before the long steps.
sanitizer=${GPU_RUN_SANITIZER:-}
if [ -z "$sanitizer" ]; then
  sanitizer=$(command -v compute-sanitizer || true)
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
    [ -n "$sanitizer" ] || { [ -x "$c" ] && sanitizer=$c; }
  done
fi
sanitizer_ok=0
if [ -n "$planning" ]; then
  sanitizer_ok=1  # the plan counts the longest path
  plan_add sanitizer_probe 15
elif [ -z "$sanitizer" ] || [ "$sanitizer" = none ] || [ ! -x "$sanitizer" ]; then
  sanitizer_state="unavailable: no compute-sanitizer on this machine"
elif [ "$probe_rc" = 77 ]; then
  sanitizer_state="unavailable: not probed, gpu_probe found no usable GPU"
elif [ "$probe_rc" != none ] && [ "$probe_rc" != 0 ]; then
  sanitizer_state="unavailable: not probed, gpu_probe itself failed (rc=$probe_rc)"
else
  probe_cmd=("$bin/gpu_probe")
  # (not --list-tests: Catch2 exits with the count it listed)
  [ "$probe_rc" != none ] || probe_cmd=("$bin/mpx_tests_cuda" --filenames-as-tags "[#test_dtype]" --reporter compact)
  start=$SECONDS
  { "$sanitizer" --version 2>&1 | tail -n 1; echo "\$ compute-sanitizer --tool memcheck ${probe_cmd[*]}"; } > "$logs/sanitizer_probe.log"
  timeout -k 5 15 env "LD_LIBRARY_PATH=$mpx_ld" "$sanitizer" --tool memcheck --error-exitcode 1 "${probe_cmd[@]}" \
    >> "$logs/sanitizer_probe.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && ! grep -qiE 'not supported|ERROR SUMMARY: [1-9]' "$logs/sanitizer_probe.log"; then
    sanitizer_ok=1
    sanitizer_state="available ($(head -n 1 "$logs/sanitizer_probe.log"))"
  else
    reason=$(grep -m 1 -iE 'not supported|error|fail' "$logs/sanitizer_probe.log" | sed 's/^=* *//')
    [ -n "$reason" ] || reason=$(tail -n 1 "$logs/sanitizer_probe.log")
    sanitizer_state="unavailable: ${reason:0:100} (rc=$rc)"
  fi
  record sanitizer_probe "$sanitizer_state" $((SECONDS - start))
fi
[ -n "$planning" ] || note "sanitizer: $sanitizer_state"
pack_logs
if [ $sanitizer_ok -eq 1 ]; then
  # The kernels a reading of the code marks riskiest: shared-memory tiles and warp
  # reductions (fp8 transpose, softmax, norms, column sums), multi-tensor launches
  # (unscale_and_check), scatter-adds (embedding), attention's permutes.
  step memcheck 35 env "LD_LIBRARY_PATH=$mpx_ld" "$sanitizer" --tool memcheck --error-exitcode 1 \
    "$bin/mpx_tests_cuda" --filenames-as-tags \
    "[#test_fp8_transpose],[#test_unscale_and_check],[#test_attention],[#test_embedding],[#test_column_reduce],[#test_losses]" \
    --reporter compact
  step racecheck 20 env "LD_LIBRARY_PATH=$mpx_ld" "$sanitizer" --tool racecheck --error-exitcode 1 \
    "$bin/mpx_tests_cuda" --filenames-as-tags "[#test_fp8_transpose],[#test_softmax],[#test_norm],[#test_column_reduce],[#test_numerics],[#test_unscale_and_check]" \
    --reporter compact
else
  record memcheck "skipped: sanitizer unavailable"
  record racecheck "skipped: sanitizer unavailable"
fi
fi

# ---- the perf phase: the figures docs/performance.md waits for -----------------------------
if [ "$phase" != tests ]; then
data=$kit/data/fashion-mnist
if [ -n "$planning" ] || [ -f "$data/train-images-idx3-ubyte.gz" ]; then
  mpx_step fashion_mnist 40 fashion_mnist --executor cuda --policy all --epochs 1 --data "$data" --probe
  mpx_step fashion_mnist_graph 25 fashion_mnist --executor cuda --policy all --epochs 1 --data "$data" --cuda-graph
else
  record fashion_mnist "not run: no Fashion-MNIST in the kit"
fi
mpx_step gemm_bench 20 gemm_bench --executor cuda --repeat 5 --shapes all
mpx_step layer_bench 15 layer_bench --executor cuda --repeat 10
# Attention at 1,024 to 4,096 tokens, cuDNN's fused SDPA beside the unfused path.
mpx_step transformer_bench 25 transformer_bench --executor cuda --repeat 5
# GPT-2 small's shape (12 layers, width 768, 1,024 tokens) in bfloat16: tokens per second,
# MFU, and which attention ran (cuDNN's fused SDPA where the kit's char_lm links it); then
# the same model and step in PyTorch eager on the same GPU, and the ratio of the two.
if [ -n "$planning" ] || [ -d "$kit/data/fortunes" ]; then
  mpx_step char_lm_gpt2_small 35 char_lm --executor cuda --preset gpt2-small --policy mixed_bfloat16 --steps 30 \
    --log-every 10 --eval-batches 2 --sample 1 --corpus "$kit/data/fortunes"
else
  record char_lm_gpt2_small "not run: no fortunes corpus in the kit"
fi
# PyTorch's counterparts, where the machine has PyTorch; python3 runs with the machine's
# own LD_LIBRARY_PATH, never mpx's.
has_torch=''
if [ -n "$planning" ] || python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2> /dev/null; then
  has_torch=1  # (found, not imported: importing it costs seconds)
fi
if [ -n "$has_torch" ]; then
  step torch_gpt2 25 env PYTHONUNBUFFERED=1 python3 bench/torch_gpt2.py --mpx-log "$logs/char_lm_gpt2_small.log"
else
  record torch_gpt2 "not run: no PyTorch here"
fi
# Extras: run in whatever the budget has left, never counted in the plan; those
# docs/performance.md waits for first.
extra=1
mpx_step numerics_bench 10 numerics_bench --executor cuda --repeat 10
mpx_step scaling_bench 15 scaling_bench --executor cuda --tensors 100,1000 --repeat 10
[ -z "$has_torch" ] || step torch_attention 20 env PYTHONUNBUFFERED=1 python3 bench/torch_attention.py --repeat 5  # beside transformer_bench's rows
# The fused backward without its fixed order (atomics, as PyTorch's default): what mpx's
# bit-for-bit backward costs, at GPT-2 small's width.
mpx_step transformer_bench_atomic 15 transformer_bench --executor cuda --repeat 5 --path fused --widths 768 --nondeterministic
# Under mixed_fp8: the attention core in bfloat16 and in fp8 (cuDNN's fp8 SDPA where it
# runs: on Hopper its fp8 backward takes heads of 128, the width-1,024 model's).
mpx_step transformer_bench_fp8 15 transformer_bench --executor cuda --repeat 5 --path fused --fp8 --widths 1024
mpx_step transformer_bench_dropout 15 transformer_bench --executor cuda --repeat 5 --path fused --dropout 0.1
[ -z "$has_torch" ] || step torch_compare 20 env PYTHONUNBUFFERED=1 python3 bench/torch_compare.py --tensors 100,1000
mpx_step activation_bench 10 activation_bench --executor cuda --repeat 10
# The transformer: three policies, 200 steps each, on the kit's copy of the fortunes.
if [ -n "$planning" ] || [ -d "$kit/data/fortunes" ]; then
  mpx_step char_lm 20 char_lm --executor cuda --steps 200 --corpus "$kit/data/fortunes"
fi
for e in binary_classifier unstable_division custom_training_loop user_kernel overflow_underflow lstm_sequences; do
  mpx_step "$e" 10 "$e" --executor cuda
done
extra=''
fi

# ---- end of the steps
write_summary
pack_logs
echo
cat "$summary_file"
[ $failures -eq 0 ]
