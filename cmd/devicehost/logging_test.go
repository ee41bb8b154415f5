package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
)

// Durations read as durations in the JSON log ("every":"2s", not 2000000000), from the
// root logger and from the named and With loggers the packages get.
func TestJSONLogWritesDurationsAsText(t *testing.T) {
	var buf bytes.Buffer
	root := newLogger(hclog.LoggerOptions{Output: &buf, JSONFormat: true, Level: hclog.Debug})
	root.Info("root", "every", 2*time.Second)
	mgr := root.Named("manager").With("settle", 250*time.Millisecond)
	mgr.Warn("named", "every", 90*time.Second, "count", 3)
	mgr.Named("ledger").Log(hclog.Debug, "nested", "took", 1500*time.Microsecond)

	want := []map[string]any{
		{"@message": "root", "every": "2s"},
		{"@message": "named", "@module": "manager", "every": "1m30s", "settle": "250ms", "count": float64(3)},
		{"@message": "nested", "@module": "manager.ledger", "took": "1.5ms", "settle": "250ms"},
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != len(want) {
		t.Fatalf("%d lines, want %d:\n%s", len(lines), len(want), buf.String())
	}
	for i, l := range lines {
		var got map[string]any
		if err := json.Unmarshal([]byte(l), &got); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		for k, v := range want[i] {
			if got[k] != v {
				t.Errorf("line %d %s = %#v, want %#v (%s)", i+1, k, got[k], v, l)
			}
		}
	}
}
