#!/usr/bin/env bash
# Checks the idemgate config embedded in every ConfigMap of this folder (the `idemgate.yaml` key)
# with the real binary: `idemgate --config FILE --check` (unknown keys, bad values, timeouts
# that do not fit, ...).
#
#   examples/kubernetes/check-configs.sh                     # cargo run --bin idemgate
#   examples/kubernetes/check-configs.sh target/debug/idemgate
#
# Needs python3 with PyYAML to extract the ConfigMaps.
#
# Cluster DNS: `--check` resolves every upstreams.<name>.addrs entry (as a start or a reload
# does), and names such as legacy-billing.default.svc.cluster.local do not resolve outside the
# cluster. For the check only, an address whose host does not resolve here is replaced by
# 127.0.0.1 with the same port (the script says which); everything else is checked verbatim.
# The Redis URL is not resolved by --check, so it is left alone.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
if [ $# -ge 1 ]; then
  idemgate=("$1")
else
  idemgate=(cargo run --quiet --locked --manifest-path "$repo/Cargo.toml" --bin idemgate --)
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Writes one file per ConfigMap to $tmp (named <manifest>--<configmap>.yaml).
python3 - "$here" "$tmp" <<'PY'
import glob, os, socket, sys
import yaml

here, out = sys.argv[1], sys.argv[2]

def resolves(host, port):
    try:
        return bool(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    except (socket.gaierror, UnicodeError):
        return False

count = 0
for path in sorted(glob.glob(os.path.join(here, "*.yaml"))):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        if doc.get("kind") != "ConfigMap" or "idemgate.yaml" not in (doc.get("data") or {}):
            continue
        name = doc["metadata"]["name"]
        text = doc["data"]["idemgate.yaml"]
        config = yaml.safe_load(text) or {}
        for upstream, settings in (config.get("upstreams") or {}).items():
            for addr in (settings or {}).get("addrs") or []:
                host, _, port = str(addr).rpartition(":")
                if host and port.isdigit() and not resolves(host.strip("[]"), port):
                    # Replace the literal text only: the file stays byte for byte otherwise.
                    text = text.replace(addr, f"127.0.0.1:{port}")
                    print(f"  {os.path.basename(path)} {name}: upstreams.{upstream}: "
                          f"{addr} does not resolve here; checked as 127.0.0.1:{port}")
        target = os.path.join(out, f"{os.path.basename(path)[:-5]}--{name}.yaml")
        with open(target, "w") as f:
            f.write(text)
        count += 1
if count == 0:
    sys.exit(f"no ConfigMap with an idemgate.yaml key under {here}")
PY

passed=0 failed=0
for file in "$tmp"/*.yaml; do
  base=$(basename "$file" .yaml)
  label="${base%%--*}.yaml ConfigMap/${base#*--}"
  # A token in the caller's environment would be validated too; the Secret supplies it in
  # the cluster, so check the file alone.
  if out=$(env -u IDEMGATE_ADMIN_TOKEN "${idemgate[@]}" --config "$file" --check 2>&1); then
    echo "ok    $label"
    passed=$((passed + 1))
  else
    echo "FAIL  $label: ${out//$file/$label}"
    failed=$((failed + 1))
  fi
done
echo "configs: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
