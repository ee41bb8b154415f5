package client

import (
	"testing"
	"time"

	"github.com/devicehost/devicehost/backoff"
)

func TestOfferKeepsOnlyTheLatest(t *testing.T) {
	ch := make(chan int, 1)
	for i := 1; i <= 5; i++ {
		offer(ch, i) // nobody reads: must not block
	}
	if got := <-ch; got != 5 {
		t.Errorf("reader got %d, want 5 (the latest)", got)
	}
	select {
	case v := <-ch:
		t.Errorf("a second value %d is waiting, want no backlog", v)
	default:
	}
}

func TestBackoffGrowsCapsAndResets(t *testing.T) {
	c := &Client{opts: options{backoffBase: 100 * time.Millisecond, backoffMax: time.Second}}
	b := c.newBackoff()
	var got []time.Duration
	for range 8 {
		got = append(got, b.Next())
	}
	for i, d := range got {
		want := min(100*time.Millisecond<<i, time.Second)
		lo := time.Duration(float64(want) * (1 - backoff.Fraction))
		if d < lo || d > want+want/5 || d > time.Second {
			t.Errorf("delay %d = %v, want within ±20%% of %v and at most 1s", i, d, want)
		}
	}
	b.Reset()
	if d := b.Next(); d > 120*time.Millisecond {
		t.Errorf("after reset: %v, want about the base (100ms)", d)
	}
}
