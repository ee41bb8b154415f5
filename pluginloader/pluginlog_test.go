package pluginloader_test

import (
	"context"
	"encoding/json"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
	"github.com/devicehost/devicehost/tools/logtest"
)

const (
	forgedLine = "2026-01-01T00:00:00.000Z [ERROR] manager: forged"
	endMarker  = "[INFO] fixture: end of test lines"
)

// hostileLines are log lines a hostile plugin writes on its stderr: newlines and
// terminal escapes in the message, in field keys and in values, fields named like the
// host's own, and hclog JSON of the wrong types (which made go-plugin's parser panic,
// taking the host down).
var hostileLines = []string{
	`{"@level":"info","@message":"key","x\n` + forgedLine + `-key":"v"}`,
	`{"@level":"info","@message":"value","v":"a\r` + forgedLine + `-cr\u001b[2J"}`,
	`{"@level":"info","@message":"list","l":["a\n` + forgedLine + `-list"],"o":{"k\n":"v"}}`,
	`{"@level":"info","@message":"module","@module":"manager","@caller":"manager.go:1"}`,
	"[WARN] text line\x1b]0;title\x07 with \u202e bidi",
	endMarker,
}

func TestPluginLogCannotForgeHostLines(t *testing.T) {
	cfg := fixtureplugin.Config{
		LogInfo: "hello\n" + forgedLine + "\r\x1b[31m",
		LogRaw:  hostileLines,
	}

	t.Run("text host", func(t *testing.T) {
		logs := &logtest.Recorder{}
		host := hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Info, Output: logs})
		launchFixture(t, cfg, pluginloader.Options{Logger: host})
		if _, err := logs.Wait(waitContext(t), logtest.Containing("end of test lines")); err != nil {
			t.Fatalf("%v; log:\n%s", err, logs)
		}
		out := logs.String()
		for line := range strings.Lines(out) {
			if strings.HasPrefix(line, "2026-01-01") || strings.Contains(line, "manager: forged") && !strings.Contains(line, `\n`) && !strings.Contains(line, `\r`) {
				t.Errorf("a plugin forged a host log line: %q", line)
			}
		}
		for _, c := range []string{"\r", "\x1b", "\x07", "\u202e"} {
			if strings.Contains(out, c) {
				t.Errorf("host log holds the raw character %q from a plugin:\n%s", c, out)
			}
		}
		// The plugin's message is kept, escaped, on its own line.
		want := `[INFO]  host.fixture: hello\n` + forgedLine + `\r\x1b[31m`
		if !strings.Contains(out, want) {
			t.Errorf("host log has no line with %q:\n%s", want, out)
		}
		if want := `[WARN]  host.fixture: [WARN] text line\x1b]0;title\a with \u202e bidi`; !strings.Contains(out, want) {
			t.Errorf("host log does not hold the escaped text line:\n%s", out)
		}
	})

	t.Run("JSON host", func(t *testing.T) {
		logs := &logtest.Recorder{}
		host := hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Info, Output: logs, JSONFormat: true})
		launchFixture(t, cfg, pluginloader.Options{Logger: host})
		if _, err := logs.Wait(waitContext(t), logtest.Containing("end of test lines")); err != nil {
			t.Fatalf("%v; log:\n%s", err, logs)
		}
		for line := range strings.Lines(logs.String()) {
			var entry map[string]any
			if err := json.Unmarshal([]byte(line), &entry); err != nil {
				t.Errorf("host log line is not JSON: %v: %q", err, line)
				continue
			}
			if entry["@module"] != "host.fixture" && entry["@module"] != "host" {
				t.Errorf("a plugin line claims module %v: %q", entry["@module"], line)
			}
			if _, ok := entry["@caller"]; ok {
				t.Errorf("a plugin line claims a caller: %q", line)
			}
		}
	})
}

var droppedRe = regexp.MustCompile(`plugin fixture: (\d+) log lines dropped \(rate limit 50/s, burst 100\)`)

// TestPluginLogRateLimit: a plugin that logs 20,000 lines at once gets about its burst
// and rate into the host's log; the rest is counted and reported at WARN, so that the
// lines logged and the lines reported dropped add up to what the plugin sent.
func TestPluginLogRateLimit(t *testing.T) {
	const flood = 20000
	limit := pluginloader.LogLimit{Rate: 50, Burst: 100, ReportEvery: 100 * time.Millisecond}
	logs := &logtest.Recorder{}
	host := hclog.New(&hclog.LoggerOptions{Name: "host", Level: hclog.Info, Output: logs})

	start := time.Now()
	p, err := pluginloader.Launch(testContext(t), fixtureBinary(), pluginloader.Options{
		Logger: host, LogLimit: limit, ConfigJSON: fixtureplugin.Config{LogFlood: flood}.JSON(),
	})
	if err != nil {
		t.Fatalf("Launch: %v", err)
	}
	// The plugin wrote every line before SetConfig answered; Kill returns once the
	// host has read them all, and reports the drops not reported yet.
	p.Kill(context.Background())
	elapsed := time.Since(start)

	out := logs.String()
	logged := strings.Count(out, "host.fixture: fixture: flood line ")
	dropped, reports := 0, 0
	for _, m := range droppedRe.FindAllStringSubmatch(out, -1) {
		n, _ := strconv.Atoi(m[1])
		dropped += n
		reports++
	}
	t.Logf("%d lines: %d logged, %d dropped in %d reports, in %v", flood, logged, dropped, reports, elapsed)

	if max := limit.Burst + int(limit.Rate*elapsed.Seconds()) + 1; logged > max {
		t.Errorf("%d flood lines reached the host log in %v, want at most burst + rate x time = %d", logged, elapsed, max)
	}
	if logged < limit.Burst {
		t.Errorf("%d flood lines logged, want at least the burst (%d)", logged, limit.Burst)
	}
	if logged+dropped != flood {
		t.Errorf("logged %d + reported dropped %d = %d, want the %d lines the plugin sent", logged, dropped, logged+dropped, flood)
	}
	if max := int(elapsed/limit.ReportEvery) + 2; reports == 0 || reports > max {
		t.Errorf("%d drop reports in %v, want 1 to %d (one per %v, and one at Kill)", reports, elapsed, max, limit.ReportEvery)
	}
	if !strings.Contains(out, "[WARN]  host: plugin fixture: ") {
		t.Errorf("the drop report is not a WARN of the host's logger:\n%s", firstLines(out, droppedRe))
	}
}

// firstLines returns the lines of out that match re, for an error message.
func firstLines(out string, re *regexp.Regexp) string {
	var b strings.Builder
	for line := range strings.Lines(out) {
		if re.MatchString(line) {
			b.WriteString(line)
		}
	}
	return b.String()
}
