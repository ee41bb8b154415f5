//go:build !linux

package pluginloader

import "os/exec"

// setProcAttrs does nothing off Linux: there is no parent-death signal there, so a
// plugin outlives a host that was killed.
func setProcAttrs(cmd *exec.Cmd, surviveHost bool) {}
