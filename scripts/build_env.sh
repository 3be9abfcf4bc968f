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
