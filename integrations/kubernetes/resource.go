package kubernetes

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// Resource is one extended resource the bridge serves to the kubelet: the devices of
// the agent's device groups that match Vendor, Type and, unless empty, Model (the
// group's name, e.g. "NVIDIA H100 80GB HBM3").
type Resource struct {
	// Name is the extended resource name pods request, e.g. "nvidia.com/gpu"; it must
	// pass ValidateResourceName.
	Name   string
	Vendor string
	Type   string
	// Model is the group name to match; empty matches every group of Vendor and Type.
	Model string
}

// matches reports whether the group g belongs to r.
func (r Resource) matches(g *pb.DeviceGroup) bool { return r.matchesKey(keyOf(g)) }

func (r Resource) matchesKey(g groupKey) bool {
	return g.Vendor == r.Vendor && g.Type == r.Type && (r.Model == "" || g.Name == r.Model)
}

// overlaps reports whether some group could match both r and o.
func (r Resource) overlaps(o Resource) bool {
	return r.Vendor == o.Vendor && r.Type == o.Type && (r.Model == "" || o.Model == "" || r.Model == o.Model)
}

func (r Resource) selector() string {
	if r.Model == "" {
		return fmt.Sprintf("vendor %q type %q (any name)", r.Vendor, r.Type)
	}
	return fmt.Sprintf("vendor %q type %q name %q", r.Vendor, r.Type, r.Model)
}

// MaxResourceNameLen bounds a resource name, in bytes, so that the owner IDs the bridge
// derives from it ("kubelet/<name>/<16 hex digits>") stay within the agent's 256-byte
// limit on IDs.
const MaxResourceNameLen = 200

// The kubelet's rules for an extended resource name (its IsExtendedResourceName: a
// qualified name with a domain, not in the kubernetes.io namespace, that still is a
// qualified name with "requests." in front).
var (
	dnsSubdomain  = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	qualifiedName = regexp.MustCompile(`^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$`)
)

const (
	maxDomainLen = 253 // a DNS subdomain, "requests." in front included
	maxNameLen   = 63
)

// ValidateResourceName checks name against the rules the kubelet applies when a device
// plugin registers (an extended resource name: "domain/name" with a DNS-subdomain
// domain outside kubernetes.io and a name of at most 63 letters, digits, '-', '_' and
// '.', starting and ending with a letter or digit), and against MaxResourceNameLen. The
// error says which rule the name breaks.
func ValidateResourceName(name string) error {
	if name == "" {
		return errors.New("resource name is empty")
	}
	if len(name) > MaxResourceNameLen {
		return fmt.Errorf("resource name %.40q... is %d bytes long, more than %d", name, len(name), MaxResourceNameLen)
	}
	domain, short, ok := strings.Cut(name, "/")
	switch {
	case !ok:
		return fmt.Errorf("resource name %q has no domain: want domain/name, e.g. example.com/%s", name, name)
	case strings.Contains(short, "/"):
		return fmt.Errorf("resource name %q has more than one '/': want domain/name", name)
	case strings.Contains(name, "kubernetes.io/"):
		return fmt.Errorf("resource name %q is in the kubernetes.io namespace, which is the kubelet's own", name)
	case strings.HasPrefix(name, "requests."):
		return fmt.Errorf("resource name %q starts with \"requests.\", which quotas use", name)
	case len("requests."+domain) > maxDomainLen:
		return fmt.Errorf("resource name %q: domain %q is longer than %d bytes", name, domain, maxDomainLen-len("requests."))
	case !dnsSubdomain.MatchString(domain):
		return fmt.Errorf("resource name %q: domain %q is not a DNS subdomain (lower-case letters, digits, '-' and '.')", name, domain)
	case len(short) > maxNameLen:
		return fmt.Errorf("resource name %q: name %q is longer than %d bytes", name, short, maxNameLen)
	case !qualifiedName.MatchString(short):
		return fmt.Errorf("resource name %q: name %q must be letters, digits, '-', '_' or '.', starting and ending with a letter or digit", name, short)
	}
	return nil
}

// PartitionType is the device type of GPU partitions (MIG devices), whose groups are
// named after their profile; each profile gets a resource of its own.
const PartitionType = "mig"

// HostDevVendor is the vendor of the host-device plugin's groups (plugins/hostdev),
// whose default resource names are in HostDevDomain: "devicehost.io/fuse".
const (
	HostDevVendor = "hostdev"
	HostDevDomain = "devicehost.io"
)

// DefaultResourceName is the resource name of a group when no resources are
// configured: "<vendor>.com/<type>", e.g. "nvidia.com/gpu"; for a partition group
// (PartitionType) "<vendor>.com/mig-<name>", e.g. "nvidia.com/mig-1g.10gb", as
// NVIDIA's device plugin names MIG profiles in its "mixed" strategy, so a pod asks for
// the profile it needs; for a host device (HostDevVendor) "devicehost.io/<type>", e.g.
// "devicehost.io/fuse" (hostdev.com is not ours to use); for a vendor that is a domain
// (a hosted kubelet device plugin's resource, vendor "devic.es" and type "fuse") the
// resource's own name, "devic.es/fuse".
func DefaultResourceName(vendor, typ, name string) string {
	switch {
	case strings.Contains(vendor, "."):
		// A kubelet device plugin's resource DOMAIN/NAME, hosted under devicehost
		// (package hosted): served under its own name.
		return vendor + "/" + typ
	case vendor == HostDevVendor:
		return HostDevDomain + "/" + typ
	case typ == PartitionType:
		return vendor + ".com/" + typ + "-" + name
	}
	return vendor + ".com/" + typ
}

// ValidateResources checks configured resources: each name valid
// (ValidateResourceName) and used once, vendor and type set, and no device group able
// to match two of them (its devices would be offered to the kubelet twice). The error
// joins one error per problem.
func ValidateResources(rs []Resource) error {
	var errs []error
	for i, r := range rs {
		if err := ValidateResourceName(r.Name); err != nil {
			errs = append(errs, err)
		}
		if r.Vendor == "" || r.Type == "" {
			errs = append(errs, fmt.Errorf("resource %q: vendor and type must be set", r.Name))
		}
		for _, o := range rs[:i] {
			switch {
			case o.Name == r.Name:
				errs = append(errs, fmt.Errorf("resource %q is configured twice", r.Name))
			case r.overlaps(o):
				errs = append(errs, fmt.Errorf("resources %q and %q both match device groups of %s: give each a different name, or merge them", o.Name, r.Name, r.selector()))
			}
		}
	}
	return errors.Join(errs...)
}

// ownerPrefix is the start of the owner ID of every reservation the bridge makes. Once
// PodResources says which container holds its devices, the bridge hands the
// reservation to that container's owner ID, PodName (podOwnerPrefix...).
const (
	ownerPrefix    = "kubelet/"
	podOwnerPrefix = "k8s/"
)

// ownerID is the owner of the reservation for a container request of resource for
// deviceIDs: the same for the same resource and set of devices in any order, so that
// the kubelet retrying an Allocate gets the reservation of the first try back.
func ownerID(resource string, deviceIDs []string) string {
	ids := slices.Clone(deviceIDs)
	slices.Sort(ids)
	h := sha256.New()
	for _, id := range ids {
		h.Write([]byte(id))
		h.Write([]byte{0})
	}
	return ownerPrefix + resource + "/" + hex.EncodeToString(h.Sum(nil)[:8])
}

// resourceOfOwner returns the resource of an owner ID the bridge made, and false for
// any other owner.
func resourceOfOwner(owner string) (string, bool) {
	rest, ok := strings.CutPrefix(owner, ownerPrefix)
	if !ok {
		return "", false
	}
	i := strings.LastIndexByte(rest, '/')
	if i <= 0 || len(rest)-i-1 != 16 {
		return "", false
	}
	if _, err := hex.DecodeString(rest[i+1:]); err != nil {
		return "", false
	}
	return rest[:i], true
}

// ownedBy reports whether owner, of a reservation of devices of group g, is the
// bridge's for r: made by Allocate for r ("kubelet/<r>/..."), or handed to a pod's
// container ("k8s/...") on a group of r.
func (r Resource) ownedBy(owner string, g groupKey) bool {
	if res, ok := resourceOfOwner(owner); ok {
		return res == r.Name
	}
	return strings.HasPrefix(owner, podOwnerPrefix) && r.matchesKey(g)
}

// groupKey names a device group.
type groupKey struct{ Vendor, Type, Name string }

func keyOf(g *pb.DeviceGroup) groupKey {
	return groupKey{g.GetVendor(), g.GetType(), g.GetName()}
}
