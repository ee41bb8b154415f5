#!/usr/bin/env bash
# The real-node suite, as .ci/run runs it: build the node's binaries and devicehost's
# images (or reuse the cached ones, see build.sh and scripts/image), then run the Go
# driver, which brings the node up (node.sh up), runs the cases against the real agent
# and bridge (as host processes, and as the Helm release's pods), and takes the node
# down. Needs root.
#
#   bash e2e/kubernetes/run.sh                 # everything
#   E2E_COUNT=2 bash e2e/kubernetes/run.sh     # the cases twice on one node
#   E2E_RUN='TestRealNode/KubeletRestart' ...  # one case (go test -run)
#   bash e2e/kubernetes/run.sh -prepare        # only build (or reuse) the node and images
set -euo pipefail
prepare=false
case "${1:-}" in
  "") ;;
  -prepare) prepare=true ;;
  *) echo "usage: $0 [-prepare]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
export CGO_CFLAGS="${CGO_CFLAGS:--O2 -g -Wno-deprecated-declarations}"
LOGS="${DEVICEHOST_E2E_LOGS:-/tmp/devicehost-e2e-logs}"
export DEVICEHOST_E2E_LOGS="$LOGS"

# One node per machine: its ports and /var/lib/kubelet are the machine's.
exec 9>/var/lock/devicehost-e2e.lock
flock -w 900 9 || { echo "another devicehost e2e run holds /var/lock/devicehost-e2e.lock"; exit 1; }

# devicehost's image, twice: the version of this tree, and the same tree tagged as
# another version, which TestRealNodeHelm upgrades to (and rolls back from). Both
# cached by their inputs' hash (scripts/image). Built beside the node's binaries: a cold
# image build spends minutes on apt, mmdebstrap and module downloads, which then overlap
# the node's compiles instead of adding to them. Its log is printed when both are done.
images="${DEVICEHOST_E2E_CACHE:-/var/cache/devicehost-e2e}/images"
mkdir -p "$images"
version=$(scripts/image -print-tag)
DEVICEHOST_E2E_IMAGES=""
for role in current next; do
  tag=$version
  [ "$role" = next ] && tag+=-next
  DEVICEHOST_E2E_IMAGES+="$tag=$images/$role.tar "
done
export DEVICEHOST_E2E_IMAGES
# The images are needed by TestRealNodeHelm alone, which runs last: the other cases run
# while they build (a source change rebuilds both, about 100 s). The build writes its exit
# status to $DEVICEHOST_E2E_IMAGES_DONE when it ends, and its log to
# $DEVICEHOST_E2E_IMAGES_LOG, for TestRealNodeHelm to wait on and report.
image_log=$(mktemp)
image_done=$(mktemp -u)
export DEVICEHOST_E2E_IMAGES_DONE="$image_done" DEVICEHOST_E2E_IMAGES_LOG="$image_log"
(
  t0=$SECONDS
  status=0
  # One file per role, overwritten each run (scripts/image keeps its own cache).
  for role in current next; do
    tag=$version
    [ "$role" = next ] && tag+=-next
    scripts/image -o "$images/$role.tar" -tag "$tag" || { status=$?; break; }
  done
  [ "$status" = 0 ] && echo "e2e: images ready in $((SECONDS - t0))s: $DEVICEHOST_E2E_IMAGES"
  echo "$status" >"$image_done.tmp" && mv "$image_done.tmp" "$image_done"
  exit "$status"
) >"$image_log" 2>&1 &
image_pid=$!
cleanup() { kill "$image_pid" 2>/dev/null || true; rm -f "$image_log" "$image_done"; }
trap cleanup EXIT
# wait_images waits for the images' build and prints its log; fails if it failed.
wait_images() {
  local status=0
  wait "$image_pid" || status=$?
  cat "$image_log"
  [ "$status" = 0 ] || { echo "e2e: building devicehost's images failed (exit $status)"; return 1; }
}

t0=$SECONDS
node_status=0
{ bash e2e/kubernetes/build.sh && bash e2e/kubernetes/build.sh helm; } || node_status=$?
echo "e2e: node binaries ready in $((SECONDS - t0))s (status $node_status)"
[ "$node_status" = 0 ] || { echo "e2e: building the node's binaries failed (exit $node_status)"; exit 1; }
source e2e/kubernetes/versions.sh
export DEVICEHOST_E2E_HELM="${DEVICEHOST_E2E_CACHE:-/var/cache/devicehost-e2e}/helm-$HELM_VERSION/bin/helm"
if $prepare; then
  wait_images
  exit
fi

rm -rf "$LOGS"
mkdir -p "$LOGS"
# The driver takes the node down itself; this is for a driver that was killed.
trap 'cleanup; bash e2e/kubernetes/node.sh down >/dev/null 2>&1 || true' EXIT
t1=$SECONDS
status=0
DEVICEHOST_E2E_K8S=1 go test -race -count="${E2E_COUNT:-1}" -timeout "${E2E_TIMEOUT:-20m}" \
  -run "${E2E_RUN:-.}" -v ./e2e/kubernetes/ || status=$?
echo "e2e: suite finished in $((SECONDS - t1))s (status $status)"
# A run of cases without TestRealNodeHelm did not wait for the images: they are still
# checked, so that a broken image build fails the run.
wait_images || status=1
if [ "$status" != 0 ]; then
  for f in "$LOGS"/*.log; do
    printf '\n==== last lines of %s\n' "$f"
    tail -n 25 "$f"
  done
fi
exit "$status"
