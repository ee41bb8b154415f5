# Pinned versions of the e2e node's components (sourced by build.sh and node.sh).
CONTAINERD_VERSION=v2.2.9
KUBERNETES_VERSION=v1.37.2
# The etcd that k8s.io/kubernetes v1.37.2's go.mod pins (go.etcd.io/etcd/server/v3).
ETCD_VERSION=v3.7.0
# helm, for the chart in deploy/helm (built from its Go module, as the rest).
HELM_VERSION=v4.3.1
# Our own pause program: its version is its source's hash, so a change rebuilds it.
PAUSE_VERSION=$(sha256sum "$(dirname "${BASH_SOURCE[0]}")/pause/main.go" | cut -c1-12)
# An unmodified kubelet device plugin hosted under devicehost (its newest commit the Go
# module proxy serves; the project tags no release there).
GENERIC_DEVICE_PLUGIN_VERSION=v0.0.0-20260515115838-2cc50b05d4d2
