package validate

import (
	"fmt"
	"path"
	"slices"
	"strings"
	"unicode/utf8"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// reservation is Reservation's body; see its doc comment for the rules.
func reservation(res *pb.ContainerReservation, requested []string) error {
	var c collector
	if res == nil {
		c.add("reservation", RuleMissing, "")
		return c.err()
	}
	c.checkEnvs(res.GetEnvs())

	mounts := res.GetMounts()
	if len(mounts) > MaxMounts {
		c.add("mounts", RuleTooMany, tooMany(len(mounts), MaxMounts))
		mounts = mounts[:MaxMounts]
	}
	for i, m := range mounts {
		if m != nil && pathOK(m.GetHostPath()) && pathOK(m.GetContainerPath()) {
			continue
		}
		item := fmt.Sprintf("mount[%d]", i)
		if m == nil {
			c.add(item, RuleMissing, "")
			continue
		}
		c.checkPath(at(item, "host_path"), m.GetHostPath())
		c.checkPath(at(item, "container_path"), m.GetContainerPath())
	}

	devs := res.GetDevices()
	if len(devs) > MaxDeviceNodes {
		c.add("devices", RuleTooMany, tooMany(len(devs), MaxDeviceNodes))
		devs = devs[:MaxDeviceNodes]
	}
	for i, d := range devs {
		if d != nil && pathOK(d.GetHostPath()) && pathOK(d.GetContainerPath()) && validPermissions(d.GetPermissions()) {
			continue
		}
		item := fmt.Sprintf("device[%d]", i)
		if d == nil {
			c.add(item, RuleMissing, "")
			continue
		}
		c.checkPath(at(item, "host_path"), d.GetHostPath())
		c.checkPath(at(item, "container_path"), d.GetContainerPath())
		if p := d.GetPermissions(); p == "" {
			c.add(at(item, "permissions"), RuleEmpty, "")
		} else if !validPermissions(p) {
			c.add(at(item, "permissions"), RulePermissions, q(p)+", want a subset of \"rwm\" without repeats")
		}
	}

	cdi := res.GetCdiDevices()
	if len(cdi) > MaxCDIDevices {
		c.add("cdi_devices", RuleTooMany, tooMany(len(cdi), MaxCDIDevices))
		cdi = cdi[:MaxCDIDevices]
	}
	for i, name := range cdi {
		if name != "" && len(name) <= MaxNameLen {
			if dev, why := parseCDIName(name); why == "" && slices.Contains(requested, dev) {
				continue
			}
		}
		item := fmt.Sprintf("cdi_device[%d] %s", i, q(name))
		if name == "" {
			c.add(item, RuleEmpty, "")
			continue
		}
		if len(name) > MaxNameLen {
			c.add(item, RuleTooLong, tooLong(len(name), MaxNameLen))
			continue
		}
		dev, why := parseCDIName(name)
		if why != "" {
			c.add(item, RuleCDIName, why)
			continue
		}
		if !slices.Contains(requested, dev) {
			c.add(item, RuleNotRequested, "device "+q(dev))
		}
	}
	return c.err()
}

// checkEnvs checks env names and values, visiting names sorted.
func (c *collector) checkEnvs(envs map[string]string) {
	if len(envs) <= MaxEnvs && allEnvsOK(envs) {
		return
	}
	names := make([]string, 0, len(envs))
	for n := range envs {
		names = append(names, n)
	}
	slices.Sort(names)
	if len(names) > MaxEnvs {
		c.add("envs", RuleTooMany, tooMany(len(names), MaxEnvs))
		names = names[:MaxEnvs]
	}
	for _, n := range names {
		item := "env " + q(n)
		switch {
		case n == "":
			c.add(item, RuleEmpty, "")
		case len(n) > MaxNameLen:
			c.add(item, RuleTooLong, tooLong(len(n), MaxNameLen))
		case !validEnvName(n):
			c.add(item, RuleEnvName, "want [A-Za-z_][A-Za-z0-9_]*")
		case EnvDenied(n):
			c.add(item, RuleEnvDenied, "")
		}
		v := envs[n]
		c.checkText(at(item, "value"), v, MaxEnvValueLen)
		if strings.IndexByte(v, 0) >= 0 {
			c.add(at(item, "value"), RuleNUL, "")
		}
	}
}

// The fast paths of a valid answer: whether the full check (checkEnvs, checkPath) would
// find nothing. Most answers are valid, and the full checks build a name for every
// item they look at, which cost more than the checks themselves on every Reserve.

// allEnvsOK reports whether checkEnvs would find nothing wrong with any of envs.
func allEnvsOK(envs map[string]string) bool {
	for n, v := range envs {
		if len(n) > MaxNameLen || !validEnvName(n) || EnvDenied(n) ||
			len(v) > MaxEnvValueLen || !utf8.ValidString(v) || strings.IndexByte(v, 0) >= 0 {
			return false
		}
	}
	return true
}

// pathOK reports whether checkPath would find nothing wrong with p. A clean absolute
// path has no ".." element.
func pathOK(p string) bool {
	return p != "" && len(p) <= MaxPathLen && utf8.ValidString(p) && strings.IndexByte(p, 0) < 0 &&
		path.IsAbs(p) && path.Clean(p) == p
}

// checkPath checks a host or container path: non-empty, bounded, valid UTF-8, no NUL,
// absolute, no ".." element, and clean. Paths are Linux paths, so this uses package path
// (forward slashes) on every OS.
func (c *collector) checkPath(item, p string) {
	if p == "" {
		c.add(item, RuleEmpty, "")
		return
	}
	item += " " + q(p)
	if len(p) > MaxPathLen {
		c.add(item, RuleTooLong, tooLong(len(p), MaxPathLen))
	}
	if !utf8.ValidString(p) {
		c.add(item, RuleInvalidUTF8, "")
	}
	if strings.IndexByte(p, 0) >= 0 {
		c.add(item, RuleNUL, "")
	}
	if !path.IsAbs(p) {
		c.add(item, RuleNotAbsolute, "")
	}
	// A ".." element is reported as such; a path without one that Clean still changes
	// ("/a//b", "/a/./b", "/a/") is reported as not clean.
	if slices.Contains(strings.Split(p, "/"), "..") {
		c.add(item, RuleDotDot, "")
	} else if path.Clean(p) != p {
		c.add(item, RuleNotClean, "want "+q(path.Clean(p)))
	}
}

// validPermissions reports whether p is a non-empty subset of "rwm" with no repeats.
func validPermissions(p string) bool {
	if p == "" || len(p) > 3 {
		return false
	}
	var seen [3]bool
	for i := 0; i < len(p); i++ {
		j := strings.IndexByte("rwm", p[i])
		if j < 0 || seen[j] {
			return false
		}
		seen[j] = true
	}
	return true
}

// parseCDIName splits a fully-qualified CDI device name "vendor.tld/class=name" and
// returns its name part, or why it is malformed. Following the CDI spec: the vendor is a
// domain-like name (here it must contain a dot) that starts with a letter, ends with a
// letter or digit, and has only letters, digits and "-_."; the class starts with a
// letter, ends with a letter or digit, and has only letters, digits and "-_"; the name
// starts and ends with a letter or digit and has only letters, digits and "-_.:".
// Letters are ASCII.
func parseCDIName(s string) (name, why string) {
	kind, name, ok := strings.Cut(s, "=")
	if !ok {
		return "", "no \"=\"; want vendor.tld/class=name"
	}
	vendor, class, ok := strings.Cut(kind, "/")
	if !ok {
		return "", "no \"/\"; want vendor.tld/class=name"
	}
	if !strings.Contains(vendor, ".") {
		return "", "vendor " + q(vendor) + " is not a domain name"
	}
	if !cdiPart(vendor, true, "-_.") {
		return "", "bad vendor " + q(vendor)
	}
	if !cdiPart(class, true, "-_") {
		return "", "bad class " + q(class)
	}
	if !cdiPart(name, false, "-_.:") {
		return "", "bad name " + q(name)
	}
	return name, ""
}

// cdiPart reports whether s is non-empty, starts with a letter (or, unless
// letterFirst, a digit), ends with a letter or digit, and otherwise has only letters,
// digits and the bytes in extra.
func cdiPart(s string, letterFirst bool, extra string) bool {
	if s == "" {
		return false
	}
	isLetter := func(b byte) bool { return 'a' <= b && b <= 'z' || 'A' <= b && b <= 'Z' }
	isAlnum := func(b byte) bool { return isLetter(b) || '0' <= b && b <= '9' }
	if first := s[0]; !isLetter(first) && (letterFirst || !isAlnum(first)) {
		return false
	}
	if !isAlnum(s[len(s)-1]) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isAlnum(s[i]) && strings.IndexByte(extra, s[i]) < 0 {
			return false
		}
	}
	return true
}
