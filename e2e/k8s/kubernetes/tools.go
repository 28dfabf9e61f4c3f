//go:build tools

// Package tools pins the Kubernetes commands (control plane and kubelet) the e2e harness
// builds. The builder (python -m e2e.build) copies this file next to a
// generated go.mod that requires k8s.io/kubernetes at the selected version
// and replaces every staging module with its published v0.Y.Z release.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
