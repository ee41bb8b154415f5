package deviceplugintest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Inventories records what a plugin's Fingerprint stream sends, in order.
type Inventories struct {
	ch chan *pb.FingerprintResponse
}

// WatchFingerprint runs p.Fingerprint in-process (no gRPC) until the test ends, and
// returns the recorder of what it sends. Cleanup ends the stream and waits for it.
func WatchFingerprint(t testing.TB, p deviceplugin.Plugin) *Inventories {
	t.Helper()
	in := &Inventories{ch: make(chan *pb.FingerprintResponse, 64)}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		_ = p.Fingerprint(ctx, func(r *pb.FingerprintResponse) error {
			select {
			case in.ch <- r:
			case <-ctx.Done():
			}
			return nil
		})
	})
	t.Cleanup(func() { cancel(); wg.Wait() })
	return in
}

// WaitFor returns the first inventory, in the stream's order, that ok accepts; why
// says what is awaited. After a generous deadline it fails t with the last one seen.
func (in *Inventories) WaitFor(t testing.TB, why string, ok func(*pb.FingerprintResponse) bool) *pb.FingerprintResponse {
	t.Helper()
	deadline := time.NewTimer(10 * time.Second)
	defer deadline.Stop()
	var last *pb.FingerprintResponse
	for {
		select {
		case r := <-in.ch:
			if ok(r) {
				return r
			}
			last = r
		case <-deadline.C:
			t.Fatalf("no inventory where %s; last:\n%s", why, Describe(last))
		}
	}
}

// Describe prints an inventory for a failure: each group, and each device with its
// health and reason.
func Describe(r *pb.FingerprintResponse) string {
	if r == nil {
		return "(none)"
	}
	var b strings.Builder
	for _, g := range r.GetGroups() {
		fmt.Fprintf(&b, "%s/%s:", g.GetVendor(), g.GetType())
		for _, d := range g.GetDevices() {
			fmt.Fprintf(&b, " %s=%s", d.GetId(), d.GetHealth())
			if d.GetHealthReason() != "" {
				fmt.Fprintf(&b, "(%s)", d.GetHealthReason())
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}
