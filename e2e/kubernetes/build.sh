#!/usr/bin/env bash
# Builds (or reuses) the binaries of a single-node Kubernetes from source, pinned, and installs
# the Debian packages the node needs. Binaries are cached by name and version outside the clone:
#   ${DEVICEHOST_E2E_CACHE:-/var/cache/devicehost-e2e}/<name>-<version>/bin
# so only a machine's first run builds. A component counts as built once its directory holds
# a .complete marker; a build cut short leaves none and is redone on the next run.
#
# Prints one "built NAME in Ns" or "cached NAME" line per component, and at the end the
# directory of each as NAME_BIN=... lines that env.sh reads.
set -euo pipefail

source "$(dirname "$0")/versions.sh"

CACHE="${DEVICEHOST_E2E_CACHE:-/var/cache/devicehost-e2e}"
mkdir -p "$CACHE"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"
export CGO_ENABLED=0
export GOWORK=off
LDFLAGS_BASE="-s -w"

log() { printf '[build %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# debian_packages installs what the node takes from Debian, if any of it is missing.
debian_packages() {
  local missing=()
  command -v runc >/dev/null || missing+=(runc)
  [ -x /usr/bin/busybox ] || missing+=(busybox-static)
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  command -v iptables >/dev/null || missing+=(iptables)
  if [ ${#missing[@]} -eq 0 ]; then
    log "debian packages present"
    return
  fi
  log "apt-get install ${missing[*]}"
  local t0=$SECONDS
  export DEBIAN_FRONTEND=noninteractive
  # One apt-get at a time: .ci/run builds the node's binaries and the images side by
  # side, and each may install packages; the second waits for the first's dpkg lock.
  flock /var/lock/devicehost-apt apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends "${missing[@]}" >/dev/null ||
    { flock /var/lock/devicehost-apt apt-get -o DPkg::Lock::Timeout=300 update >/dev/null &&
      flock /var/lock/devicehost-apt apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends "${missing[@]}" >/dev/null; }
  log "installed ${missing[*]} in $((SECONDS - t0))s"
}

# gobuild NAME VERSION MODULE@VERSION 'LDFLAGS' PKG... builds PKGs from a scratch module that
# requires MODULE at VERSION (plus the extra go.mod lines in $EXTRA_GOMOD) into the cache.
gobuild() {
  local name=$1 ver=$2 modver=$3 ldflags=$4
  shift 4
  local out="$CACHE/$name-$ver" p want
  if [ -f "$out/.complete" ]; then
    # A cache entry made before a binary joined the list lacks it: build again (with a
    # warm Go build cache, mostly linking).
    want=""
    for p in "$@"; do
      [[ $p =~ /v[0-9]+$ ]] && p=${p%/*} # a module root's main package: go build drops /vN
      p=${p##*/}
      [ -n "${RENAME:-}" ] && [ "$p" = "${RENAME%%:*}" ] && p=${RENAME#*:}
      [ -x "$out/bin/$p" ] || want+=" $p"
    done
    if [ -z "$want" ]; then
      log "cached $name $ver"
      return
    fi
    log "cached $name $ver lacks$want: building it again"
  fi
  local t0=$SECONDS
  rm -rf "$out"
  mkdir -p "$out/bin" "$out/src"
  (
    cd "$out/src"
    printf 'module devicehost-e2e/%s\n\ngo 1.26\n%s\n' "$name" "${EXTRA_GOMOD:-}" >go.mod
    go get "$modver" >&2
    local p
    for p in "$@"; do go get "$p@${modver#*@}" >&2; done
    go build -trimpath -tags "${BUILD_TAGS:-}" -ldflags "$LDFLAGS_BASE $ldflags" -o "$out/bin/" "$@"
  )
  # A main package at a module's root is named after the module's last element.
  if [ -n "${RENAME:-}" ]; then mv "$out/bin/${RENAME%%:*}" "$out/bin/${RENAME#*:}"; fi
  touch "$out/.complete"
  log "built $name $ver in $((SECONDS - t0))s"
}

build_containerd() {
  BUILD_TAGS="no_btrfs no_devmapper no_zfs" gobuild containerd "$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2@$CONTAINERD_VERSION" \
    "-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2" \
    github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/ctr \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
}

build_etcd() {
  # The etcd server's main package is the root of go.etcd.io/etcd/server/v3 (the module
  # go.etcd.io/etcd/v3 holds no command): go build names it "server".
  RENAME=server:etcd gobuild etcd "$ETCD_VERSION" "go.etcd.io/etcd/server/v3@$ETCD_VERSION" "" \
    go.etcd.io/etcd/server/v3
}

build_kubernetes() {
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with
  # ./staging/src/...; those directories are not in the module zip. The published staging
  # modules v0.X.Y match v1.X.Y: replace each with that version.
  local modfile staging minor extra="" m
  (cd "$CACHE" && go mod download "k8s.io/kubernetes@$KUBERNETES_VERSION")
  modfile=$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/$KUBERNETES_VERSION.mod
  staging="v0.${KUBERNETES_VERSION#v1.}"
  for m in $(awk '$2 == "=>" && $3 ~ /^\.\/staging\// {print $1}' "$modfile"); do
    extra+="replace $m => $m $staging"$'\n'
  done
  minor=${KUBERNETES_VERSION#v1.}
  minor=${minor%%.*}
  local x="-X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION"
  x+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
  x+=" -X k8s.io/component-base/version.gitTreeState=clean"
  x+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION"
  x+=" -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  EXTRA_GOMOD="$extra" gobuild kubernetes "$KUBERNETES_VERSION" "k8s.io/kubernetes@$KUBERNETES_VERSION" "$x" \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-proxy \
    k8s.io/kubernetes/cmd/kubectl
}

# helm: `helm lint` and `helm template` of deploy/helm/devicehost in CI (deploy/helm/check.sh);
# not part of the node.
build_helm() {
  gobuild helm "$HELM_VERSION" "helm.sh/helm/v4@$HELM_VERSION" \
    "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    helm.sh/helm/v4/cmd/helm
}

# squat/generic-device-plugin, unmodified, from the Go module proxy: the kubelet device
# plugin the suite runs under devicehost (kubernetes_device_plugins).
build_generic_device_plugin() {
  gobuild generic-device-plugin "$GENERIC_DEVICE_PLUGIN_VERSION" \
    "github.com/squat/generic-device-plugin@$GENERIC_DEVICE_PLUGIN_VERSION" "" \
    github.com/squat/generic-device-plugin
}

# pause: the sandbox image's one process. A tiny static Go program, so the image needs no
# registry; it sleeps until a signal and reaps children, as the upstream pause does.
build_pause() {
  local out="$CACHE/pause-$PAUSE_VERSION"
  if [ -f "$out/.complete" ]; then
    log "cached pause $PAUSE_VERSION"
    return
  fi
  rm -rf "$out"
  mkdir -p "$out/bin" "$out/src"
  cp "$(dirname "$0")/pause/main.go" "$out/src/main.go"
  printf 'module devicehost-e2e/pause\n\ngo 1.26\n' >"$out/src/go.mod"
  (cd "$out/src" && go build -trimpath -ldflags "$LDFLAGS_BASE" -o "$out/bin/pause" .)
  touch "$out/.complete"
  log "built pause"
}

only="${1:-all}"
t_all=$SECONDS
case "$only" in
  all)
    debian_packages
    build_pause
    build_containerd
    build_etcd
    build_kubernetes
    build_generic_device_plugin
    ;;
  debian) debian_packages ;;
  generic-device-plugin) build_generic_device_plugin ;;
  pause) build_pause ;;
  containerd) build_containerd ;;
  etcd) build_etcd ;;
  kubernetes) build_kubernetes ;;
  helm) build_helm ;;
  *) echo "usage: $0 [all|debian|pause|containerd|etcd|kubernetes|generic-device-plugin|helm]" >&2; exit 2 ;;
esac
log "done in $((SECONDS - t_all))s"
