package pluginloader

import (
	"bytes"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
)

// go-plugin's own lines reach the host's log until Kill returns, through every logger
// it derives (Named for its stdio reader and stderr, With), and none after: its stdio
// reader outlives Kill and logs the connection's end, when the caller may already have
// closed the log's sink.
func TestGoPluginLinesStopWhenKillReturns(t *testing.T) {
	var buf bytes.Buffer
	p := &Plugin{}
	var l hclog.Logger = pluginLogger{
		Logger:   hclog.New(&hclog.LoggerOptions{Output: &buf, Level: hclog.Trace}),
		stopping: &p.stopping,
		gate:     &p.goLog,
	}
	derived := map[string]hclog.Logger{
		"root":       l,
		"stdio":      l.Named("stdio"),
		"with":       l.With("k", "v"),
		"named-with": l.Named("stderr").With("k", "v"),
	}
	for name, d := range derived {
		d.Debug("before " + name)
		if !strings.Contains(buf.String(), "before "+name) {
			t.Errorf("%s: a line before Kill is missing: %q", name, buf.String())
		}
	}
	if lv := derived["named-with"].GetLevel(); lv != hclog.Off {
		t.Errorf("the stderr reader's logger has level %s after With, want off (go-plugin would parse stderr twice)", lv)
	}
	p.goLog.close()
	before := buf.String()
	for name, d := range derived {
		d.Trace("after " + name)
		d.Debug("after " + name)
		d.Info("after " + name)
		d.Warn("after " + name)
		d.Error("after " + name)
		d.Log(hclog.Error, "after "+name)
	}
	if buf.String() != before {
		t.Errorf("lines written after Kill returned: %q", strings.TrimPrefix(buf.String(), before))
	}
}
