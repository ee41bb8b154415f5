package fixtureplugin_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/devicehost/devicehost/deviceplugin/deviceplugintest"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/validate"
)

// Tests of the hostile-plugin knobs.

func TestFingerprintInvalid(t *testing.T) {
	c, _ := start(t, fixtureplugin.Config{FingerprintInvalid: true})
	m, err := fingerprints(t, c)()
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Fingerprint(m); err == nil || !strings.Contains(err.Error(), validate.RuleDuplicate.Error()) {
		t.Errorf("validate.Fingerprint of a fingerprint_invalid message = %v, want a duplicate ID", err)
	}
}

func TestFingerprintError(t *testing.T) {
	c, _ := start(t, fixtureplugin.Config{FingerprintError: "line one\nline two"})
	_, err := fingerprints(t, c)()
	if !strings.Contains(status.Convert(err).Message(), "line one\nline two") {
		t.Errorf("Fingerprint: %v, want the configured error", err)
	}
}

func TestFingerprintDelay(t *testing.T) {
	const delay = 200 * time.Millisecond
	c, _ := start(t, fixtureplugin.Config{FingerprintDelay: fixtureplugin.Duration(delay)})
	start := time.Now()
	if _, err := fingerprints(t, c)(); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < delay {
		t.Errorf("first fingerprint after %v, want no sooner than %v", took, delay)
	}
}

// TestPadding: attribute_bytes and stats_value_bytes add exactly that many bytes of
// values, within every per-field limit.
func TestPadding(t *testing.T) {
	const n = fixtureplugin.MaxAttributeBytes
	c, _ := start(t, fixtureplugin.Config{AttributeBytes: n, StatsValueBytes: fixtureplugin.MaxStatsValueBytes})
	m, err := fingerprints(t, c)()
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Fingerprint(m); err != nil {
		t.Errorf("padded fingerprint breaks a rule: %v", err)
	}
	for _, g := range m.GetGroups() {
		if got := padBytes(g.GetAttributes()); got != n {
			t.Errorf("group %s: %d bytes of padding, want %d", g.GetName(), got, n)
		}
	}
	s, err := c.Stats(testContext(t), &pb.StatsRequest{Interval: durationpb.New(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	sm, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Stats(sm, func(string) bool { return true }); err != nil {
		t.Errorf("padded stats break a rule: %v", err)
	}
	for _, d := range sm.GetDevices() {
		if got := padBytes(d.GetValues()); got != fixtureplugin.MaxStatsValueBytes {
			t.Errorf("device %s: %d bytes of padding, want %d", d.GetDeviceId(), got, fixtureplugin.MaxStatsValueBytes)
		}
	}

	for _, bad := range []string{
		fmt.Sprintf(`{"attribute_bytes":%d}`, fixtureplugin.MaxAttributeBytes+1),
		`{"attribute_bytes":-1}`,
		fmt.Sprintf(`{"stats_value_bytes":%d}`, fixtureplugin.MaxStatsValueBytes+1),
	} {
		c := deviceplugintest.Connect(t, fixtureplugin.New())
		if _, err := c.SetConfig(testContext(t), &pb.SetConfigRequest{ConfigJson: []byte(bad)}); status.Code(err) != codes.InvalidArgument {
			t.Errorf("SetConfig(%s) = %v, want INVALID_ARGUMENT", bad, err)
		}
	}
}

func padBytes(values map[string]*pb.Value) int {
	n := 0
	for k, v := range values {
		if strings.HasPrefix(k, "pad_") {
			n += len(v.GetStringValue())
		}
	}
	return n
}

func TestReserveTag(t *testing.T) {
	c, _ := start(t, fixtureplugin.Config{ReserveTag: "owner"})
	resp, err := c.Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: []string{"w0"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetReservation().GetEnvs()["FIXTURE_TAG"]; got != "owner" {
		t.Errorf("FIXTURE_TAG = %q, want %q", got, "owner")
	}
}
