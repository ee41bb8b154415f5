package adapter

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/device"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// endedStreams is a Nomad device plugin client whose streams end as Nomad's do when
// their context ends: with one message carrying the error, then closed.
type endedStreams struct{ device.DevicePlugin }

func (endedStreams) Fingerprint(ctx context.Context) (<-chan *device.FingerprintResponse, error) {
	ch := make(chan *device.FingerprintResponse, 1)
	ch <- &device.FingerprintResponse{Error: ctx.Err()}
	close(ch)
	return ch, nil
}

func (endedStreams) Stats(ctx context.Context, _ time.Duration) (<-chan *device.StatsResponse, error) {
	ch := make(chan *device.StatsResponse, 1)
	ch <- &device.StatsResponse{Error: ctx.Err()}
	close(ch)
	return ch, nil
}

// A stream that ends because its context did ends quietly (nil), whichever of the two
// the adapter sees first: the context, or Nomad's error message about it. Each round
// offers both at once, so without the rule about the message a round fails half the
// time.
func TestStreamsEndQuietlyWithTheirContext(t *testing.T) {
	a := New(Options{})
	a.cur = &instance{dev: &nomadDevice{DevicePlugin: endedStreams{}}, path: "/nomad/plugin"}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for i := range 64 {
		if err := a.Fingerprint(ctx, func(*pb.FingerprintResponse) error { return nil }); err != nil {
			t.Fatalf("round %d: Fingerprint with its context ended: %v; want nil", i, err)
		}
		if err := a.Stats(ctx, time.Second, func(*pb.StatsResponse) error { return nil }); err != nil {
			t.Fatalf("round %d: Stats with its context ended: %v; want nil", i, err)
		}
	}
}
