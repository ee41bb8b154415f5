#!/usr/bin/env bash
# A single-node Kubernetes on this machine, from the binaries build.sh made: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, containerd and the kubelet, as
# processes of the host (no containers around them), with the host state they make kept
# where `down` finds it again.
#
#   node.sh up            clean up leftovers of an earlier run, start everything, wait until
#                         the node is Ready and pods can be admitted; writes $RUN/env
#   node.sh down          stop every process by PID, remove the host state; also after a
#                         crashed run (it needs nothing but this script and $RUN)
#   node.sh stop NAME     stop one component (kubelet, containerd, ...) by PID
#   node.sh start NAME    start it again
#   node.sh pids          the components and their PIDs
#
# Must run as root. Paths: $RUN (DEVICEHOST_E2E_RUN, default /var/lib/devicehost-e2e) holds
# everything but what the kubelet insists on: its root dir /var/lib/kubelet (the DaemonSet's
# hostPaths name it, and the kubelet's device-plugin dir is always
# /var/lib/kubelet/device-plugins) and the links in /var/log/containers. Logs go to
# $LOGS (DEVICEHOST_E2E_LOGS, default /tmp/devicehost-e2e-logs), which `down` keeps.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/versions.sh"

CACHE="${DEVICEHOST_E2E_CACHE:-/var/cache/devicehost-e2e}"
RUN="${DEVICEHOST_E2E_RUN:-/var/lib/devicehost-e2e}"
LOGS="${DEVICEHOST_E2E_LOGS:-/tmp/devicehost-e2e-logs}"
KUBELET_ROOT=/var/lib/kubelet
NODE_NAME=devicehost-e2e
# The label the GPU Operator gives a GPU node, which the chart's default nodeSelector asks
# for (the node's GPUs are simulated); the suite checks that the DaemonSet selects the node.
NODE_LABELS=nvidia.com/gpu.present=true
CGROUP_NAME=devicehost-e2e # the kubelet's cgroupRoot, in every v1 hierarchy
BRIDGE=dhe2e0
CNI_NET=devicehost-e2e
POD_SUBNET=10.244.77.0/24
# The node's IP: the CNI bridge's gateway address, on a bridge made before the API server
# starts (the kubelet refuses a loopback node IP, and these VMs have no dummy links). The
# API server listens there too, so that pods reach it through the kubernetes Service.
NODE_IP=10.244.77.1
SERVICE_RANGE=10.96.0.0/24
ETCD_PORT=23790
ETCD_PEER_PORT=23800
APISERVER_PORT=16443
KUBELET_PORT=20250
KUBELET_HEALTHZ_PORT=20248
KUBE_PROXY_HEALTHZ_PORT=20256
KUBE_PROXY_METRICS_PORT=20249
IMAGE="localhost/devicehost-e2e/busybox:$PAUSE_VERSION"

BIN_CONTAINERD="$CACHE/containerd-$CONTAINERD_VERSION/bin"
BIN_ETCD="$CACHE/etcd-$ETCD_VERSION/bin"
BIN_K8S="$CACHE/kubernetes-$KUBERNETES_VERSION/bin"
BIN_PAUSE="$CACHE/pause-$PAUSE_VERSION/bin"
BIN_GENERIC_DEVICE_PLUGIN="$CACHE/generic-device-plugin-$GENERIC_DEVICE_PLUGIN_VERSION/bin"
export PATH="$BIN_CONTAINERD:$BIN_K8S:$PATH"

PKI="$RUN/pki"
CONTAINERD_SOCK="$RUN/containerd/containerd.sock"
KUBECONFIG_ADMIN="$RUN/admin.kubeconfig"
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy)

# Logs go to the script's stderr as it started (fd 3), also from commands whose output a
# wait silences.
exec 3>&2
log() { printf '[node %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&3; }
die() { log "FAIL: $*"; exit 1; }
ms() { date +%s%3N; }

# wait_for SECONDS WHAT CMD...: run CMD every 0.2 s until it succeeds, at most SECONDS.
wait_for() {
  local limit=$1 what=$2 deadline
  shift 2
  deadline=$(($(ms) + limit * 1000))
  until "$@" >/dev/null 2>&1; do
    if [ "$(ms)" -gt "$deadline" ]; then
      die "$what: not within ${limit}s (last try: $("$@" 2>&1 | tail -3 | tr '\n' ' '))"
    fi
    sleep 0.2
  done
}

kubectl_admin() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

# ---- processes ------------------------------------------------------------------------

pidfile() { echo "$RUN/pids/$1.pid"; }

# alive NAME: the PID in NAME's pid file, if that process is still the one started (its
# executable is the one recorded next to the PID).
alive() {
  local f pid exe
  f=$(pidfile "$1")
  [ -f "$f" ] || return 1
  read -r pid exe <"$f" || return 1
  [ -n "$pid" ] && [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$exe" ] || return 1
  echo "$pid"
}

# spawn NAME BINARY ARGS...: start a component in its own session, output to its log.
spawn() {
  local name=$1 bin=$2
  shift 2
  mkdir -p "$RUN/pids" "$LOGS"
  printf '\n==== %s start %s\n' "$(date -u +%FT%T)" "$name" >>"$LOGS/$name.log"
  setsid "$bin" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null 3>&- &
  local pid=$!
  # setsid execs the binary in the background child, so $! is its PID; wait until the exec
  # happened so that the pid file names the right executable.
  local i
  for i in $(seq 50); do
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(readlink -f "$bin")" ] && break
    sleep 0.02
  done
  echo "$pid $(readlink -f "$bin")" >"$(pidfile "$name")"
}

# kill_pid PID WHAT [GRACE]: SIGTERM, then SIGKILL after GRACE seconds (default 10).
kill_pid() {
  local pid=$1 what=$2 grace=${3:-10} i
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq $((grace * 10))); do
    kill -0 "$pid" 2>/dev/null || return 0
    # A zombie child of ours counts as gone.
    [ "$(awk '/^State:/ {print $2}' "/proc/$pid/status" 2>/dev/null)" = Z ] && return 0
    sleep 0.1
  done
  log "$what (pid $pid) still running after ${grace}s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
}

stop_component() {
  local name=$1 pid
  if pid=$(alive "$name"); then
    kill_pid "$pid" "$name" 15
  fi
  rm -f "$(pidfile "$name")"
}

# ---- set-up ---------------------------------------------------------------------------

check_binaries() {
  local b
  for b in "$BIN_ETCD/etcd" "$BIN_K8S/kube-apiserver" "$BIN_K8S/kube-controller-manager" \
    "$BIN_K8S/kube-scheduler" "$BIN_K8S/kubelet" "$BIN_K8S/kube-proxy" "$BIN_K8S/kubectl" "$BIN_CONTAINERD/containerd" \
    "$BIN_CONTAINERD/ctr" "$BIN_CONTAINERD/containerd-shim-runc-v2" \
    "$BIN_PAUSE/pause" /usr/sbin/runc /usr/bin/busybox /usr/lib/cni/bridge /usr/lib/cni/host-local \
    /usr/lib/cni/loopback; do
    [ -x "$b" ] || die "$b is missing: run e2e/kubernetes/build.sh"
  done
}

# The kubelet's directories are the real node paths: refuse to touch them when something
# other than this script made them (a real kubelet on this machine).
check_host() {
  [ "$(id -u)" = 0 ] || die "must run as root"
  if [ -e "$KUBELET_ROOT" ] && [ ! -e "$KUBELET_ROOT/.devicehost-e2e" ]; then
    die "$KUBELET_ROOT exists and is not this suite's: is a real kubelet on this machine?"
  fi
  local p
  for p in $(pgrep -x kubelet || true); do
    [ "$(readlink "/proc/$p/exe")" = "$(readlink -f "$BIN_K8S/kubelet")" ] ||
      die "a kubelet this suite did not start runs here (pid $p)"
  done
}

pki() {
  mkdir -p "$PKI"
  cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=devicehost-e2e-ca" \
    -keyout ca.key -out ca.crt 2>/dev/null
  cert() { # cert NAME SUBJECT [SAN]
    openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
    if [ -n "${3:-}" ]; then
      printf 'subjectAltName=%s\n' "$3" >"$1.ext"
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    else
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -out "$1.crt" 2>/dev/null
    fi
  }
  cert apiserver "/CN=kube-apiserver" "IP:$NODE_IP,IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  cert admin "/O=system:masters/CN=devicehost-e2e-admin"
  cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME"
  cert kubelet-serving "/CN=$NODE_NAME" "IP:$NODE_IP,IP:127.0.0.1,DNS:$NODE_NAME,DNS:localhost"
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  cd - >/dev/null
}

kubeconfig() { # kubeconfig FILE CERTNAME
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://$NODE_IP:$APISERVER_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: e2e
  user:
    client-certificate: $PKI/$2.crt
    client-key: $PKI/$2.key
contexts:
- name: e2e
  context: {cluster: e2e, user: e2e}
current-context: e2e
EOF
}

# The image every pod runs, sandbox and workload: busybox-static as /bin/*, and our pause
# as /pause, as an OCI archive made here (no registry).
image_archive() {
  local dir="$RUN/image" rootfs="$RUN/image/rootfs" out="$RUN/image/busybox.oci.tar"
  mkdir -p "$rootfs/bin" "$rootfs/dev" "$rootfs/proc" "$rootfs/sys" "$rootfs/etc" "$rootfs/tmp" \
    "$dir/oci/blobs/sha256"
  cp /usr/bin/busybox "$rootfs/bin/busybox"
  local a
  for a in sh ls cat env sleep echo stat grep test true wc tr sort; do ln -sf busybox "$rootfs/bin/$a"; done
  cp "$BIN_PAUSE/pause" "$rootfs/pause"
  echo "root:x:0:0:root:/:/bin/sh" >"$rootfs/etc/passwd"
  echo "root:x:0:" >"$rootfs/etc/group"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$rootfs" -cf "$dir/layer.tar" .
  local layer layer_size config config_size manifest manifest_size
  layer=$(sha256sum "$dir/layer.tar" | cut -d' ' -f1)
  layer_size=$(stat -c %s "$dir/layer.tar")
  mv "$dir/layer.tar" "$dir/oci/blobs/sha256/$layer"
  printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin"],"Entrypoint":["/pause"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$layer" >"$dir/config.json"
  config=$(sha256sum "$dir/config.json" | cut -d' ' -f1)
  config_size=$(stat -c %s "$dir/config.json")
  mv "$dir/config.json" "$dir/oci/blobs/sha256/$config"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
    "$config" "$config_size" "$layer" "$layer_size" >"$dir/manifest.json"
  manifest=$(sha256sum "$dir/manifest.json" | cut -d' ' -f1)
  manifest_size=$(stat -c %s "$dir/manifest.json")
  mv "$dir/manifest.json" "$dir/oci/blobs/sha256/$manifest"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest" "$manifest_size" "$IMAGE" "${IMAGE##*:}" >"$dir/oci/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$dir/oci/oci-layout"
  tar -C "$dir/oci" -cf "$out" oci-layout index.json blobs
  echo "$out"
}

write_configs() {
  mkdir -p "$RUN/containerd" "$RUN/cni/net.d" "$RUN/cni/ipam" "$RUN/cdi" "$RUN/pod-logs" \
    "$RUN/kubelet"
  cat >"$RUN/containerd/config.toml" <<EOF
version = 3
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$RUN/containerd/containerd.sock.ttrpc"
[debug]
  address = "$RUN/containerd/debug.sock"
[plugins.'io.containerd.cri.v1.runtime']
  # No CAP_SYS_RESOURCE on these VMs: runc may only raise a container's oom_score_adj.
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["$RUN/cdi"]
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$RUN/cni/net.d"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$IMAGE"
[plugins.'io.containerd.grpc.v1.cri']
  # The streaming server (exec, attach) on loopback only.
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
EOF
  # Pods get a route to the Service range through the node (kube-proxy's rules there
  # lead the kubernetes Service to the API server), and no default route.
  cat >"$RUN/cni/net.d/10-$CNI_NET.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "$CNI_NET",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_SUBNET"}]],
        "routes": [{"dst": "$SERVICE_RANGE"}],
        "dataDir": "$RUN/cni/ipam"
      }
    }
  ]
}
EOF
  cat >"$RUN/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
# These VMs run cgroup v1, which kubelet 1.35+ refuses unless told otherwise.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP_NAME
failSwapOn: false
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
tlsCertFile: $PKI/kubelet-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: AlwaysAllow}
podLogsDir: $RUN/pod-logs
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
# A busy shared disk must not evict the suite's pods or taint the node.
evictionHard: {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%", "nodefs.inodesFree": "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 5s
fileCheckFrequency: 5s
nodeStatusUpdateFrequency: 1s
nodeStatusReportFrequency: 10s
serializeImagePulls: false
EOF
  kubeconfig "$KUBECONFIG_ADMIN" admin
  kubeconfig "$RUN/kubelet.kubeconfig" kubelet
}

# Alpha gates the suite needs, on the API server and the scheduler:
# DRADeviceCompatibilityGroups keeps the compatibility groups of a GPU offered both
# time-sliced and in MPS shares in its ResourceSlices, and has the scheduler honour them.
FEATURE_GATES=DRADeviceCompatibilityGroups=true
start_etcd() {
  spawn etcd "$BIN_ETCD/etcd" --name "$NODE_NAME" --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "$NODE_NAME=http://127.0.0.1:$ETCD_PEER_PORT" --unsafe-no-fsync --log-level warn
}
start_kube-apiserver() {
  # On the node's bridge address, which is also the kubernetes Service's endpoint: pods
  # reach it at 10.96.0.1:443 through kube-proxy's rules, as on a real node.
  spawn kube-apiserver "$BIN_K8S/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port "$APISERVER_PORT" \
    --service-cluster-ip-range "$SERVICE_RANGE" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" --authorization-mode Node,RBAC \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --allow-privileged=true --profiling=false --v=1 --feature-gates "$FEATURE_GATES"
}
start_kube-controller-manager() {
  spawn kube-controller-manager "$BIN_K8S/kube-controller-manager" --kubeconfig "$KUBECONFIG_ADMIN" \
    --leader-elect=false --bind-address 127.0.0.1 --secure-port 0 \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
    --use-service-account-credentials=false \
    --node-monitor-period 2s --profiling=false --v=1
}
start_kube-scheduler() {
  spawn kube-scheduler "$BIN_K8S/kube-scheduler" --kubeconfig "$KUBECONFIG_ADMIN" \
    --authentication-kubeconfig "$KUBECONFIG_ADMIN" --authorization-kubeconfig "$KUBECONFIG_ADMIN" \
    --leader-elect=false --bind-address 127.0.0.1 --secure-port 0 --profiling=false --v=1 \
    --feature-gates "$FEATURE_GATES"
}
# kube-proxy in iptables mode: Service IPs (the kubernetes Service, for pods' in-cluster
# clients) as on a real node. The conntrack table is left as the machine has it.
start_kube-proxy() {
  spawn kube-proxy "$BIN_K8S/kube-proxy" --kubeconfig "$KUBECONFIG_ADMIN" \
    --hostname-override "$NODE_NAME" --bind-address "$NODE_IP" --proxy-mode iptables \
    --cluster-cidr "$POD_SUBNET" --conntrack-max-per-core 0 \
    --healthz-bind-address "127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT" \
    --metrics-bind-address "127.0.0.1:$KUBE_PROXY_METRICS_PORT" --profiling=false --v=1
}
start_containerd() {
  spawn containerd "$BIN_CONTAINERD/containerd" --config "$RUN/containerd/config.toml"
}
start_kubelet() {
  spawn kubelet "$BIN_K8S/kubelet" --config "$RUN/kubelet/config.yaml" \
    --kubeconfig "$RUN/kubelet.kubeconfig" --root-dir "$KUBELET_ROOT" \
    --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --node-labels "$NODE_LABELS" --v=2
}

# running NAME CMD...: CMD succeeds; fails the whole script at once if NAME has exited.
running() {
  local name=$1
  shift
  alive "$name" >/dev/null || die "$name exited: $(tail -5 "$LOGS/$name.log")"
  "$@"
}

wait_component() {
  case "$1" in
    etcd) wait_for 30 "etcd healthy" running etcd curl -fsS "http://127.0.0.1:$ETCD_PORT/health" ;;
    kube-apiserver) wait_for 90 "kube-apiserver ready" running kube-apiserver kubectl_admin get --raw /readyz ;;
    containerd) wait_for 30 "containerd serving" running containerd ctr --address "$CONTAINERD_SOCK" version ;;
    kubelet) wait_for 60 "kubelet healthy" running kubelet curl -fsS "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz" ;;
    kube-proxy) wait_for 60 "kube-proxy healthy" running kube-proxy curl -fsS "http://127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT/healthz" ;;
    *) sleep 1 ;;
  esac
  running "$1" true
}

start_one() {
  "start_$1"
  wait_component "$1"
}

service_routed() { iptables -t nat -S KUBE-SERVICES | grep -q 'default/kubernetes:https cluster IP'; }

node_ready() {
  kubectl_admin get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}{" "}{.spec.taints}' |
    grep -qx 'True '
}

up() {
  local t0 t
  t0=$(ms)
  check_binaries
  check_host
  down_all quiet
  mkdir -p "$RUN" "$LOGS" "$KUBELET_ROOT"
  touch "$KUBELET_ROOT/.devicehost-e2e"
  save_iptables
  make_cgroups
  pki
  write_configs
  log "configs in $(($(ms) - t0)) ms"
  ip link add "$BRIDGE" type bridge
  ip addr add "$NODE_IP/${POD_SUBNET#*/}" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local c
  for c in etcd kube-apiserver kube-controller-manager kube-scheduler containerd; do
    t=$(ms)
    start_one "$c"
    log "$c up in $(($(ms) - t)) ms"
  done
  t=$(ms)
  ctr --address "$CONTAINERD_SOCK" -n k8s.io images import --local "$(image_archive)" >/dev/null
  log "image $IMAGE imported in $(($(ms) - t)) ms"
  t=$(ms)
  start_one kubelet
  wait_for 90 "node $NODE_NAME Ready and untainted" node_ready
  wait_for 60 "default service account" kubectl_admin -n default get serviceaccount default
  wait_for 60 "root CA config map" kubectl_admin -n default get configmap kube-root-ca.crt
  log "kubelet up, node Ready in $(($(ms) - t)) ms"
  t=$(ms)
  start_one kube-proxy
  wait_for 60 "kube-proxy's rule for the kubernetes Service" service_routed
  log "kube-proxy up, kubernetes Service routed in $(($(ms) - t)) ms"
  cat >"$RUN/env" <<EOF
KUBECONFIG=$KUBECONFIG_ADMIN
DEVICEHOST_E2E_NODE=$NODE_NAME
DEVICEHOST_E2E_IMAGE=$IMAGE
DEVICEHOST_E2E_RUN=$RUN
DEVICEHOST_E2E_LOGS=$LOGS
DEVICEHOST_E2E_KUBELET_ROOT=$KUBELET_ROOT
DEVICEHOST_E2E_CDI_DIR=$RUN/cdi
DEVICEHOST_E2E_CONTAINERD_SOCK=$CONTAINERD_SOCK
DEVICEHOST_E2E_KUBECTL=$BIN_K8S/kubectl
DEVICEHOST_E2E_CTR=$BIN_CONTAINERD/ctr
DEVICEHOST_E2E_NODE_IP=$NODE_IP
DEVICEHOST_E2E_GENERIC_DEVICE_PLUGIN=$BIN_GENERIC_DEVICE_PLUGIN/generic-device-plugin
GENERIC_DEVICE_PLUGIN_VERSION=$GENERIC_DEVICE_PLUGIN_VERSION
EOF
  log "node up in $(($(ms) - t0)) ms"
}

# ---- tear-down ------------------------------------------------------------------------

# Every chain and rule added to iptables while the node ran is removed at down: the
# kubelet and the CNI plugins add some whatever their settings say.
save_iptables() {
  local ipt
  mkdir -p "$RUN/iptables"
  for ipt in iptables ip6tables; do
    command -v "$ipt-save" >/dev/null || continue
    "$ipt-save" 2>/dev/null | grep -E '^(\*|:|-A)' >"$RUN/iptables/$ipt.before" || true
  done
}
restore_iptables() {
  local ipt table line chain
  for ipt in iptables ip6tables; do
    [ -f "$RUN/iptables/$ipt.before" ] || continue
    table=""
    # Rules first (deleting a rule that jumps to a new chain frees the chain), then chains.
    "$ipt-save" 2>/dev/null | grep -E '^(\*|-A)' | while read -r line; do
      case "$line" in
        \**) table=${line#\*} ;;
        -A*) grep -qxF -- "$line" "$RUN/iptables/$ipt.before" ||
          eval "$ipt -t $table -D ${line#-A }" 2>/dev/null || true ;;
      esac
    done
    "$ipt-save" 2>/dev/null | grep -E '^(\*|:)' | while read -r line; do
      case "$line" in
        \**) table=${line#\*} ;;
        :*)
          chain=${line#:}
          chain=${chain%% *}
          grep -q "^:$chain " "$RUN/iptables/$ipt.before" || "$ipt" -t "$table" -X "$chain" 2>/dev/null || true
          ;;
      esac
    done
  done
}

cgroup_dirs() { ls -d /sys/fs/cgroup/*/"$CGROUP_NAME" 2>/dev/null || true; }
make_cgroups() {
  local h
  for h in /sys/fs/cgroup/*/; do
    [ "$h" = /sys/fs/cgroup/unified/ ] && continue
    mkdir -p "$h$CGROUP_NAME"
    if [ -f "${h}cpuset.cpus" ]; then
      cat "${h}cpuset.cpus" >"$h$CGROUP_NAME/cpuset.cpus"
      cat "${h}cpuset.mems" >"$h$CGROUP_NAME/cpuset.mems"
    fi
  done
}

# Processes of the node that no pid file names: the containerd shims, the containers they
# run (by the kubelet's cgroups), the devicehost processes the tests started (binaries
# under $RUN), anything left over from a crashed run. Never another suite's processes:
# by executable path, this node's binaries only.
stray_pids() {
  local p exe d
  for d in $(cgroup_dirs); do
    find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null || true
  done
  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    # Only this node's binaries: the cache directory may hold other suites' too.
    case "$exe" in
      "$BIN_CONTAINERD"/* | "$BIN_ETCD"/* | "$BIN_K8S"/* | "$BIN_PAUSE"/* | "$RUN"/*)
        echo "${p#/proc/}" ;;
    esac
  done
}

down_all() {
  local quiet=${1:-} t0 c pid
  t0=$(ms)
  [ "$(id -u)" = 0 ] || die "must run as root"
  if [ -e "$KUBELET_ROOT" ] && [ ! -e "$KUBELET_ROOT/.devicehost-e2e" ]; then
    die "$KUBELET_ROOT exists and is not this suite's: not touching it"
  fi
  # The kubelet first (it would start what we stop). The pods' processes are then killed
  # with the rest (stray_pids: the node's cgroups), and what their network leaves is all
  # under $RUN, removed below: containerd's network namespaces (mounted under its state
  # dir), the host-local IPAM's leases (its dataDir), the CNI results; their veths go
  # with the namespaces, and the bridge is deleted by name.
  stop_component kubelet
  stop_component kube-proxy
  for c in containerd kube-scheduler kube-controller-manager kube-apiserver etcd; do
    stop_component "$c"
  done
  local n
  for n in 1 2 3; do
    for pid in $(stray_pids | sort -u); do
      [ "$pid" = $$ ] && continue
      kill -KILL "$pid" 2>/dev/null || true
    done
    [ -z "$(stray_pids)" ] && break
    sleep 0.5
  done
  # Mounts under the node's directories, deepest first.
  local m
  for n in 1 2 3; do
    m=$(awk -v a="$RUN" -v b="$KUBELET_ROOT" '$5 == a || index($5, a "/") == 1 || $5 == b || index($5, b "/") == 1 {print $5}' /proc/self/mountinfo | sort -r)
    [ -z "$m" ] && break
    for pid in $m; do umount "$pid" 2>/dev/null || umount -l "$pid" 2>/dev/null || true; done
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  [ -d "$RUN/iptables" ] && restore_iptables
  local d
  for d in $(cgroup_dirs); do
    find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  # The CNI library's cache of results for this network, and the kubelet's log links.
  rm -rf /var/lib/cni/results/"$CNI_NET"-* 2>/dev/null || true
  rmdir /var/lib/cni/results /var/lib/cni 2>/dev/null || true
  if [ -d /var/log/containers ]; then
    find /var/log/containers -maxdepth 1 -type l -lname "$RUN/*" -delete
    rmdir /var/log/containers 2>/dev/null || true
  fi
  rm -rf "$KUBELET_ROOT" "$RUN"
  local left
  left=$(cgroup_dirs)
  [ -z "$left" ] || log "cgroups left: $left"
  [ -n "$quiet" ] || log "node down in $(($(ms) - t0)) ms"
}

cmd=${1:-}
case "$cmd" in
  up) up ;;
  down) down_all ;;
  stop) stop_component "${2:?component}" ;;
  start)
    [ -f "$RUN/env" ] || die "the node is not up"
    alive "${2:?component}" >/dev/null && die "$2 is running"
    t=$(ms)
    start_one "$2"
    log "$2 up in $(($(ms) - t)) ms"
    ;;
  pids)
    for c in "${COMPONENTS[@]}"; do printf '%s %s\n' "$c" "$(alive "$c" || echo -)"; done
    ;;
  *) echo "usage: $0 up|down|stop NAME|start NAME|pids" >&2; exit 2 ;;
esac
