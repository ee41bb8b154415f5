package pluginloader_test

import (
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/devicehost/devicehost/deviceplugin"
	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

// TestRecvLimit: a plugin that sends a 64 MiB fingerprint gets it refused with an error
// naming the plugin and the size, the host never holds the message in memory, and the
// plugin's other calls still work.
var sizeRe = regexp.MustCompile(`sent a (\d+)-byte message`)

func TestRecvLimit(t *testing.T) {
	const pad = 64 << 20
	p := launchFixture(t, fixtureplugin.Config{FingerprintPadBytes: pad}, pluginloader.Options{})

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)

	stream, err := p.Client().Fingerprint(testContext(t), &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	_, err = stream.Recv()
	runtime.ReadMemStats(&after)

	// Everything the host allocated while the plugin sent 64 MiB: reading the message
	// would take at least that (and as much again to unmarshal it).
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 24<<20 {
		t.Errorf("the host allocated %d MiB while receiving a 64 MiB message, want well under 64", grew>>20)
	} else {
		t.Logf("allocated while receiving a 64 MiB message: %.1f MiB", float64(grew)/(1<<20))
	}

	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Recv of a 64 MiB fingerprint: got %v, want ResourceExhausted", err)
	}
	msg := status.Convert(err).Message()
	t.Logf("Recv: %s", msg)
	for _, want := range []string{`plugin "fixture"`, "Fingerprint", "over the host's limit of 4194304 bytes"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not say %q", msg, want)
		}
	}
	if m := sizeRe.FindStringSubmatch(msg); m == nil || len(m[1]) != len(strconv.Itoa(pad)) {
		t.Errorf("error %q does not name the message's size (a little over %d bytes)", msg, pad)
	}

	// A refused answer, not a dead plugin: the connection still serves.
	if _, err := p.Client().Reserve(testContext(t), &pb.ReserveRequest{DeviceIds: []string{"w0"}}); err != nil {
		t.Errorf("Reserve after the refused fingerprint: %v", err)
	}
}

func TestRecvLimitOption(t *testing.T) {
	// The default fixture's fingerprint is a few hundred bytes; 64 bytes refuses it.
	p := launchFixture(t, fixtureplugin.Config{}, pluginloader.Options{MaxRecvMsgSize: 64})
	stream, err := p.Client().Fingerprint(testContext(t), &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	_, err = stream.Recv()
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "limit of 64 bytes") {
		t.Errorf("Recv with MaxRecvMsgSize 64: got %v, want ResourceExhausted naming the 64-byte limit", err)
	}
}

// TestMessageOverTheWindowArrives: a fingerprint of 3 MiB, under the host's limit but
// three times the connection's fixed flow-control window (deviceplugin.Window), arrives
// whole, twice (the window is given back as the host reads).
func TestMessageOverTheWindowArrives(t *testing.T) {
	const pad = 3 * deviceplugin.Window
	p := launchFixture(t, fixtureplugin.Config{FingerprintPadBytes: pad}, pluginloader.Options{})
	for i := range 2 {
		stream, err := p.Client().Fingerprint(testContext(t), &pb.FingerprintRequest{})
		if err != nil {
			t.Fatalf("Fingerprint %d: %v", i, err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("Recv of a %d-byte fingerprint (%d): %v", pad, i, err)
		}
		if size := proto.Size(resp); size < pad {
			t.Fatalf("fingerprint %d arrived as %d bytes, want over %d", i, size, pad)
		}
	}
}
