package pluginloader

import (
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
)

// TestPluginLogLines: pluginLog gets stderr in pieces (as go-plugin writes it: a line,
// then "\n"); a line longer than maxLogLine is cut and says how much was cut; a last
// line without a newline is logged by close.
func TestPluginLogLines(t *testing.T) {
	var out strings.Builder
	host := hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Info, Output: &out, DisableTime: true})
	l := newPluginLog("p", host, LogLimit{})

	for _, chunk := range []string{`{"@level":"info",`, `"@message":"one"}`, "\n", "[WARN] two\n[ERROR] thr", "ee\n",
		"[INFO] " + strings.Repeat("x", 3*maxLogLine), "\n", "[INFO] no newline"} {
		if _, err := l.Write([]byte(chunk)); err != nil {
			t.Fatal(err)
		}
	}
	l.close()

	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	want := []string{
		"[INFO]  host.p: one",
		"[WARN]  host.p: [WARN] two",
		"[ERROR] host.p: [ERROR] three",
		"[INFO]  host.p: [INFO] " + strings.Repeat("x", maxLogLine-len("[INFO] ")) + ": truncated_bytes=" + strconv.Itoa(2*maxLogLine+len("[INFO] ")),
		"[INFO]  host.p: [INFO] no newline",
	}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), len(want), out.String())
	}
	for i := range want {
		if lines[i] != want[i] {
			t.Errorf("line %d:\n got %.120q\nwant %.120q", i, lines[i], want[i])
		}
	}
}
