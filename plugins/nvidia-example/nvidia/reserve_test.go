package nvidia

import (
	"context"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestReserve(t *testing.T) {
	gpu := func(i int) string { return simulatedUUID("dgxh100", i) }
	p, _ := newTestPlugin(t, Config{Simulate: "dgxh100", IgnoredGPUIDs: []string{gpu(6)}})

	tests := []struct {
		name     string
		ids      []string
		wantCode codes.Code // OK: success
		wantIn   []string   // must appear in the error
	}{
		{"one", []string{gpu(0)}, codes.OK, nil},
		{"request order kept", []string{gpu(5), gpu(1), gpu(3)}, codes.OK, nil},
		{"unknown", []string{gpu(0), "GPU-nope", "GPU-gone"}, codes.NotFound, []string{"unknown", "GPU-nope, GPU-gone"}},
		{"other machine's GPU", []string{simulatedUUID("dgxa100", 0)}, codes.NotFound, []string{simulatedUUID("dgxa100", 0)}},
		{"ignored", []string{gpu(1), gpu(6)}, codes.NotFound, []string{"ignored", gpu(6)}},
		{"repeated", []string{gpu(2), gpu(2)}, codes.InvalidArgument, []string{"more than once", gpu(2)}},
		{"none", nil, codes.InvalidArgument, []string{"no device IDs"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := p.Reserve(context.Background(), tt.ids)
			if tt.wantCode != codes.OK {
				if res != nil || err == nil {
					t.Fatalf("Reserve(%v) = %v, %v; want a %v error", tt.ids, res, err, tt.wantCode)
				}
				if got := status.Code(err); got != tt.wantCode {
					t.Errorf("code = %v, want %v (%v)", got, tt.wantCode, err)
				}
				for _, w := range tt.wantIn {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not mention %q", err, w)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Reserve(%v): %v", tt.ids, err)
			}
			if got, want := res.GetEnvs()["NVIDIA_VISIBLE_DEVICES"], strings.Join(tt.ids, ","); got != want {
				t.Errorf("NVIDIA_VISIBLE_DEVICES = %q, want %q", got, want)
			}
			if len(res.GetEnvs()) != 1 {
				t.Errorf("envs = %v, want only NVIDIA_VISIBLE_DEVICES", res.GetEnvs())
			}
			var want []string
			for _, id := range tt.ids {
				want = append(want, "nvidia.com/gpu="+id)
			}
			if !slices.Equal(res.GetCdiDevices(), want) {
				t.Errorf("CDI devices = %v, want %v", res.GetCdiDevices(), want)
			}
		})
	}
}

func TestCallsBeforeSetConfigAreRefused(t *testing.T) {
	p, _ := newUnconfigured(t)
	ctx := context.Background()
	if _, err := p.Reserve(ctx, []string{"GPU-x"}); err == nil || !strings.Contains(err.Error(), "not configured") {
		t.Errorf("Reserve before SetConfig: %v, want a not-configured error", err)
	}
	if err := p.Fingerprint(ctx, nil); err == nil {
		t.Errorf("Fingerprint before SetConfig: nil error")
	}
	if err := p.Stats(ctx, 0, nil); err == nil {
		t.Errorf("Stats before SetConfig: nil error")
	}
}
