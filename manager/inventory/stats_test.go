package inventory

import (
	"math"
	"testing"
	"time"
)

func TestStatsEvery(t *testing.T) {
	h := NewStats(100*time.Millisecond, time.Now)
	for _, tc := range []struct {
		in   time.Duration
		want int
	}{{0, 1}, {10 * time.Millisecond, 1}, {100 * time.Millisecond, 1}, {150 * time.Millisecond, 2}, {time.Second, 10},
		// Near the largest Duration, rounding up must not overflow into "every tick".
		{math.MaxInt64, math.MaxInt64/int(100*time.Millisecond) + 1}, {24 * time.Hour, 864000}} {
		if got := h.every(tc.in); got != tc.want {
			t.Errorf("every(%v) = %d, want %d", tc.in, got, tc.want)
		}
	}
}
