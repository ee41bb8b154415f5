// Package kubernetes holds the suite that runs devicehost on a real single-node Kubernetes:
// etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd and the kubelet,
// built from source by build.sh and run on this machine by node.sh, with the agent and the
// kubelet bridge started as the DaemonSet in deploy/kubernetes/devicehost.yaml starts
// them. The package has no code outside its tests; see docs/kubernetes.md for how to run
// the suite.
package kubernetes
