#!/usr/bin/env bash
# The GPU kit's dry run, on a machine without a GPU and without building anything with nvcc:
# scripts/gpu_kit.sh packs a stand-in build directory (tiny g++ programs that print what
# they were given and exit as the real ones would: 77 for the CUDA suite, as without a GPU),
# then scripts/gpu_run.sh runs its phases on the kit with a stand-in $OUT, nvidia-smi and
# compute-sanitizer, as the device tool would. It checks what a first run on a lent GPU
# machine depends on:
#   - the size check counts what the device call sends (tracked and untracked files, .gpu/),
#     not ignored files, and refuses a tree over the limit;
#   - every run leaves few files in $OUT (the tool returns at most 8), all readable: a
#     summary that says what happened per step, and the logs packed in one archive, also
#     when the run is cut off mid-step;
#   - a missing compute-sanitizer, or one that refuses the device, reads "unavailable";
#   - a library the programs need that only a Python package holds (site-packages/nvidia/
#     */lib) is found and given to mpx's programs, never to python3; one found nowhere is
#     named in the summary.
#   bash tests/scripts/test_gpu_kit_dry_run.sh SOURCE_ROOT    (Meson: suite host)
set -euo pipefail
src=$(cd "${1:?usage: test_gpu_kit_dry_run.sh SOURCE_ROOT}" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mpx-gpu-dry-run.XXXXXX")
cleanup() {
  [ -z "${hang_pgid:-}" ] || kill -KILL -- "-$hang_pgid" 2> /dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
read -r -a cxx <<< "${CXX:-c++}"
checks=0

fail() {  # fail MESSAGE [FILE...]: prints the message and the files, exits 1
  local message=$1 f
  shift
  for f in "$@"; do [ -f "$f" ] && { echo "---- $f" >&2; cat "$f" >&2; }; done
  echo "FAIL (gpu kit dry run): $message" >&2
  exit 1
}
expect() {  # expect FILE EXTENDED-REGEX WHAT
  grep -qE -- "$2" "$1" || fail "$3: no line matching /$2/ in $(basename "$1")" "$1"
  checks=$((checks + 1))
}
expect_not() {  # expect_not FILE EXTENDED-REGEX WHAT
  if grep -qE -- "$2" "$1"; then fail "$3: a line matches /$2/ in $(basename "$1")" "$1"; fi
  checks=$((checks + 1))
}

# ---- stand-ins: two libraries, the programs, nvcc, nvidia-smi, compute-sanitizer --------
stubs=$tmp/stubs site=$tmp/site tools=$tmp/tools
mkdir -p "$stubs" "$site/nvidia/fakepkg/lib" "$site/torch" "$tools"
echo 'extern "C" int mpxfake_site() { return 0; }' > "$stubs/site.cpp"
echo 'extern "C" int mpxfake_absent() { return 0; }' > "$stubs/absent.cpp"
cat > "$stubs/stub.cpp" <<'EOF'
// Stands in for one of mpx's CUDA programs; its name (argv[0]) says which. Prints its
// arguments and LD_LIBRARY_PATH, exits 77 for the CUDA suite (no GPU), 0 otherwise, or as
// MPX_STUB says ("name=CODE" or "name=hang", comma-separated).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
extern "C" int mpxfake_site();
#ifdef NEEDS_ABSENT
extern "C" int mpxfake_absent();
#endif
int main(int argc, char** argv) {
  char const* slash = std::strrchr(argv[0], '/');
  char const* name = slash ? slash + 1 : argv[0];
  int code = mpxfake_site();
#ifdef NEEDS_ABSENT
  code += mpxfake_absent();
#endif
  std::printf("stub %s:", name);
  for (int i = 1; i < argc; ++i) std::printf(" %s", argv[i]);
  char const* ld = std::getenv("LD_LIBRARY_PATH");
  std::printf("\nLD_LIBRARY_PATH=%s\n", ld ? ld : "(unset)");
  if (std::strcmp(name, "mpx_tests_cuda") == 0) {
    std::printf("mpx cuda suite: no usable GPU (stand-in); skipped\n");
    code = 77;
  }
  if (std::strcmp(name, "gpu_probe") == 0) std::printf("gpu_probe: Stand-in GPU, sm_90\ngpu_probe: kernel ok\n");
  char const* rules = std::getenv("MPX_STUB");
  size_t const len = std::strlen(name);
  for (char const* r = rules; r && *r;) {
    if (std::strncmp(r, name, len) == 0 && r[len] == '=') {
      if (std::strncmp(r + len + 1, "hang", 4) == 0) {
        std::fflush(stdout);
        sleep(600);
      }
      code = std::atoi(r + len + 1);
    }
    r = std::strchr(r, ',');
    if (r) ++r;
  }
  return code;
}
EOF
(
  cd "$stubs"
  "${cxx[@]}" -shared -fPIC -Wl,-soname,libmpxfake_site.so.1 -o libmpxfake_site.so.1 site.cpp
  "${cxx[@]}" -shared -fPIC -Wl,-soname,libmpxfake_absent.so.1 -o libmpxfake_absent.so.1 absent.cpp
  "${cxx[@]}" -o stub stub.cpp ./libmpxfake_site.so.1
  "${cxx[@]}" -DNEEDS_ABSENT -o stub_absent stub.cpp ./libmpxfake_site.so.1 ./libmpxfake_absent.so.1
) || fail "cannot build the stand-in programs with ${cxx[*]}"
# The site library lives only in a Python package folder; the other one nowhere.
mv "$stubs/libmpxfake_site.so.1" "$site/nvidia/fakepkg/lib/"
rm -f "$stubs/libmpxfake_absent.so.1"
touch "$site/torch/__init__.py"

cat > "$tools/nvcc" <<EOF
#!/usr/bin/env bash
# Stand-in nvcc: records its arguments, "builds" gpu_probe by copying the stub.
echo "\$*" > "$tools/nvcc.args"
while [ \$# -gt 0 ]; do [ "\$1" = -o ] && out=\$2; shift; done
cp "$stubs/stub" "\$out"
EOF
cat > "$tools/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
echo "Stand-in nvidia-smi: GPU 0: NVIDIA H100 80GB HBM3"
EOF
cat > "$tools/sanitizer-refuses" <<'EOF'
#!/usr/bin/env bash
[ "$1" = --version ] && { echo "NVIDIA (R) Compute Sanitizer"; echo "Version 2025.3.1 (stand-in)"; exit 0; }
echo "========= COMPUTE-SANITIZER"
echo "========= Error: Device not supported. Please refer to the documentation"
echo "========= ERROR SUMMARY: 1 error"
exit 1
EOF
cat > "$tools/sanitizer-works" <<'EOF'
#!/usr/bin/env bash
[ "$1" = --version ] && { echo "NVIDIA (R) Compute Sanitizer"; echo "Version 2025.3.1 (stand-in)"; exit 0; }
echo "========= COMPUTE-SANITIZER (stand-in) $*"
while [ $# -gt 0 ]; do
  case $1 in --tool|--error-exitcode) shift 2 ;; --*) shift ;; *) break ;; esac
done
"$@"
rc=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
EOF
chmod +x "$tools"/*

# ---- a build directory of stand-ins, and a checkout that holds the two scripts ---------
build=$tmp/build
mkdir -p "$build/tests" "$build/examples/fashion_mnist.p" "$build/bench" "$build/meson-info"
cp "$stubs/stub" "$build/tests/mpx_tests_cuda"
for e in fashion_mnist binary_classifier unstable_division custom_training_loop user_kernel overflow_underflow lstm_sequences; do
  cp "$stubs/stub" "$build/examples/$e"
done
for b in numerics_bench scaling_bench activation_bench layer_bench transformer_bench; do cp "$stubs/stub" "$build/bench/$b"; done
cp "$stubs/stub_absent" "$build/bench/gemm_bench"
printf '{"directories": {"source": "%s", "build": "%s"}}\n' "$src" "$build" > "$build/meson-info/meson-info.json"
echo '[{"name": "gpu_architectures", "value": "90"}]' > "$build/meson-info/intro-buildoptions.json"
data=$tmp/fashion-mnist
mkdir -p "$data"
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  echo "$f" | gzip > "$data/$f.gz"
done

repo=$tmp/repo
mkdir -p "$repo/scripts" "$repo/bench" "$repo/ignored" "$repo/tests"
cp "$src/scripts/gpu_kit.sh" "$src/scripts/gpu_run.sh" "$src/scripts/build_env.sh" "$repo/scripts/"
cp "$src/tests/meson.build" "$repo/tests/"  # the suite's folders, which gpu_run.sh runs one at a time
printf '/.gpu/\n/ignored/\n' > "$repo/.gitignore"
cat > "$repo/bench/torch_compare.py" <<'EOF'
import os, sys
print("stand-in torch_compare", *sys.argv[1:])
print("LD_LIBRARY_PATH=" + os.environ.get("LD_LIBRARY_PATH", "(unset)"))
EOF
for t in torch_gpt2 torch_attention; do
  printf 'import sys\nprint("stand-in %s", *sys.argv[1:])\n' "$t" > "$repo/bench/$t.py"
done
git -C "$repo" init -q
head -c 3145728 /dev/zero > "$repo/untracked.bin"     # travels: untracked, not ignored
head -c 3145728 /dev/zero > "$repo/ignored/junk.bin"  # stays: ignored

kit_env=(env "GPU_KIT_NVCC=$tools/nvcc" "GPU_KIT_DATA=$data")

# ---- gpu_kit.sh: the size check counts the tree ------------------------------------------
if "${kit_env[@]}" GPU_KIT_LIMIT_MIB=3 bash "$repo/scripts/gpu_kit.sh" "$build" > "$tmp/kit-small.log" 2>&1; then
  fail "gpu_kit.sh accepted 3 MiB of untracked files under a 3 MiB limit: its size check does not count the working tree" "$tmp/kit-small.log"
fi
expect "$tmp/kit-small.log" 'too large to carry' "gpu_kit.sh over the limit"
expect "$tmp/kit-small.log" 'untracked\.bin' "gpu_kit.sh over the limit names the largest files"

"${kit_env[@]}" bash "$repo/scripts/gpu_kit.sh" "$build" --only tests > "$tmp/kit-tests.log" 2>&1 ||
  fail "gpu_kit.sh --only tests failed" "$tmp/kit-tests.log"
tar -tJf "$repo/.gpu/programs.tar.xz" > "$tmp/kit-tests.list"
expect "$tmp/kit-tests.list" '^bin/mpx_tests_cuda$' "--only tests packs the suite"
expect "$tmp/kit-tests.list" '^bin/gpu_probe$' "--only tests packs gpu_probe"
expect "$tmp/kit-tests.list" '^bin/fashion_mnist$' "--only tests packs the main example (one epoch in the tests phase)"
expect_not "$tmp/kit-tests.list" 'binary_classifier|_bench' "--only tests packs no other example and no benchmark"
[ -f "$repo/.gpu/data/fashion-mnist/train-images-idx3-ubyte.gz" ] || fail "--only tests did not pack Fashion-MNIST"
[ ! -d /usr/share/games/fortunes ] || [ -n "$(ls -A "$repo/.gpu/data/fortunes" 2> /dev/null)" ] ||
  fail "--only tests did not pack the fortunes (the suite's text-corpus cases read them)"

# A CUDA object older than a source (nvcc's header dependencies are not recorded) is
# rebuilt, or, with nothing to rebuild it with, refused.
touch -d '2000-01-01' "$build/stale.cu.o"
if "${kit_env[@]}" MPX_MESON_VERSION=1.0.1 bash "$repo/scripts/gpu_kit.sh" "$build" --only tests > "$tmp/kit-stale.log" 2>&1; then
  fail "gpu_kit.sh packed a build with a stale CUDA object" "$tmp/kit-stale.log"
fi
expect "$tmp/kit-stale.log" 'CUDA objects older than' "gpu_kit.sh names the stale CUDA objects"
rm -f "$build/stale.cu.o"

# scripts/test.sh and example.sh drop stale CUDA objects before building (build_env.sh):
# an object older than a source goes, a newer one stays; under Meson 1.4, which records
# nvcc's header dependencies, none goes.
objects=$tmp/objects
mkdir -p "$objects/sub dir" "$objects/meson-info"
touch -d '2000-01-01' "$objects/sub dir/old.cu.o" "$objects/old.cpp.o"
touch "$objects/new.cu.o"
# The Meson that generated the build directory decides (its meson-info.json), not the one on PATH.
printf '{"meson_version": {"full": "1.4.0"}}\n' > "$objects/meson-info/meson-info.json"
(source "$repo/scripts/build_env.sh" && mpx_drop_stale_cuda_objects "$objects" "$src") > "$tmp/drop14.log" 2>&1 ||
  fail "mpx_drop_stale_cuda_objects failed under Meson 1.4" "$tmp/drop14.log"
[ -f "$objects/sub dir/old.cu.o" ] || fail "mpx_drop_stale_cuda_objects deleted an object under Meson 1.4" "$tmp/drop14.log"
printf '{"meson_version": {"full": "1.0.1"}}\n' > "$objects/meson-info/meson-info.json"
(source "$repo/scripts/build_env.sh" && mpx_drop_stale_cuda_objects "$objects" "$src") > "$tmp/drop.log" 2>&1 ||
  fail "mpx_drop_stale_cuda_objects failed" "$tmp/drop.log"
expect "$tmp/drop.log" '^1 CUDA objects of .* older than a source' "mpx_drop_stale_cuda_objects says what it drops"
[ ! -e "$objects/sub dir/old.cu.o" ] || fail "mpx_drop_stale_cuda_objects kept a CUDA object older than the sources" "$tmp/drop.log"
[ -f "$objects/new.cu.o" ] && [ -f "$objects/old.cpp.o" ] ||
  fail "mpx_drop_stale_cuda_objects deleted a current CUDA object or a C++ object" "$tmp/drop.log"

"${kit_env[@]}" bash "$repo/scripts/gpu_kit.sh" "$build" > "$tmp/kit.log" 2>&1 || fail "gpu_kit.sh failed" "$tmp/kit.log"
tar -tJf "$repo/.gpu/programs.tar.xz" > "$tmp/kit.list"
for p in mpx_tests_cuda gpu_probe fashion_mnist lstm_sequences gemm_bench layer_bench; do
  expect "$tmp/kit.list" "^bin/$p\$" "the kit holds $p"
done
expect_not "$tmp/kit.list" 'fashion_mnist\.p|libmpxfake' "the kit holds no folder and no library found nowhere here"
expect "$tmp/tools/nvcc.args" 'code=sm_90' "gpu_probe is built for sm_90"
expect "$repo/.gpu/info" '^commit ' "the kit records the commit"
expect "$repo/.gpu/info" '^source /' "the kit records the source folder the suite reads its docs under"
[ -f "$repo/.gpu/data/fashion-mnist/train-images-idx3-ubyte.gz" ] || fail "the kit has no Fashion-MNIST" "$tmp/kit.log"
expect "$tmp/kit.log" 'not found on this machine.*libmpxfake_site\.so\.1' "gpu_kit.sh names the libraries it cannot pack"
carried=$(sed -n 's/.*carries [0-9.]* MiB (\([0-9]*\) bytes.*/\1/p' "$tmp/kit.log")
[ -n "$carried" ] || fail "gpu_kit.sh printed no carried size" "$tmp/kit.log"
kit_bytes=$(find "$repo/.gpu" -type f -printf '%s\n' | awk '{ s += $1 } END { print s }')
low=$((3145728 + kit_bytes)) high=$((3145728 + kit_bytes + 65536))
if [ "$carried" -lt "$low" ] || [ "$carried" -gt "$high" ]; then
  fail "gpu_kit.sh counted $carried bytes; the untracked file and .gpu/ make $low, the ignored file must not count (at most $high)" "$tmp/kit.log"
fi
checks=$((checks + 1))

# ---- gpu_run.sh: phases against the kit, as the device tool would run them ----------------
run() {  # run NAME PHASE [VAR=VALUE...]: runs gpu_run.sh with a fresh $OUT; sets out, rc, sum, logdir
  local name=$1 phase=$2
  shift 2
  out=$tmp/out-$name
  mkdir -p "$out"
  rc=0
  (cd "$repo" && env OUT="$out" GPU_RUN_WORK="$tmp/work" GPU_RUN_NVIDIA_SMI="$tools/nvidia-smi" \
     LD_LIBRARY_PATH=/orig/marker PYTHONPATH="$site" "$@" bash scripts/gpu_run.sh "$phase") > "$tmp/$name.stdout" 2>&1 || rc=$?
  sum=$out/summary-$phase.txt
  [ -f "$sum" ] || fail "run $name: no summary-$phase.txt in \$OUT" "$tmp/$name.stdout"
  check_out "$name" "$out" "$phase"
}
check_out() {  # check_out NAME OUT PHASE: what the device tool would bring back, and the logs
  local name=$1 out=$2 phase=$3 count
  count=$(find "$out" -type f | wc -l)
  [ "$count" -le 4 ] || fail "run $name left $count files in \$OUT; the device tool returns 8 at most and the kit means to leave 2 or 3: $(ls "$out")"
  if [ -n "$(find "$out" -mindepth 3 -type f)" ] || [ -n "$(find "$out" -type f -printf '%f\n' | grep '[^A-Za-z0-9._-]')" ]; then
    fail "run $name left files the device tool does not return (too deep or oddly named): $(find "$out" -type f)"
  fi
  if [ -n "$(find "$out" -type f -size +16M)" ]; then fail "run $name left a file over 16 MiB in \$OUT"; fi
  logdir=$tmp/logs-$name
  mkdir -p "$logdir"
  tar -xzf "$out/logs-$phase.tar.gz" -C "$logdir" || fail "run $name: logs-$phase.tar.gz does not unpack" "$sum"
  checks=$((checks + 1))
}
site_lib=$site/nvidia/fakepkg/lib

# A: the tests phase where no compute-sanitizer exists.
run no_sanitizer tests GPU_RUN_SANITIZER=none
[ "$rc" -eq 0 ] || fail "tests phase without a sanitizer exited $rc (a skip is no failure)" "$sum" "$tmp/no_sanitizer.stdout"
expect "$sum" '^device +ok' "the device step"
expect "$sum" '^probe +ok' "the probe step"
expect "$sum" '^device: gpu_probe: Stand-in GPU' "the summary names the device"
expect "$sum" '^suite_kernels +skipped: no usable GPU \(exit 77\)' "the CUDA suite's exit 77 reads as skipped"
for folder in core exec kernels losses numerics scaling optim data layers model; do
  expect "$sum" "^suite_$folder " "the CUDA suite's folder $folder has its own row"
done
expect "$logdir/suite_kernels.log" 'stub mpx_tests_cuda: --filenames-as-tags \[#test_elementwise\],.*\[#test_lstm\] --reporter compact' \
  "a folder's step runs its files' cases"
expect "$sum" '^fashion_mnist_epoch +ok' "the main example's epoch in the tests phase"
expect "$logdir/fashion_mnist_epoch.log" 'stub fashion_mnist: --executor cuda --epochs 1 --data' "one epoch on the kit's data"
expect "$sum" '^sanitizer: unavailable: no compute-sanitizer' "a missing compute-sanitizer reads as unavailable"
expect "$sum" '^memcheck +skipped: sanitizer unavailable' "memcheck without a sanitizer"
expect "$sum" '^racecheck +skipped: sanitizer unavailable' "racecheck without a sanitizer"
expect "$sum" "libmpxfake_site\\.so\\.1 from $site_lib" "the library in Python's nvidia/*/lib is found"
expect "$sum" '^libraries: all found' "the tests phase's programs find every library"
expect "$logdir/suite_core.log" "^LD_LIBRARY_PATH=$site_lib:/orig/marker\$" "mpx's programs get the library's folder before the machine's own"
expect "$logdir/probe.log" 'kernel ok' "the probe's log"
expect "$logdir/device.log" 'Stand-in nvidia-smi' "nvidia-smi's log"
expect "$logdir/libraries.log" 'libmpxfake_site\.so\.1 found in' "the library search's log"
expect "$tmp/no_sanitizer.stdout" '^suite_model +skipped' "the summary is printed last"

# B: a compute-sanitizer that refuses the device.
run sanitizer_refuses tests GPU_RUN_SANITIZER="$tools/sanitizer-refuses"
[ "$rc" -eq 0 ] || fail "tests phase with a refusing sanitizer exited $rc" "$sum"
expect "$sum" '^sanitizer: unavailable: .*Device not supported' "a sanitizer that refuses the device reads as unavailable"
expect "$sum" '^memcheck +skipped: sanitizer unavailable' "memcheck is not run where the sanitizer refuses"
expect "$logdir/sanitizer_probe.log" 'Device not supported' "the sanitizer probe's log"

# C: a compute-sanitizer that works: memcheck and racecheck run the suite under it.
run sanitizer_works tests GPU_RUN_SANITIZER="$tools/sanitizer-works"
[ "$rc" -eq 0 ] || fail "tests phase with a working sanitizer exited $rc" "$sum"
expect "$sum" '^sanitizer: available' "a working sanitizer"
expect "$sum" '^memcheck +skipped: no usable GPU' "memcheck ran the suite"
expect "$logdir/memcheck.log" 'COMPUTE-SANITIZER \(stand-in\) --tool memcheck' "memcheck runs under the sanitizer"
expect "$logdir/racecheck.log" 'stub mpx_tests_cuda: --filenames-as-tags \[#test_fp8_transpose\]' "racecheck runs the suite's files"
expect "$logdir/memcheck.log" "^LD_LIBRARY_PATH=$site_lib:" "the suite under the sanitizer gets mpx's libraries"

# D: the perf phase: a failing example, a hanging benchmark, one that lacks a library, PyTorch.
run perf perf GPU_RUN_SANITIZER=none GPU_RUN_STEP_LIMIT=2 MPX_STUB=unstable_division=3,layer_bench=hang
[ "$rc" -ne 0 ] || fail "the perf phase with failing steps exited 0" "$sum"
expect "$sum" '^fashion_mnist +ok' "the main example"
expect "$sum" '^fashion_mnist_graph +ok' "the main example with graphs"
expect "$sum" '^binary_classifier +ok' "an example"
expect "$sum" '^unstable_division +FAILED rc=3' "a failing example"
expect "$sum" '^layer_bench +TIMED OUT after 2s' "a hanging benchmark is stopped"
expect "$sum" '^gemm_bench +FAILED rc=127' "a benchmark whose library is missing"
expect "$sum" '^libraries: MISSING.*libmpxfake_absent\.so\.1 \(needed by gemm_bench\)' "the summary names the missing library"
expect "$sum" '^torch_compare +ok' "PyTorch's comparison"
expect "$sum" '^transformer_bench +ok' "the attention benchmark"
expect "$sum" '^torch_gpt2 +ok' "PyTorch's GPT-2-small step"
expect "$logdir/torch_gpt2.log" '^stand-in torch_gpt2 --mpx-log .*/char_lm_gpt2_small\.log$' "it reads char_lm's log for the ratio"
expect "$logdir/fashion_mnist.log" '--data .*/\.gpu/data/fashion-mnist --probe' "the example reads the kit's data"
expect "$logdir/torch_compare.log" '^LD_LIBRARY_PATH=/orig/marker$' "python3 keeps the machine's LD_LIBRARY_PATH"
expect "$logdir/binary_classifier.log" "^LD_LIBRARY_PATH=$site_lib:/orig/marker\$" "an example gets mpx's libraries"
expect_not "$sum" '^tests_cuda' "the perf phase runs no suite"

# E: a budget too small for anything still leaves a summary.
run no_time all GPU_RUN_SANITIZER=none GPU_RUN_BUDGET=5
expect "$sum" '^suite_core +not run: out of time' "steps past the budget"
expect "$sum" '^layer_bench +not run: out of time' "steps past the budget, perf"

# G: the budgets. Each phase's default fits a 15-minute loan with the machine's start (tests
# at most 6 minutes, perf at most 4), and the limits of its steps fit its budget.
for p in tests:360 perf:240; do
  bash "$repo/scripts/gpu_run.sh" --plan "${p%%:*}" > "$tmp/plan-${p%%:*}.log" 2>&1 ||
    fail "the ${p%%:*} phase's steps do not fit its budget" "$tmp/plan-${p%%:*}.log"
  default=$(sed -n 's/.*: budget \([0-9]*\)s (GPU_RUN_BUDGET).*/\1/p' "$tmp/plan-${p%%:*}.log")
  [ -n "$default" ] && [ "$default" -le "${p##*:}" ] ||
    fail "the ${p%%:*} phase's default budget is ${default:-unknown}s, over ${p##*:}s" "$tmp/plan-${p%%:*}.log"
  expect "$tmp/plan-${p%%:*}.log" '^planned: [0-9]+s of [0-9]+s$' "the ${p%%:*} plan's total"
done
expect "$tmp/plan-tests.log" '^suite_model +[0-9]+s$' "the plan lists the suite's folders"
expect "$tmp/plan-perf.log" '^fashion_mnist_graph +[0-9]+s$' "the plan lists the main example with graphs"
if GPU_RUN_BUDGET=100 bash "$repo/scripts/gpu_run.sh" --plan tests > "$tmp/plan-small.log" 2>&1; then
  fail "a plan whose steps exceed GPU_RUN_BUDGET=100 passed" "$tmp/plan-small.log"
fi
expect "$tmp/plan-small.log" 'exceed the budget' "a plan over its budget says so"
[ ! -e "$tmp/work/plan" ] && [ -z "$(find "$repo" -name 'summary-*.txt')" ] || fail "--plan ran or wrote something"

# F: a run cut off mid-step (the device tool's 10 minutes) still leaves its summary and logs.
out=$tmp/out-cut
mkdir -p "$out"
(cd "$repo" && exec setsid env OUT="$out" GPU_RUN_WORK="$tmp/work" GPU_RUN_NVIDIA_SMI="$tools/nvidia-smi" \
   GPU_RUN_SANITIZER=none PYTHONPATH="$site" MPX_STUB=binary_classifier=hang bash scripts/gpu_run.sh perf) \
   > "$tmp/cut.stdout" 2>&1 &
hang_pgid=$!
for _ in $(seq 200); do
  grep -qs '^running now: binary_classifier' "$out/summary-perf.txt" && break
  sleep 0.1
done
grep -qs '^running now: binary_classifier' "$out/summary-perf.txt" || fail "the cut-off run never reached binary_classifier" "$tmp/cut.stdout"
{ kill -KILL -- "-$hang_pgid"; wait "$hang_pgid"; } 2> /dev/null || true
hang_pgid=''
sum=$out/summary-perf.txt
check_out cut "$out" perf
expect "$sum" '^fashion_mnist +ok' "a cut-off run's summary keeps the steps done"
expect "$out/step-running.log" 'stub binary_classifier' "a cut-off run returns the running step's output"
[ -f "$logdir/fashion_mnist_graph.log" ] || fail "a cut-off run's archive lacks the steps done: $(ls "$logdir")"

echo "gpu kit dry run: $checks checks passed in ${SECONDS}s"
