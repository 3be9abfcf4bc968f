#!/usr/bin/env bash
# Installs clang 14, 16 and 19 (Debian 12 packages) with clang 19's runtime (libFuzzer,
# AddressSanitizer, UndefinedBehaviorSanitizer): CI compiles the headers with all three and
# builds the fuzzers (fuzz/run.sh) with clang 19. Kept out of scripts/setup.sh so the
# README's test command does not wait for compilers it does not use. Does nothing
# when they are installed.
set -euo pipefail
packages=(clang-14 clang-16 clang-19 libclang-rt-19-dev)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
