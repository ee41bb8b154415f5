//go:build !linux

package pluginloader

import (
	"os"
	"os/exec"
)

// setProcAttrs does nothing off Linux: there is no parent-death signal there, so a
// plugin outlives a host that was killed, and the plugin shares the host's process
// group, so a kill reaches the plugin's process only.
func setProcAttrs(cmd *exec.Cmd, surviveHost bool) {}

// killReattached SIGKILLs a reattached plugin.
func killReattached(pid int) {
	if proc, err := os.FindProcess(pid); err == nil {
		_ = proc.Kill()
		_ = proc.Release()
	}
}
