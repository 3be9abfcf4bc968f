# Sourced by scripts/test.sh, scripts/example.sh and .ci/run: what every build of mpx's
# own targets shares.
#  - ccache (installed by setup.sh; Meson picks it up for g++ and nvcc): the cache is keyed
#    on paths relative to the checkout, so a fresh clone somewhere else reuses it.
#  - mpx_gpu_present: whether this machine has a GPU a CUDA build can run on.
mpx_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export CCACHE_BASEDIR="$mpx_root"
export CCACHE_NOHASHDIR=true
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"

mpx_gpu_present() {
  # The list is read whole: `nvidia-smi -L | grep -q` under pipefail can fail when grep
  # stops early and nvidia-smi dies of SIGPIPE.
  local gpus
  command -v nvidia-smi >/dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null) && [[ "$gpus" == *$'\n'"GPU "* || "$gpus" == "GPU "* ]]
}

# The first GPU's name, for the one line that says what ran.
mpx_gpu_name() {
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
}

# Configures build directory $1 with the options that follow: a new directory is set
# up, an existing one takes the options (so switching between a host-only and a CUDA
# build reuses what it can), and one made before an option existed is regenerated.
mpx_configure() {
  local dir=$1
  shift
  if [ -f "$dir/meson-private/coredata.dat" ]; then
    local said
    said=$(meson configure "$dir" "$@" 2>&1) || said=$(meson setup --reconfigure "$dir" "$@" 2>&1) ||
      { printf '%s\n' "$said" >&2; return 1; }
  else
    meson setup "$dir" "$@"
  fi
}

# Meson before 1.4 records no header dependencies for nvcc's objects, so ninja alone never
# rebuilds a CUDA object after a header (or a test file it includes) changes: a CUDA suite
# would run code built from older headers. mpx_stale_cuda_objects BUILD SOURCE prints the
# CUDA objects of BUILD older than the newest source under SOURCE (include/, tests/,
# examples/, bench/), one per line; nothing when the Meson that generated BUILD (its
# meson-info.json; else the one on PATH; MPX_MESON_VERSION overrides both, for tests)
# records them.
mpx_stale_cuda_objects() {
  local build=$1 source=$2 version newest
  version=${MPX_MESON_VERSION:-$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["meson_version"]["full"])' \
    "$build/meson-info/meson-info.json" 2>/dev/null || meson --version 2>/dev/null || echo 0)}
  [ "$(printf '%s\n' 1.4.0 "$version" | sort -V | head -n 1)" = 1.4.0 ] && return 0
  newest=$(find "$source/include" "$source/tests" "$source/examples" "$source/bench" -type f \
    \( -name '*.hpp' -o -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.in' \) -printf '%T@ %p\n' 2>/dev/null |
    sort -n | tail -n 1 | cut -d' ' -f2-) || true
  [ -n "$newest" ] || return 0
  find "$build" -name '*.cu.o' ! -newer "$newest" -print 2>/dev/null || true
}

# Deletes the stale CUDA objects of build directory $1 (sources under $2) and says how
# many: the build that follows recompiles them, ccache hits where nothing they include
# changed.
mpx_drop_stale_cuda_objects() {
  local stale
  stale=$(mpx_stale_cuda_objects "$1" "$2")
  [ -n "$stale" ] || return 0
  echo "$(printf '%s\n' "$stale" | wc -l) CUDA objects of $1 are older than a source (Meson before 1.4 records no header dependencies for nvcc): rebuilding them"
  printf '%s\n' "$stale" | xargs -r -d '\n' rm -f --
}
