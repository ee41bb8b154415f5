package client

import (
	"testing"
	"time"
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
	b := &retryBackoff{base: 100 * time.Millisecond, max: time.Second}
	var got []time.Duration
	for range 8 {
		got = append(got, b.next())
	}
	for i, d := range got {
		want := min(100*time.Millisecond<<i, time.Second)
		lo := time.Duration(float64(want) * (1 - jitterFraction))
		if d < lo || d > want+want/5 || d > time.Second {
			t.Errorf("delay %d = %v, want within ±20%% of %v and at most 1s", i, d, want)
		}
	}
	b.reset()
	if d := b.next(); d > 120*time.Millisecond {
		t.Errorf("after reset: %v, want about the base (100ms)", d)
	}
}
