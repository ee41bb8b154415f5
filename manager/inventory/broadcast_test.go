package inventory

import (
	"context"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestBroadcastDownsamplesAndReplaces(t *testing.T) {
	var b broadcast[int]
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := 0
	every := b.subscribe(ctx, 1, &first)
	third := b.subscribe(ctx, 3, nil)

	for v := 1; v <= 7; v++ {
		b.publish(v)
	}
	// The every-one watcher never read: it holds only the latest value.
	if got := drain(every); !slices.Equal(got, []int{7}) {
		t.Errorf("every-1 watcher holds %v, want [7]", got)
	}
	if got := drain(third); !slices.Equal(got, []int{6}) {
		t.Errorf("every-3 watcher holds %v, want [6] (publications 3 and 6, latest kept)", got)
	}
	var got []int
	for v := 8; v <= 12; v++ {
		b.publish(v)
		got = append(got, drain(third)...)
	}
	if !slices.Equal(got, []int{9, 12}) {
		t.Errorf("every-3 watcher read %v, want [9 12]", got)
	}

	b.close()
	waitClosed(t, every)
	waitClosed(t, third)
	if _, ok := <-b.subscribe(ctx, 1, &first); ok {
		t.Error("subscribe after close delivered a value, want a closed channel")
	}
}

// drain returns what ch holds now without waiting.
func drain[T any](ch <-chan T) []T {
	var out []T
	for {
		select {
		case v, ok := <-ch:
			if !ok {
				return out
			}
			out = append(out, v)
		default:
			return out
		}
	}
}

// waitClosed drains ch until it is closed, failing after 10 s.
func waitClosed[T any](t *testing.T, ch <-chan T) {
	t.Helper()
	deadline := time.NewTimer(10 * time.Second)
	defer deadline.Stop()
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-deadline.C:
			t.Fatal("channel not closed within 10s")
		}
	}
}
