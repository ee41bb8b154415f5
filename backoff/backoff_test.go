package backoff

import (
	"math"
	"slices"
	"testing"
	"time"
)

func fixed(j float64) func() float64 { return func() float64 { return j } }

func TestNextDoublesCapsAndResets(t *testing.T) {
	b := Backoff{Base: 200 * time.Millisecond, Max: time.Second, Jitter: fixed(0)}
	var got []time.Duration
	for range 6 {
		got = append(got, b.Next())
	}
	want := []time.Duration{200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond, time.Second, time.Second, time.Second}
	if !slices.Equal(got, want) {
		t.Errorf("delays = %v, want %v (base, doubling, capped)", got, want)
	}
	b.Reset()
	if got, want := b.Next(), 200*time.Millisecond; got != want {
		t.Errorf("delay after Reset = %v, want %v (the base)", got, want)
	}
}

func TestDelay(t *testing.T) {
	b := Backoff{Base: time.Second, Max: 10 * time.Second, Jitter: fixed(0)}
	for _, tt := range []struct {
		n    int
		want time.Duration
	}{
		{-3, time.Second}, {0, time.Second}, {1, time.Second}, {2, 2 * time.Second}, {3, 4 * time.Second},
		{4, 8 * time.Second}, {5, 10 * time.Second}, {40, 10 * time.Second}, {math.MaxInt, 10 * time.Second},
	} {
		if got := b.Delay(tt.n); got != tt.want {
			t.Errorf("Delay(%d) = %v, want %v", tt.n, got, tt.want)
		}
	}
	// Delay does not count: Next still starts at the base.
	if got := b.Next(); got != time.Second {
		t.Errorf("Next after Delay calls = %v, want the base", got)
	}
}

func TestJitter(t *testing.T) {
	for _, tt := range []struct {
		name    string
		b       Backoff
		n       int
		j       float64
		want    time.Duration
		comment string
	}{
		{"shortest", Backoff{Base: time.Second, Max: time.Minute}, 1, -1, 800 * time.Millisecond, "-20%"},
		{"longest", Backoff{Base: time.Second, Max: time.Minute}, 1, 1, 1200 * time.Millisecond, "+20%"},
		{"half", Backoff{Base: time.Second, Max: time.Minute}, 2, 0.5, 2200 * time.Millisecond, "+10% of 2s"},
		{"above the cap", Backoff{Base: time.Second, Max: 4 * time.Second}, 9, 1, 4800 * time.Millisecond, "the capped delay is spread too"},
		{"hard cap", Backoff{Base: time.Second, Max: 4 * time.Second, HardMax: true}, 9, 1, 4 * time.Second, "HardMax: never above Max"},
		{"hard cap, below", Backoff{Base: time.Second, Max: 4 * time.Second, HardMax: true}, 9, -1, 3200 * time.Millisecond, "HardMax still spreads downwards"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tt.b.Jitter = fixed(tt.j)
			if got := tt.b.Delay(tt.n); got != tt.want {
				t.Errorf("Delay(%d) with jitter %v = %v, want %v (%s)", tt.n, tt.j, got, tt.want, tt.comment)
			}
		})
	}
}

func TestRandomJitterStaysWithinTheSpread(t *testing.T) {
	b := Backoff{Base: time.Second, Max: time.Second}
	h := Backoff{Base: time.Second, Max: time.Second, HardMax: true}
	for range 1000 {
		if d := b.Next(); d < 800*time.Millisecond || d > 1200*time.Millisecond {
			t.Fatalf("random jitter: %v, want within ±20%% of 1s", d)
		}
		if d := h.Next(); d < 800*time.Millisecond || d > time.Second {
			t.Fatalf("random jitter with HardMax: %v, want within [0.8s, 1s]", d)
		}
	}
}

func TestMaxBelowBaseIsBase(t *testing.T) {
	for _, b := range []Backoff{
		{Base: time.Second, Jitter: fixed(0)},
		{Base: time.Second, Max: time.Millisecond, Jitter: fixed(0), HardMax: true},
	} {
		for n := 1; n <= 3; n++ {
			if got := b.Delay(n); got != time.Second {
				t.Errorf("%+v: Delay(%d) = %v, want the base", b, n, got)
			}
		}
	}
}

func TestZeroWaitsNothing(t *testing.T) {
	var b Backoff
	if got := b.Next(); got != 0 {
		t.Errorf("zero Backoff: Next = %v, want 0", got)
	}
}

// TestHugeMaxDoesNotOverflow: doubling stops at Max even when twice the delay would
// not fit in a time.Duration, and jitter above the largest Duration gives the largest.
func TestHugeMaxDoesNotOverflow(t *testing.T) {
	for _, j := range []float64{-1, 0, 1} {
		b := Backoff{Base: time.Hour, Max: math.MaxInt64, Jitter: fixed(j)}
		prev := time.Duration(0)
		for n := 1; n <= 100; n++ {
			d := b.Delay(n)
			if d < prev {
				t.Fatalf("jitter %v: Delay(%d) = %v, below Delay(%d) = %v: overflowed", j, n, d, n-1, prev)
			}
			prev = d
		}
	}
}
