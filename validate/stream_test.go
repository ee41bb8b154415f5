package validate_test

import (
	"math"
	"testing"
	"time"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/validate"
)

func TestStreamFilter(t *testing.T) {
	const limit = validate.MaxStreamFilters
	tests := []struct {
		name            string
		groups, plugins int
		want            []device.FieldError
	}{
		{name: "no filters"},
		{name: "at the limit", groups: limit, plugins: limit},
		{name: "too many groups", groups: limit + 1,
			want: []device.FieldError{{Field: "groups", Rule: "at most 64 filters; got 65"}}},
		{name: "too many plugins", plugins: 1000,
			want: []device.FieldError{{Field: "plugins", Rule: "at most 64 plugin names; got 1000"}}},
		{name: "both reported", groups: limit + 1, plugins: limit + 2,
			want: []device.FieldError{
				{Field: "groups", Rule: "at most 64 filters; got 65"},
				{Field: "plugins", Rule: "at most 64 plugin names; got 66"},
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkFieldErrors(t, validate.StreamFilter(tt.groups, tt.plugins), tt.want)
		})
	}
}

func TestStatsInterval(t *testing.T) {
	tests := []struct {
		name string
		d    time.Duration
		want []device.FieldError
	}{
		{name: "zero: the agent's own"},
		{name: "a second", d: time.Second},
		{name: "the cap", d: validate.MaxStatsInterval},
		{name: "negative", d: -time.Nanosecond,
			want: []device.FieldError{{Field: "interval", Rule: "must not be negative"}}},
		{name: "over the cap", d: validate.MaxStatsInterval + 1,
			want: []device.FieldError{{Field: "interval", Rule: "at most 24h0m0s; got 24h0m0.000000001s"}}},
		{name: "the longest Duration", d: math.MaxInt64,
			want: []device.FieldError{{Field: "interval", Rule: "at most 24h0m0s; got 2562047h47m16.854775807s"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkFieldErrors(t, validate.StatsInterval(tt.d), tt.want)
		})
	}
}
