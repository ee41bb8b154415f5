package agenttest_test

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/devicehost/devicehost/tools/agenttest"
	"github.com/devicehost/devicehost/tools/logtest"
)

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func TestStartRecordsOutputAndExit(t *testing.T) {
	tests := []struct {
		name             string
		merge            bool
		wantOut, wantErr string
	}{
		{"apart", false, "out", "err"},
		{"merged", true, "out|err", "out|err"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := agenttest.Start(t, agenttest.Command{Path: "/bin/sh", Args: []string{"-c", "echo out; echo err >&2; exit 3"},
				TempDir: t.TempDir(), MergeOutput: tt.merge})
			var exit *exec.ExitError
			if err := p.Wait(testContext(t)); !errors.As(err, &exit) || exit.ExitCode() != 3 {
				t.Fatalf("Wait = %v, want exit status 3", err)
			}
			if got := strings.Join(p.Stdout.Lines(), "|"); got != tt.wantOut {
				t.Errorf("stdout = %q, want %q", got, tt.wantOut)
			}
			if got := strings.Join(p.Stderr.Lines(), "|"); got != tt.wantErr {
				t.Errorf("stderr = %q, want %q", got, tt.wantErr)
			}
		})
	}
}

func TestKillEndsTheProcessGroup(t *testing.T) {
	p := agenttest.Start(t, agenttest.Command{Path: "/bin/sh", Args: []string{"-c", "echo ready; sleep 1000 & wait"}})
	if _, err := p.Stdout.Wait(testContext(t), logtest.Containing("ready")); err != nil {
		t.Fatal(err)
	}
	p.Kill() // returns once the output is read: the sleep, holding stdout, is gone too
	if err := p.Err(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("Err after Kill = %v, want killed", err)
	}
}
