#!/usr/bin/env bash
# Builds every fuzz target and runs each for a bounded time. Exits non-zero if any target found a
# crash, a failed property check, a timeout or an out-of-memory; libFuzzer then leaves the input
# in fuzz/artifacts/<target>/ (replay it with `fuzz/run.sh --replay <target> <file>`).
#
# Usage: fuzz/run.sh [target ...]          (default: every target in fuzz/Cargo.toml)
#   FUZZ_SECONDS     seconds per target (default 60)
#   FUZZ_TARGET_DIR  cargo target dir (default fuzz/target; the build is large, point it at a
#                    cache outside the work tree if you have one)
#   FUZZ_SANITIZER   address (default) or none (faster; the code under test has no `unsafe`,
#                    but its YAML parser dependency does)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). cargo fuzz compiles with -Z flags
# (sanitizer, coverage instrumentation) that only a nightly rustc accepts; RUSTC_BOOTSTRAP=1
# makes a stable rustc accept them as well, so no nightly toolchain is needed. It is set here,
# for these builds only: nothing else in the repository needs or uses unstable features.
#
# Corpora: the committed seeds (a few hand-written inputs per target) are in fuzz/seeds/<target>/
# and never written to; what a run discovers goes to fuzz/corpus/<target>/ (not committed), so a
# later run on the same machine starts from it.
set -euo pipefail
caller_dir="$(pwd)"
cd "$(dirname "$0")"

export RUSTC_BOOTSTRAP=1
seconds="${FUZZ_SECONDS:-60}"
target_dir="${FUZZ_TARGET_DIR:-target}"
sanitizer="${FUZZ_SANITIZER:-address}"
build=(--release --debug-assertions --sanitizer "$sanitizer" --target-dir "$target_dir")

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz is missing; install it with: cargo install cargo-fuzz" >&2
  exit 2
fi

# libFuzzer options for a target: a hang is a finding too, and the config text gets a dictionary.
options() {
  local opts=(-timeout=10 -rss_limit_mb=2048 -print_final_stats=1)
  if [ "$1" = config ]; then
    opts+=(-dict=dict/config.dict -max_len=8192)
  fi
  echo "${opts[@]}"
}

if [ "${1:-}" = "--replay" ]; then
  if [ $# -ne 3 ]; then
    echo "usage: fuzz/run.sh --replay <target> <input file>" >&2
    exit 2
  fi
  target="$2"
  input="$3"
  case "$input" in /*) ;; *) input="$caller_dir/$input" ;; esac
  # shellcheck disable=SC2046
  exec cargo fuzz run "${build[@]}" "$target" "$input" -- $(options "$target")
fi

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list)
fi

cargo fuzz build "${build[@]}"

failed=()
for target in "${targets[@]}"; do
  mkdir -p "corpus/$target"
  echo "fuzz: $target for ${seconds}s"
  # shellcheck disable=SC2046
  if cargo fuzz run "${build[@]}" "$target" "corpus/$target" "seeds/$target" -- \
      -max_total_time="$seconds" $(options "$target"); then
    echo "fuzz: $target: ok ($(find "corpus/$target" -type f | wc -l) corpus entries)"
  else
    echo "fuzz: $target: FAILED; see fuzz/artifacts/$target/" >&2
    failed+=("$target")
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: findings in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets, ${seconds}s each, no findings"
