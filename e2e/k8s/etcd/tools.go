//go:build tools

// Package tools pins the etcd server command the e2e harness builds. The
// builder (python -m e2e.build) copies this file next to a generated go.mod
// that requires go.etcd.io/etcd/server/v3 at the version the selected
// Kubernetes release pins.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
)
