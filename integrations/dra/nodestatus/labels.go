// Package nodestatus turns the devicehost agent's inventory into what a node tells the
// cluster: labels in the names and value formats of NVIDIA's GPU Feature Discovery (so
// nodeSelectors written for it keep working) with devicehost.io/ labels for the rest,
// and a node condition saying whether every device is healthy. Publisher writes both to
// the node with server-side apply, as one field manager, so what it stops saying is
// removed and nothing another writer owns is touched.
package nodestatus

import (
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Label prefixes: GFD's for NVIDIA GPUs, devicehost's own for the rest.
const (
	NVIDIAPrefix     = "nvidia.com/"
	DevicehostPrefix = "devicehost.io/"
)

// MaxTypeLabels bounds the devicehost.io/<vendor>.<type>.count labels: a plugin that
// reports many device types cannot grow the node object without end.
const MaxTypeLabels = 64

// The NVIDIA groups the nvidia-example plugin reports (vendor "nvidia"): whole GPUs,
// time-sliced replicas, MPS shares, and MIG devices (or placements) by profile.
const (
	vendorNVIDIA  = "nvidia"
	typeGPU       = "gpu"
	typeGPUShared = "gpu.shared"
	typeGPUMPS    = "gpu.mps"
	typeMIG       = "mig"
)

// Labels returns the node labels fp gives. machine is the node's machine type (the DMI
// product name; "" leaves nvidia.com/gpu.machine out). Values are valid label values:
// a value that cannot be made one (empty after cleaning) leaves its label out.
func Labels(fp *pb.FingerprintResponse, machine string) map[string]string {
	out := make(map[string]string)
	set := func(key, value string) {
		if v := labelValue(value); v != "" {
			out[key] = v
		}
	}
	counts := make(map[string]int) // devicehost.io/<vendor>.<type>.count
	var gpus, migs []*pb.DeviceGroup
	gpuCount, replicas, mpsShares := 0, 0, 0
	for _, g := range fp.GetGroups() {
		if n := len(g.GetDevices()); n > 0 {
			counts[g.GetVendor()+"."+g.GetType()] += n
		}
		if g.GetVendor() != vendorNVIDIA {
			continue
		}
		switch g.GetType() {
		case typeGPU:
			gpus = append(gpus, g)
			gpuCount += len(g.GetDevices())
		case typeGPUShared:
			replicas = max(replicas, int(intAttr(g, "replicas")))
		case typeGPUMPS:
			mpsShares = max(mpsShares, int(intAttr(g, "mps_shares")))
		case typeMIG:
			if !strings.HasSuffix(g.GetName(), ".mps") {
				migs = append(migs, g)
			}
		}
	}
	// GFD describes the node by its first GPU; devicehost takes the group of the lowest
	// name, so the labels do not depend on the order groups come in.
	slices.SortFunc(gpus, func(a, b *pb.DeviceGroup) int { return strings.Compare(a.GetName(), b.GetName()) })
	if len(gpus) > 0 {
		g := gpus[0]
		set(NVIDIAPrefix+"gpu.count", strconv.Itoa(gpuCount))
		set(NVIDIAPrefix+"gpu.product", g.GetName())
		if mem := intAttr(g, "memory"); mem > 0 {
			set(NVIDIAPrefix+"gpu.memory", strconv.FormatInt(mem, 10))
		}
		if major, minor, ok := version2(stringAttr(g, "compute_capability")); ok {
			set(NVIDIAPrefix+"gpu.compute.major", major)
			set(NVIDIAPrefix+"gpu.compute.minor", minor)
			set(NVIDIAPrefix+"gpu.family", family(major, minor))
		}
		if v := strings.Split(stringAttr(g, "driver_version"), "."); len(v) == 3 && allDigits(v) {
			set(NVIDIAPrefix+"cuda.driver.major", v[0])
			set(NVIDIAPrefix+"cuda.driver.minor", v[1])
			set(NVIDIAPrefix+"cuda.driver.rev", v[2])
			set(NVIDIAPrefix+"cuda.driver-version.major", v[0])
			set(NVIDIAPrefix+"cuda.driver-version.minor", v[1])
			set(NVIDIAPrefix+"cuda.driver-version.revision", v[2])
			set(NVIDIAPrefix+"cuda.driver-version.full", strings.Join(v, "."))
		}
		if major, minor, ok := version2(stringAttr(g, "cuda_version")); ok {
			set(NVIDIAPrefix+"cuda.runtime.major", major)
			set(NVIDIAPrefix+"cuda.runtime.minor", minor)
			set(NVIDIAPrefix+"cuda.runtime-version.major", major)
			set(NVIDIAPrefix+"cuda.runtime-version.minor", minor)
			set(NVIDIAPrefix+"cuda.runtime-version.full", major+"."+minor)
		}
		if capable, ok := boolAttr(g, "mig_capable"); ok {
			set(NVIDIAPrefix+"mig.capable", strconv.FormatBool(capable))
		}
		set(NVIDIAPrefix+"gpu.machine", machine)
		set(NVIDIAPrefix+"gpu.replicas", strconv.Itoa(max(replicas, 1)))
		set(NVIDIAPrefix+"mps.capable", strconv.FormatBool(mpsShares > 0))
		// GFD has one value for the node; a node offering both modes (each GPU serving
		// the mode its first holder chose) has none of GFD's, so the label is left out
		// and the devicehost.io/gpu.sharing.* labels say it.
		switch {
		case replicas > 0 && mpsShares > 0:
		case replicas > 0:
			set(NVIDIAPrefix+"gpu.sharing-strategy", "time-slicing")
		case mpsShares > 0:
			set(NVIDIAPrefix+"gpu.sharing-strategy", "mps")
		default:
			set(NVIDIAPrefix+"gpu.sharing-strategy", "none")
		}
		if replicas > 0 {
			set(DevicehostPrefix+"gpu.sharing.time-slicing", "true")
		}
		if mpsShares > 0 {
			set(DevicehostPrefix+"gpu.sharing.mps", "true")
		}
	}
	if len(gpus) > 0 || len(migs) > 0 {
		// MIG devices are served per profile, each a resource or device of its own:
		// GFD's "mixed" strategy and its nvidia.com/mig-<profile>.* labels.
		strategy := "none"
		if len(migs) > 0 {
			strategy = "mixed"
		}
		set(NVIDIAPrefix+"mig.strategy", strategy)
	}
	migCount := make(map[string]int)
	for _, g := range migs {
		prefix := NVIDIAPrefix + "mig-" + strings.ReplaceAll(g.GetName(), "+", ".")
		if !validKey(prefix + ".count") {
			continue
		}
		migCount[prefix] += len(g.GetDevices())
		set(prefix+".count", strconv.Itoa(migCount[prefix]))
		if mem := intAttr(g, "memory"); mem > 0 {
			set(prefix+".memory", strconv.FormatInt(mem, 10))
		}
		if sm := intAttr(g, "multiprocessors"); sm > 0 {
			set(prefix+".multiprocessors", strconv.FormatInt(sm, 10))
		}
		if s := intAttr(g, "compute_slices"); s > 0 {
			// A MIG device of one profile is one GPU instance with one compute instance
			// of all its slices.
			set(prefix+".slices.gi", strconv.FormatInt(s, 10))
			set(prefix+".slices.ci", strconv.FormatInt(s, 10))
		}
	}
	n := 0
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		key := DevicehostPrefix + k + ".count"
		if !validKey(key) {
			continue
		}
		if n == MaxTypeLabels {
			break
		}
		n++
		set(key, strconv.Itoa(counts[k]))
	}
	return out
}

// family is GFD's architecture family of a compute capability.
func family(major, minor string) string {
	mi, _ := strconv.Atoi(minor)
	switch major {
	case "1":
		return "tesla"
	case "2":
		return "fermi"
	case "3":
		return "kepler"
	case "5":
		return "maxwell"
	case "6":
		return "pascal"
	case "7":
		if mi >= 5 {
			return "turing"
		}
		return "volta"
	case "8":
		if mi >= 9 {
			return "ada-lovelace"
		}
		return "ampere"
	case "9":
		return "hopper"
	case "10", "12":
		return "blackwell"
	}
	return "undefined"
}

// version2 splits "MAJOR.MINOR" of digits.
func version2(s string) (major, minor string, ok bool) {
	major, minor, ok = strings.Cut(s, ".")
	return major, minor, ok && allDigits([]string{major, minor})
}

func allDigits(parts []string) bool {
	for _, p := range parts {
		if p == "" || strings.Trim(p, "0123456789") != "" {
			return false
		}
	}
	return true
}

func intAttr(g *pb.DeviceGroup, name string) int64 { return g.GetAttributes()[name].GetIntValue() }

func stringAttr(g *pb.DeviceGroup, name string) string {
	return g.GetAttributes()[name].GetStringValue()
}

func boolAttr(g *pb.DeviceGroup, name string) (value, ok bool) {
	v, ok := g.GetAttributes()[name].GetKind().(*pb.Value_BoolValue)
	if !ok {
		return false, false
	}
	return v.BoolValue, true
}

var (
	invalidValueChars = regexp.MustCompile(`[^A-Za-z0-9._-]+`)
	keyName           = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$`)
)

// labelValue makes s a label value as GFD does for product names (spaces become
// dashes), with any other character a label value cannot hold a dash too, and the ends
// trimmed to alphanumerics, at most 63 characters.
func labelValue(s string) string {
	s = invalidValueChars.ReplaceAllString(strings.TrimSpace(s), "-")
	if len(s) > 63 {
		s = s[:63]
	}
	return strings.TrimFunc(s, func(r rune) bool {
		return !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9')
	})
}

// validKey reports whether key (PREFIX/NAME) has a name a label key may have.
func validKey(key string) bool {
	_, name, _ := strings.Cut(key, "/")
	return keyName.MatchString(name)
}
