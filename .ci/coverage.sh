#!/usr/bin/env bash
# Line coverage of src/ over the whole test suite (unit, integration and doc-less test binaries),
# including every `idemgate` process the integration tests start. Not part of .ci/run: it builds
# the suite a second time with instrumentation and takes several minutes.
#
# Usage: .ci/coverage.sh          prints a per-file table; writes target/coverage/lcov.info and
#                                 target/coverage/summary.md
#   COVERAGE_TARGET_DIR   build dir (default target/coverage, kept apart from normal builds)
#   COVERAGE_FAIL_UNDER   exit 1 when src/ line coverage is below this percentage (default 90)
#
# Needs cargo-llvm-cov (`cargo install cargo-llvm-cov --locked`) and llvm-cov / llvm-profdata of
# the LLVM version rustc was built with (rustup's llvm-tools-preview component, or Debian's
# llvm-<major> package; this script finds /usr/lib/llvm-<major>/bin by itself).
#
# How subprocesses are counted: the tests kill each proxy with SIGKILL, and a killed process
# never runs the exit hook that writes its profile. So the profile runs in continuous mode
# (`%c` in LLVM_PROFILE_FILE: counters live in a memory-mapped file, written as they change),
# which on Linux needs `-runtime-counter-relocation` compiled in. Every process, test binary or
# proxy, writes its own file, and cargo llvm-cov merges them all.
#
# Two numbers are printed: llvm-cov's own, and the one written in the README, which leaves out
# each file's `#[cfg(test)] mod tests` (test code covering itself says nothing). Test-support
# modules compiled into the library (store/conformance.rs, store/faulty.rs) are counted.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

if ! cargo llvm-cov --version >/dev/null 2>&1; then
  echo "coverage: cargo-llvm-cov is missing; install it with: cargo install cargo-llvm-cov --locked" >&2
  exit 2
fi
llvm_major="$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')"
if [ -z "${LLVM_PROFDATA:-}" ] && [ -x "/usr/lib/llvm-$llvm_major/bin/llvm-profdata" ]; then
  export LLVM_COV="/usr/lib/llvm-$llvm_major/bin/llvm-cov"
  export LLVM_PROFDATA="/usr/lib/llvm-$llvm_major/bin/llvm-profdata"
fi
if [ -z "${LLVM_PROFDATA:-}" ] && ! rustup component list --installed 2>/dev/null | grep -q llvm-tools; then
  echo "coverage: no llvm-profdata for LLVM $llvm_major; install llvm-tools-preview (rustup) or llvm-$llvm_major (apt)" >&2
  exit 2
fi
command -v redis-server >/dev/null || { echo "coverage: the test suite needs redis-server" >&2; exit 2; }

export CARGO_TARGET_DIR="${COVERAGE_TARGET_DIR:-$repo/target/coverage}"
fail_under="${COVERAGE_FAIL_UNDER:-90}"
# shellcheck disable=SC1090
source <(cargo llvm-cov show-env --sh 2>/dev/null)
export RUSTFLAGS="${RUSTFLAGS:-} -Cllvm-args=-runtime-counter-relocation"
export LLVM_PROFILE_FILE="$CARGO_LLVM_COV_TARGET_DIR/idemgate-%p-%c.profraw"
cargo llvm-cov clean --workspace >/dev/null 2>&1 || true
rm -f "$CARGO_LLVM_COV_TARGET_DIR"/*.profraw

echo "coverage: cargo test (instrumented)"
log="$CARGO_TARGET_DIR/test.log"
if ! cargo test --locked >"$log" 2>&1; then
  tail -n 60 "$log" >&2
  echo "coverage: the test suite failed (whole output: $log)" >&2
  exit 1
fi
grep -E '^test result' "$log"
echo "coverage: $(find "$CARGO_LLVM_COV_TARGET_DIR" -maxdepth 1 -name '*.profraw' | wc -l) process profiles"

# Anchored at the repository: a checkout may itself live under a folder named like these.
ignore="^$repo/(tests|examples|fuzz)/"
cargo llvm-cov report --ignore-filename-regex "$ignore" --summary-only
cargo llvm-cov report --ignore-filename-regex "$ignore" --lcov --output-path "$CARGO_TARGET_DIR/lcov.info"

python3 - "$CARGO_TARGET_DIR/lcov.info" "$CARGO_TARGET_DIR/summary.md" "$fail_under" "$repo/src/" <<'PY'
import re, sys
lcov, out, fail_under, src = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]

def test_module_start(path):
    """First line of the file's `#[cfg(test)] mod tests` (kept last in every file), or None."""
    lines = open(path, encoding="utf-8").read().split("\n")
    for i, line in enumerate(lines[:-1]):
        if line.strip() == "#[cfg(test)]" and re.match(r"\s*mod tests\s*\{", lines[i + 1]):
            return i + 1
    return None

files = {}
path = None
for line in open(lcov, encoding="utf-8"):
    line = line.strip()
    if line.startswith("SF:"):
        path = line[3:]
        files.setdefault(path, {})
    elif line.startswith("DA:") and path:
        number, count = line[3:].split(",")[:2]
        files[path][int(number)] = files[path].get(int(number), 0) + int(count)

rows, total_hit, total_all = [], 0, 0
for path, lines in sorted(files.items()):
    if not path.startswith(src):
        continue
    start = test_module_start(path)
    kept = {n: c for n, c in lines.items() if start is None or n < start}
    hit = sum(1 for c in kept.values() if c > 0)
    rows.append((path[len(src):], hit, len(kept)))
    total_hit += hit
    total_all += len(kept)

pct = lambda hit, all: 100.0 * hit / all if all else 100.0
table = ["| file | lines | missed | covered |", "|---|---:|---:|---:|"]
for name, hit, all in rows:
    table.append(f"| `{name}` | {all} | {all - hit} | {pct(hit, all):.1f}% |")
table.append(f"| **total** | **{total_all}** | **{total_all - total_hit}** | **{pct(total_hit, total_all):.1f}%** |")
open(out, "w").write("\n".join(table) + "\n")
print("\nsrc/ line coverage without the files' own #[cfg(test)] modules:\n")
print("\n".join(table))
if total_all == 0:
    print("coverage: no line of src/ in the report", file=sys.stderr)
    sys.exit(1)
total = pct(total_hit, total_all)
if total < fail_under:
    print(f"\ncoverage: {total:.1f}% is below {fail_under}%", file=sys.stderr)
    sys.exit(1)
print(f"\ncoverage: {total:.1f}% (goal {fail_under}%)")
PY
