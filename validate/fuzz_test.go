package validate_test

import (
	"errors"
	"math"
	"path"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
	"google.golang.org/protobuf/proto"
)

// addSeeds adds the wire encoding of each message to f's seed corpus.
func addSeeds(f *testing.F, msgs ...proto.Message) {
	f.Helper()
	for _, m := range msgs {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatalf("marshal seed: %v", err)
		}
		f.Add(b)
	}
}

// checkShape fails t unless err is nil or a join of at most MaxViolations+1 errors,
// every one a *Violation.
func checkShape(t *testing.T, err error) {
	t.Helper()
	if err == nil {
		return
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("error %T is not a join: %v", err, err)
	}
	errs := joined.Unwrap()
	if len(errs) == 0 || len(errs) > validate.MaxViolations+1 {
		t.Fatalf("got %d violations, want 1 to %d", len(errs), validate.MaxViolations+1)
	}
	if n := len(validate.Violations(err)); n != len(errs) {
		t.Fatalf("%d of %d joined errors are *Violation, want all", n, len(errs))
	}
}

// FuzzFingerprint feeds arbitrary wire bytes through Fingerprint. It must not panic,
// its error must have the documented shape, and a fingerprint it accepts must keep the
// promises the manager relies on.
func FuzzFingerprint(f *testing.F) {
	dup := goodFingerprint()
	dup.Groups[1].Devices[0].Id = "GPU-0"
	bad := goodFingerprint()
	bad.Groups[0].Attributes["t"] = &pb.Value{Kind: &pb.Value_FloatValue{FloatValue: math.Inf(1)}, Unit: "K"}
	bad.Groups[0].Devices[0].Locality.PciBusId = "0000:17:20.0"
	addSeeds(f, goodFingerprint(), dup, bad, &pb.FingerprintResponse{})
	f.Add([]byte("\x0a\x05\x0a\x03\xe2\x82")) // truncated group
	f.Fuzz(func(t *testing.T, data []byte) {
		var resp pb.FingerprintResponse
		if proto.Unmarshal(data, &resp) != nil {
			return
		}
		err := validate.Fingerprint(&resp)
		checkShape(t, err)
		if err != nil {
			return
		}
		if len(resp.Groups) > validate.MaxGroups {
			t.Fatalf("accepted %d groups", len(resp.Groups))
		}
		ids := make(map[string]bool)
		for _, g := range resp.Groups {
			if g.GetVendor() == "" || g.GetType() == "" || g.GetName() == "" {
				t.Fatalf("accepted group %q/%q/%q", g.GetVendor(), g.GetType(), g.GetName())
			}
			for name, v := range g.GetAttributes() {
				if name == "" || v.GetKind() == nil || !validate.KnownUnit(v.GetUnit()) {
					t.Fatalf("accepted attribute %q = %v", name, v)
				}
				if x := v.GetFloatValue(); math.IsNaN(x) || math.IsInf(x, 0) {
					t.Fatalf("accepted attribute %q = %v", name, x)
				}
			}
			for _, d := range g.GetDevices() {
				if d.GetId() == "" || ids[d.GetId()] || !utf8.ValidString(d.GetId()) {
					t.Fatalf("accepted device ID %q (empty, repeated or not UTF-8)", d.GetId())
				}
				ids[d.GetId()] = true
			}
		}
	})
}

// FuzzReservation feeds arbitrary wire bytes through Reservation for one requested
// device. A reservation it accepts must be safe to hand to a container runtime.
func FuzzReservation(f *testing.F) {
	bad := goodReservation()
	bad.Envs["LD_PRELOAD"] = "/x.so"
	bad.Mounts[0].HostPath = "/a/../b"
	bad.Devices[0].Permissions = "rwx"
	addSeeds(f, goodReservation(), bad, &pb.ContainerReservation{})
	f.Fuzz(func(t *testing.T, data []byte) {
		var res pb.ContainerReservation
		if proto.Unmarshal(data, &res) != nil {
			return
		}
		err := validate.Reservation(&res, []string{"GPU-1"})
		checkShape(t, err)
		if errors.Is(err, validate.RuleTruncated) && len(validate.Violations(err)) != validate.MaxViolations+1 {
			t.Fatalf("truncated after %d violations, want %d", len(validate.Violations(err))-1, validate.MaxViolations)
		}
		if err != nil {
			return
		}
		for name, value := range res.GetEnvs() {
			if validate.EnvDenied(name) || name == "" || strings.ContainsAny(name, "=\x00") || strings.Contains(value, "\x00") {
				t.Fatalf("accepted env %q=%q", name, value)
			}
		}
		var paths []string
		for _, m := range res.GetMounts() {
			paths = append(paths, m.GetHostPath(), m.GetContainerPath())
		}
		for _, d := range res.GetDevices() {
			paths = append(paths, d.GetHostPath(), d.GetContainerPath())
			if p := d.GetPermissions(); p == "" || strings.Trim(p, "rwm") != "" || len(p) > 3 {
				t.Fatalf("accepted permissions %q", p)
			}
		}
		for _, p := range paths {
			if !path.IsAbs(p) || path.Clean(p) != p || slices.Contains(strings.Split(p, "/"), "..") {
				t.Fatalf("accepted path %q", p)
			}
		}
		for _, name := range res.GetCdiDevices() {
			if !strings.HasSuffix(name, "=GPU-1") {
				t.Fatalf("accepted CDI device %q for requested GPU-1", name)
			}
		}
	})
}
