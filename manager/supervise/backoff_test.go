package supervise

import (
	"slices"
	"testing"
	"time"

	"github.com/devicehost/devicehost/backoff"
)

func TestBackoff(t *testing.T) {
	none := func() float64 { return 0 }
	b := restartBackoff{Backoff: backoff.Backoff{Base: 200 * time.Millisecond, Max: time.Second, Jitter: none}, stable: time.Minute, served: time.Second}
	var got []time.Duration
	for range 6 {
		got = append(got, b.next(time.Second, 0))
	}
	want := []time.Duration{200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond, time.Second, time.Second, time.Second}
	if !slices.Equal(got, want) {
		t.Errorf("delays = %v, want %v (first fast, doubling, capped)", got, want)
	}
	if got, want := b.next(time.Minute, 0), 200*time.Millisecond; got != want {
		t.Errorf("delay after a stable run = %v, want %v", got, want)
	}

	for _, j := range []float64{-1, 1} {
		b := restartBackoff{Backoff: backoff.Backoff{Base: time.Second, Max: time.Second, Jitter: func() float64 { return j }}, stable: time.Minute}
		if got, want := b.next(0, 0), time.Duration(float64(time.Second)*(1+0.2*j)); got != want {
			t.Errorf("jitter %v: delay = %v, want %v", j, got, want)
		}
	}
	r := restartBackoff{Backoff: backoff.Backoff{Base: time.Second, Max: time.Second}, stable: time.Minute}
	for range 100 {
		if d := r.next(0, 0); d < 800*time.Millisecond || d > 1200*time.Millisecond {
			t.Fatalf("random jitter delay %v outside ±20%% of 1s", d)
		}
	}
}

// TestBackoffServedRunDoesNotInheritThePenalty: a plugin killed after it served
// restarts after the base delay, however long the crash loop before it; one that dies
// before serving for ServedReset, or never serves, keeps backing off.
func TestBackoffServedRunDoesNotInheritThePenalty(t *testing.T) {
	none := func() float64 { return 0 }
	base, maxDelay := 200*time.Millisecond, 30*time.Second
	b := restartBackoff{Backoff: backoff.Backoff{Base: base, Max: maxDelay, Jitter: none}, stable: time.Minute, served: time.Second}
	// A crash loop before the plugin ever fingerprints: 0.2, 0.4, ... 25.6s.
	var d time.Duration
	for range 8 {
		d = b.next(100*time.Millisecond, 0)
	}
	if want := 25600 * time.Millisecond; d != want {
		t.Fatalf("8th delay of a crash loop = %v, want %v", d, want)
	}
	// Then it comes up, serves 5s and is killed: back after the base delay.
	if got := b.next(5500*time.Millisecond, 5*time.Second); got != base {
		t.Errorf("delay after a run that served 5s = %v, want %v", got, base)
	}
	// Killed again and again after serving 1.5s each: never more than the base delay.
	for i := range 8 {
		if got := b.next(2*time.Second, 1500*time.Millisecond); got != base {
			t.Errorf("delay after served run %d = %v, want %v", i, got, base)
		}
	}
	// A run that fingerprints and dies within ServedReset still counts as a failure.
	b.next(2*time.Second, 1500*time.Millisecond)
	if got, want := b.next(600*time.Millisecond, 500*time.Millisecond), 2*base; got != want {
		t.Errorf("delay after a run that served only 0.5s = %v, want %v (still backing off)", got, want)
	}
	// Without a served threshold (the stats stream's backoff), serving resets nothing.
	s := restartBackoff{Backoff: backoff.Backoff{Base: base, Max: maxDelay, Jitter: none}, stable: time.Minute}
	s.next(0, 0)
	if got, want := s.next(0, time.Hour), 2*base; got != want {
		t.Errorf("delay with no served threshold = %v, want %v", got, want)
	}
}
