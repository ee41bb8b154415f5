//go:build !linux

package adapter

import "os/exec"

// setProcAttrs does nothing off Linux: there is no parent-death signal.
func setProcAttrs(*exec.Cmd) {}
