package validate_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// fatFingerprint returns a fingerprint that breaks no rule but the size limit, of exactly
// size encoded bytes: groups of 16 devices, each carrying up to MaxAttributes string
// attributes of up to MaxStringValueLen bytes. size must be at least a few KiB.
func fatFingerprint(t *testing.T, size int) *pb.FingerprintResponse {
	t.Helper()
	resp := &pb.FingerprintResponse{}
	var last *pb.Value
	for gi, total := 0, 0; total < size; gi++ {
		g := &pb.DeviceGroup{Vendor: "acme", Type: "widget", Name: fmt.Sprintf("W%d", gi), Attributes: map[string]*pb.Value{}}
		for di := range 16 {
			g.Devices = append(g.Devices, &pb.Device{Id: fmt.Sprintf("w%d-%d", gi, di), Health: pb.Health_HEALTH_HEALTHY})
		}
		resp.Groups = append(resp.Groups, g)
		before := total
		total = before + fieldSize(g) // the message's size so far, without re-encoding it all
		for ai := 0; ai < validate.MaxAttributes && total < size; ai++ {
			last = &pb.Value{Kind: &pb.Value_StringValue{StringValue: strings.Repeat("x", validate.MaxStringValueLen)}}
			g.Attributes[fmt.Sprintf("a%02d", ai)] = last
			total = before + fieldSize(g)
		}
	}
	// Trim the last attribute to land on size exactly: past 127 bytes its length prefix
	// is two bytes, so each byte cut is one byte off the message.
	over := proto.Size(resp) - size
	s := last.GetStringValue()
	if over > len(s)-128 {
		t.Fatalf("fatFingerprint(%d): cannot trim %d bytes", size, over)
	}
	last.Kind = &pb.Value_StringValue{StringValue: s[:len(s)-over]}
	if got := proto.Size(resp); got != size {
		t.Fatalf("fatFingerprint(%d) is %d bytes", size, got)
	}
	return resp
}

// fieldSize is the encoded size of m as field 1 of its parent: tag, length, message.
func fieldSize(m proto.Message) int {
	n := proto.Size(m)
	return protowire.SizeTag(1) + protowire.SizeVarint(uint64(n)) + n
}

func TestFingerprintSizeLimit(t *testing.T) {
	tests := []struct {
		name string
		size int
		want []found
	}{
		{"at the limit", validate.MaxFingerprintBytes, nil},
		{"one byte over", validate.MaxFingerprintBytes + 1, []found{{"fingerprint", validate.RuleTooLarge}}},
		// An inventory that no client could receive.
		{"4,254,525 bytes", 4254525, []found{{"fingerprint", validate.RuleTooLarge}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := validate.Fingerprint(fatFingerprint(t, tc.size))
			checkViolations(t, err, tc.want)
			if tc.want != nil && !strings.Contains(err.Error(), fmt.Sprintf("%d bytes encoded, limit %d", tc.size, validate.MaxFingerprintBytes)) {
				t.Errorf("error %q does not give the size and the limit", err)
			}
		})
	}
}

// fatStats returns a stats message for the devices w0..w(n-1) of exactly size encoded
// bytes, every value within its own limits.
func fatStats(t *testing.T, size int) (*pb.StatsResponse, func(string) bool) {
	t.Helper()
	resp := &pb.StatsResponse{}
	known := map[string]bool{}
	var last *pb.Value
	for di, total := 0, 0; total < size; di++ {
		d := &pb.DeviceStats{DeviceId: fmt.Sprintf("w%d", di), Values: map[string]*pb.Value{}}
		known[d.DeviceId] = true
		resp.Devices = append(resp.Devices, d)
		before := total
		total = before + fieldSize(d)
		for vi := 0; vi < validate.MaxStatsValues && total < size; vi++ {
			last = &pb.Value{Kind: &pb.Value_StringValue{StringValue: strings.Repeat("y", validate.MaxStringValueLen)}}
			d.Values[fmt.Sprintf("v%03d", vi)] = last
			total = before + fieldSize(d)
		}
	}
	over := proto.Size(resp) - size
	s := last.GetStringValue()
	if over > len(s)-128 {
		t.Fatalf("fatStats(%d): cannot trim %d bytes", size, over)
	}
	last.Kind = &pb.Value_StringValue{StringValue: s[:len(s)-over]}
	if got := proto.Size(resp); got != size {
		t.Fatalf("fatStats(%d) is %d bytes", size, got)
	}
	return resp, func(id string) bool { return known[id] }
}

func TestStatsSizeLimit(t *testing.T) {
	for _, tc := range []struct {
		name string
		size int
		want []found
	}{
		{"at the limit", validate.MaxStatsBytes, nil},
		{"one byte over", validate.MaxStatsBytes + 1, []found{{"stats", validate.RuleTooLarge}}},
		{"4,196,686 bytes", 4196686, []found{{"stats", validate.RuleTooLarge}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, known := fatStats(t, tc.size)
			err := validate.Stats(resp, known)
			checkViolations(t, err, tc.want)
			if tc.want != nil && !errors.Is(err, validate.RuleTooLarge) {
				t.Errorf("error %v is not RuleTooLarge", err)
			}
		})
	}
}
