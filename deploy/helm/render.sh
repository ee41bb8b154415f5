#!/usr/bin/env bash
# Renders the plain manifests of deploy/kubernetes/ from the chart in deploy/helm/devicehost,
# one file per way of installing it, after `helm lint` of each mode:
#   devicehost.yaml       mode=devicePlugin: ConfigMap + DaemonSet (agent, kubelet bridge)
#   dra.yaml              the DRA objects of the cluster: DeviceClasses, ServiceAccount, RBAC
#   devicehost-dra.yaml   mode=dra: ConfigMap + DaemonSet (agent, DRA driver); with dra.yaml
#   devicehost-both.yaml  mode=both: ConfigMap + DaemonSet (all three); with dra.yaml
#
#   deploy/helm/render.sh          write them
#   deploy/helm/render.sh -check   fail if the committed files differ from a fresh render (CI)
#
# helm is $HELM, or v4 built from its Go module by e2e/kubernetes/build.sh and cached by
# version outside the clone (${DEVICEHOST_E2E_CACHE:-/var/cache/devicehost-e2e}/helm-<version>).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
chart="$root/deploy/helm/devicehost"
out="$root/deploy/kubernetes"
check=false
case "${1:-}" in
  "") ;;
  -check) check=true ;;
  *) echo "usage: $0 [-check]" >&2; exit 2 ;;
esac

source "$root/e2e/kubernetes/versions.sh"
if [ -z "${HELM:-}" ]; then
  bash "$root/e2e/kubernetes/build.sh" helm
  HELM="${DEVICEHOST_E2E_CACHE:-/var/cache/devicehost-e2e}/helm-$HELM_VERSION/bin/helm"
fi
"$HELM" version --short

for mode in devicePlugin dra both; do
  "$HELM" lint --strict --quiet "$chart" --set mode="$mode" --kube-version "$KUBERNETES_VERSION"
done
# A bad mode is refused with the value named (the schema's enum).
if bad=$("$HELM" template devicehost "$chart" --set mode=nvidia 2>&1); then
  echo "helm template accepted mode=nvidia" >&2; exit 1
fi
grep -q "mode" <<<"$bad" || { echo "helm template's error for mode=nvidia does not name mode: $bad" >&2; exit 1; }
# In mode both, DRA's extended resource may not be a name the kubelet bridge serves.
if bad=$("$HELM" template devicehost "$chart" --set mode=both --set dra.extendedResourceName=nvidia.com/gpu 2>&1); then
  echo "helm template accepted mode=both with dra.extendedResourceName=nvidia.com/gpu, the bridge's resource" >&2; exit 1
fi
grep -q 'dra.extendedResourceName "nvidia.com/gpu": in mode both the kubelet bridge serves nvidia.com/gpu' <<<"$bad" ||
  { echo "helm template's error for the conflicting extended resource does not say so: $bad" >&2; exit 1; }
"$HELM" template devicehost "$chart" --set mode=both --set dra.extendedResourceName=devicehost.io/gpu >/dev/null

# Metrics off loopback need the agent's TLS Secret, a ServiceMonitor the scraper's: each
# refused naming the value.
if bad=$("$HELM" template devicehost "$chart" --set metrics.enabled=true 2>&1); then
  echo "helm template accepted metrics.enabled without metrics.tls.secretName" >&2; exit 1
fi
grep -q "metrics.enabled needs metrics.tls.secretName" <<<"$bad" || { echo "helm template's error for metrics without TLS does not say so: $bad" >&2; exit 1; }
if bad=$("$HELM" template devicehost "$chart" --set metrics.enabled=true --set metrics.tls.secretName=s --set metrics.serviceMonitor.enabled=true 2>&1); then
  echo "helm template accepted a ServiceMonitor without metrics.serviceMonitor.clientSecretName" >&2; exit 1
fi
grep -q "needs metrics.serviceMonitor.clientSecretName" <<<"$bad" || { echo "helm template's error for the ServiceMonitor does not say so: $bad" >&2; exit 1; }
"$HELM" template devicehost "$chart" --set metrics.enabled=true --set metrics.tls.secretName=s \
  --set metrics.serviceMonitor.enabled=true --set metrics.serviceMonitor.clientSecretName=c | grep -q "kind: ServiceMonitor"
# The real node's example values lint.
"$HELM" lint --strict --quiet "$chart" -f "$root/deploy/helm/real-node-values.yaml" --kube-version "$KUBERNETES_VERSION"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# tidy drops helm template's "# Source:" lines, its first "---", trailing blanks (the
# indentation nindent gives empty lines), and the empty lines before a "---" or the end.
tidy() {
  awk '
    /^# Source: / { next }
    NR == 1 && /^---$/ { next }
    { sub(/[ \t]+$/, "") }
    /^$/ { blank++; next }
    /^---$/ { blank = 0 }
    { while (blank > 0) { print ""; blank-- } print }
  '
}

# render FILE HEADER HELM-ARGS... writes FILE under $tmp: the header, then helm template's
# documents, tidied.
render() {
  local file=$1 header=$2
  shift 2
  {
    printf '%s\n' "$header"
    echo "# Generated from deploy/helm/devicehost by deploy/helm/render.sh: edit the chart, not this file."
    "$HELM" template devicehost "$chart" --namespace kube-system --kube-version "$KUBERNETES_VERSION" --no-hooks "$@" | tidy
  } >"$tmp/$file"
}

render devicehost.yaml "# devicehost on every GPU node of a Kubernetes cluster: one pod per node with two
# containers, the agent (which runs the device plugins and owns the reservation ledger)
# and the kubelet bridge (\`devicehost kubelet-plugin\`, which serves the agent's devices
# to the kubelet as nvidia.com/gpu). The bridge reaches the agent through a socket of its
# own under the node's /run/devicehost, which lets it reserve for pods only; the CLI uses
# the admin socket there, monitoring the read-only one (docs/configuration.md, \"Access\").
#
#   docker build -t devicehost:latest .        # then push it where your nodes pull from
#   kubectl apply -f deploy/kubernetes/devicehost.yaml
#   kubectl apply -f deploy/kubernetes/example-pod.yaml
#
# The bundled nvidia-example plugin reads the GPUs through NVML: the node needs the
# NVIDIA driver, and the agent container the driver's libnvidia-ml (with the NVIDIA
# container toolkit, runtimeClassName: nvidia below provides it). The pod runs on the
# nodes labelled nvidia.com/gpu.present=true (the GPU Operator sets it; else
# kubectl label node NODE nvidia.com/gpu.present=true). Step by step: docs/kubernetes.md.
#
# Or with Helm: helm install devicehost deploy/helm/devicehost -n kube-system
# (--set mode=dra or mode=both for the DRA driver; see docs/kubernetes.md)."

render dra.yaml "# devicehost as a Kubernetes DRA driver (driver name devicehost.io): the device classes
# that select its devices, and the RBAC its devicehost-dra-plugin container needs. Apply it
# with devicehost-dra.yaml (the agent and the driver) or devicehost-both.yaml (the agent,
# the driver and the kubelet bridge); see docs/kubernetes.md. Its gpu.devicehost.io serves
# no extended resource, since with devicehost-both.yaml the bridge serves nvidia.com/gpu;
# with devicehost-dra.yaml add extendedResourceName: nvidia.com/gpu to its spec, as Helm's
# mode=dra does, so unchanged pods asking for nvidia.com/gpu get GPUs through DRA." \
  --set mode=dra --set dra.extendedResourceName= --show-only templates/deviceclasses.yaml --show-only templates/rbac.yaml

render devicehost-dra.yaml "# devicehost with the DRA driver on every GPU node: one pod per node with the agent and
# devicehost-dra-plugin (driver devicehost.io), which reaches the agent through a socket
# of its own that lets it reserve for claims only.
#
#   kubectl apply -f deploy/kubernetes/dra.yaml -f deploy/kubernetes/devicehost-dra.yaml
#   kubectl apply -f deploy/kubernetes/example-dra-pod.yaml" \
  --set mode=dra --show-only templates/configmap.yaml --show-only templates/daemonset.yaml

render devicehost-both.yaml "# devicehost with both Kubernetes paths on every GPU node: the agent, the kubelet bridge
# (nvidia.com/gpu) and the DRA driver (devicehost.io) in one pod, on one agent, so a
# device held through one is never handed out through the other.
#
#   kubectl apply -f deploy/kubernetes/dra.yaml -f deploy/kubernetes/devicehost-both.yaml" \
  --set mode=both --show-only templates/configmap.yaml --show-only templates/daemonset.yaml

files=(devicehost.yaml dra.yaml devicehost-dra.yaml devicehost-both.yaml)
if ! $check; then
  for f in "${files[@]}"; do cp "$tmp/$f" "$out/$f"; done
  echo "rendered ${files[*]} into deploy/kubernetes"
  exit 0
fi
stale=()
for f in "${files[@]}"; do
  if ! diff -u "$out/$f" "$tmp/$f" >&2; then stale+=("$f"); fi
done
if [ ${#stale[@]} -gt 0 ]; then
  echo "deploy/kubernetes/{${stale[*]}} differ from the chart's render: run deploy/helm/render.sh and commit the result" >&2
  exit 1
fi
echo "deploy/kubernetes matches the chart (${files[*]})"
