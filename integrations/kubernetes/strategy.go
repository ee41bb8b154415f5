package kubernetes

import (
	"fmt"
	"strings"
)

// DefaultDeviceListStrategy is the device-list strategy of a zero Config: both lists.
const DefaultDeviceListStrategy = "envvar,cdi-cri"

// DeviceListStrategy says how an Allocate answer lists a container's devices, as
// NVIDIA's device plugin names its strategies. Mounts and device nodes the plugin
// gives are passed in every strategy.
//
//   - EnvVar ("envvar"): the plugin's env vars (NVIDIA_VISIBLE_DEVICES with the GPUs'
//     UUIDs), for a runtime that injects devices from them (the NVIDIA Container
//     Toolkit's runtime).
//   - CDI ("cdi-cri"): the plugin's CDI device names in the answer's CDIDevices, which
//     the kubelet hands to the container runtime through the CRI; a runtime with CDI on
//     (containerd 2's default) injects the device nodes from the plugin's CDI spec.
//
// Both (the default) give a container a coherent view with CDI on or off: the env
// names the GPUs whose nodes it has, as the plugins' CDI specs leave the env alone.
type DeviceListStrategy struct {
	EnvVar bool
	CDI    bool
}

// ParseDeviceListStrategy reads a comma-separated list of "envvar" and "cdi-cri".
func ParseDeviceListStrategy(s string) (DeviceListStrategy, error) {
	var d DeviceListStrategy
	for _, part := range strings.Split(s, ",") {
		switch strings.TrimSpace(part) {
		case "envvar":
			d.EnvVar = true
		case "cdi-cri":
			d.CDI = true
		default:
			return DeviceListStrategy{}, fmt.Errorf("device-list strategy %q: want envvar, cdi-cri or both, comma-separated (%q)", s, DefaultDeviceListStrategy)
		}
	}
	return d, nil
}

// String is the strategy as ParseDeviceListStrategy reads it ("" for none).
func (d DeviceListStrategy) String() string {
	var parts []string
	if d.EnvVar {
		parts = append(parts, "envvar")
	}
	if d.CDI {
		parts = append(parts, "cdi-cri")
	}
	return strings.Join(parts, ",")
}
