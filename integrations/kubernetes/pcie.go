package kubernetes

import (
	"path/filepath"
	"strings"
	"sync"
)

// SysfsPCIeRoot returns a function that finds the PCIe root port a PCI device hangs
// off, from its bus ID ("0000:1b:00.0", as the agent reports it) and the sysfs tree at
// sysfs (normally "/sys"): /sys/bus/pci/devices/<bus ID> links to the device's path
// under /sys/devices, e.g. .../pci0000:17/0000:17:01.0/0000:18:00.0/0000:1b:00.0, whose
// first two parts (host bridge and root port) name the root. Devices behind the same
// root port share a PCIe switch or link, so peer-to-peer traffic between them stays off
// the CPU's interconnect. The function returns "" when it cannot tell (no sysfs, an
// unknown or malformed bus ID); it caches what it found and is safe for concurrent use.
func SysfsPCIeRoot(sysfs string) func(busID string) string {
	var mu sync.Mutex
	cache := map[string]string{}
	return func(busID string) string {
		if busID == "" || strings.ContainsAny(busID, "/\x00") || busID == "." || busID == ".." {
			return ""
		}
		mu.Lock()
		defer mu.Unlock()
		if root, ok := cache[busID]; ok {
			return root
		}
		root := ""
		if p, err := filepath.EvalSymlinks(filepath.Join(sysfs, "bus", "pci", "devices", busID)); err == nil {
			root = rootOfDevicePath(filepath.Join(sysfs, "devices"), p)
		}
		if len(cache) < 4096 {
			cache[busID] = root
		}
		return root
	}
}

// rootOfDevicePath returns "pciDDDD:BB/<root port>" of a device path under devicesDir,
// or "" when path is not below a host bridge there.
func rootOfDevicePath(devicesDir, path string) string {
	rel, err := filepath.Rel(devicesDir, path)
	if err != nil || strings.HasPrefix(rel, "..") {
		return ""
	}
	parts := strings.Split(rel, string(filepath.Separator))
	if len(parts) < 2 || !strings.HasPrefix(parts[0], "pci") {
		return ""
	}
	// parts[1] is the root port, or the device itself when it sits on the host
	// bridge (then it is its own root).
	return parts[0] + "/" + parts[1]
}
