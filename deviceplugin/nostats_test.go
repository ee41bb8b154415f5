package deviceplugin_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// NoStats keeps the stream alive with empty messages, ends with its context, and
// returns send's error.
func TestNoStats(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	got := make(chan *pb.StatsResponse, 8)
	done := make(chan error, 1)
	go func() {
		done <- deviceplugin.NoStats(ctx, time.Millisecond, func(r *pb.StatsResponse) error {
			select {
			case got <- r:
			default:
			}
			return nil
		})
	}()
	for range 3 {
		if r := <-got; len(r.GetDevices()) != 0 {
			t.Fatalf("NoStats sent %v, want an empty message", r)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("NoStats after its context ended: %v, want nil", err)
	}
	boom := errors.New("stream broken")
	if err := deviceplugin.NoStats(context.Background(), time.Hour, func(*pb.StatsResponse) error { return boom }); !errors.Is(err, boom) {
		t.Errorf("NoStats with a failing send: %v, want its error", err)
	}
}
