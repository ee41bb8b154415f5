//go:build !linux

package pluginloader

import "os/exec"

// tieToHost does nothing off Linux: there is no parent-death signal, and a plugin
// outlives a host that was killed.
func tieToHost(cmd *exec.Cmd) {}
