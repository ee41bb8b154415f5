package pluginloader

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/time/rate"

	"github.com/devicehost/devicehost/textline"
)

// Defaults of LogLimit.
const (
	DefaultLogRate        = 100              // lines per second
	DefaultLogBurst       = 1000             // lines
	DefaultLogReportEvery = 10 * time.Second // at most one "lines dropped" warning per plugin per this
)

// maxLogLine is how much of one plugin log line is kept; the rest is cut off (and
// counted in the line's "truncated_bytes" field).
const maxLogLine = 16 << 10

// LogLimit bounds how many of a plugin's log lines reach the host's log: a token bucket
// per plugin of Rate lines per second and Burst lines. Lines below the host's level do
// not count. A line over the limit is dropped; the count of dropped lines is reported
// once per ReportEvery at WARN, by the host's logger ("plugin NAME: N log lines dropped
// (rate limit R/s, burst B)"), and once more when the plugin is killed. Zero fields
// mean the defaults.
type LogLimit struct {
	Rate        float64
	Burst       int
	ReportEvery time.Duration
}

func (l LogLimit) withDefaults() LogLimit {
	if l.Rate <= 0 {
		l.Rate = DefaultLogRate
	}
	if l.Burst <= 0 {
		l.Burst = DefaultLogBurst
	}
	if l.ReportEvery <= 0 {
		l.ReportEvery = DefaultLogReportEvery
	}
	return l
}

// pluginLog turns a plugin's stderr into host log lines. It is go-plugin's
// ClientConfig.Stderr, which receives the plugin's stderr unparsed (go-plugin writes
// each line, then "\n"); go-plugin's own parsing is switched off (see pluginLogger),
// because it writes the plugin's message raw into the host's log and panics on an
// hclog JSON line whose "@message" is not a string.
//
// Each line is parsed as an hclog JSON line ("@level", "@message", "@timestamp", other
// keys as fields) or, failing that, taken as text whose level is guessed from a
// "[LEVEL]" prefix (DEBUG otherwise; ERROR from a "panic: " line on). Control
// characters in the message and in field keys and values are escaped (textline.Escape),
// so a plugin cannot start a line of its own in the host's log. Lines are rate-limited
// per LogLimit.
//
// Write is called by go-plugin's one stderr goroutine; close by Kill once that goroutine
// has ended. All methods are safe for concurrent use.
type pluginLog struct {
	name  string
	log   hclog.Logger // named after the plugin: the plugin's lines
	host  hclog.Logger // the host's logger: our reports about the plugin
	limit LogLimit
	lim   *rate.Limiter

	mu       sync.Mutex
	line     []byte // the line being received, at most maxLogLine bytes
	cut      int    // bytes of it dropped past maxLogLine
	inPanic  bool
	dropped  int
	report   *time.Timer // pending "lines dropped" report; nil when none
	closed   bool
	cookie   bool // the plugin printed go-plugin's "wrong magic cookie" note
	reportWG sync.WaitGroup
}

func newPluginLog(name string, host hclog.Logger, limit LogLimit) *pluginLog {
	limit = limit.withDefaults()
	return &pluginLog{
		name:  name,
		log:   host.Named(name),
		host:  host,
		limit: limit,
		lim:   rate.NewLimiter(rate.Limit(limit.Rate), limit.Burst),
	}
}

// Write takes a chunk of the plugin's stderr. It never fails: what cannot be logged is
// dropped, so the plugin is never blocked on its stderr.
func (l *pluginLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		chunk := p
		if i >= 0 {
			chunk = p[:i]
		}
		room := maxLogLine - len(l.line)
		if len(chunk) > room {
			l.line = append(l.line, chunk[:room]...)
			l.cut += len(chunk) - room
		} else {
			l.line = append(l.line, chunk...)
		}
		if i < 0 {
			break
		}
		l.handleLine()
		p = p[i+1:]
	}
	return n, nil
}

// handleLine logs l.line and resets it. Called with l.mu held.
func (l *pluginLog) handleLine() {
	line, cut := l.line, l.cut
	l.line, l.cut = l.line[:0], 0
	if len(line) == 0 && cut == 0 {
		return
	}
	if bytes.HasPrefix(line, []byte(cookieNote)) {
		l.cookie = true
	}

	entry, isJSON := parseLevel(line)
	if !isJSON {
		entry.level = l.textLevel(line)
	}
	if entry.level < l.log.GetLevel() {
		return // the host would not print it: it costs no token
	}
	if !l.lim.Allow() {
		l.dropped++
		l.scheduleReport()
		return
	}

	var msg string
	var args []any
	if isJSON && entry.level != hclog.NoLevel {
		msg, args = parseEntry(line)
	} else {
		if entry.level == hclog.NoLevel {
			entry.level = hclog.Debug // JSON from something other than hclog: logged as it is
		}
		msg = string(line)
	}
	if cut > 0 {
		args = append(args, "truncated_bytes", cut)
	}
	l.log.Log(entry.level, textline.Escape(msg, 0), args...)
}

// cookieNote starts what go-plugin's Serve prints on stderr (then exits 1) when the
// host's magic cookie is not the one the plugin was built with.
const cookieNote = "This binary is a plugin. These are not meant to be executed directly."

// textLevel guesses the level of a line that is not hclog JSON, as go-plugin does.
func (l *pluginLog) textLevel(line []byte) hclog.Level {
	for _, p := range []struct {
		prefix string
		level  hclog.Level
	}{{"[TRACE]", hclog.Trace}, {"[DEBUG]", hclog.Debug}, {"[INFO]", hclog.Info}, {"[WARN]", hclog.Warn}, {"[ERROR]", hclog.Error}} {
		if bytes.HasPrefix(line, []byte(p.prefix)) {
			return p.level
		}
	}
	if bytes.HasPrefix(line, []byte("panic: ")) || bytes.HasPrefix(line, []byte("fatal error: ")) {
		l.inPanic = true // the rest of the stack trace is ERROR too
	}
	if l.inPanic {
		return hclog.Error
	}
	return hclog.Debug
}

// levelOnly is the part of an hclog JSON line decoded before the rate limit.
type levelOnly struct {
	level hclog.Level
}

// parseLevel reads the level of an hclog JSON line; isJSON is false for anything that
// is not a JSON object. A JSON object without a known "@level" has hclog.NoLevel.
func parseLevel(line []byte) (e levelOnly, isJSON bool) {
	if len(line) == 0 || line[0] != '{' {
		return e, false
	}
	var v struct {
		Level any `json:"@level"`
	}
	if err := json.Unmarshal(line, &v); err != nil {
		return e, false
	}
	s, _ := v.Level.(string)
	return levelOnly{level: hclog.LevelFromString(s)}, true
}

// parseEntry splits an hclog JSON line (already known to be valid) into its message
// and its fields, sorted by key. Values that are not strings, numbers or bools (lists,
// objects, null) become their JSON text. Other keys that start with "@" get a "_" in
// front: in a JSON host log they would replace the host's own "@module" or "@caller". A
// "@timestamp" in hclog's format becomes the field "timestamp", as go-plugin does.
func parseEntry(line []byte) (string, []any) {
	var raw map[string]any
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil {
		return string(line), nil
	}
	msg, ok := raw["@message"].(string)
	if !ok && raw["@message"] != nil {
		msg = jsonText(raw["@message"])
	}
	ts, _ := raw["@timestamp"].(string)
	delete(raw, "@message")
	delete(raw, "@level")
	delete(raw, "@timestamp")

	keys := make([]string, 0, len(raw))
	for k := range raw {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	args := make([]any, 0, 2*len(keys)+2)
	for _, k := range keys {
		var v any
		switch x := raw[k].(type) {
		case string:
			v = textline.Escape(x, 0)
		case json.Number:
			v = x
		case bool:
			v = x
		default:
			v = textline.Escape(jsonText(x), 0)
		}
		if strings.HasPrefix(k, "@") {
			k = "_" + k // "@module", "@level"...: a field must not pass for the host's own
		}
		args = append(args, textline.Escape(k, 0), v)
	}
	if t, err := time.Parse("2006-01-02T15:04:05.000000Z07:00", ts); err == nil {
		args = append(args, "timestamp", t.Format(hclog.TimeFormat))
	}
	return msg, args
}

func jsonText(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// scheduleReport arranges for the dropped count to be reported at the end of the
// current interval. Called with l.mu held.
func (l *pluginLog) scheduleReport() {
	if l.report != nil || l.closed {
		return
	}
	l.reportWG.Add(1)
	l.report = time.AfterFunc(l.limit.ReportEvery, func() {
		defer l.reportWG.Done()
		l.mu.Lock()
		n := l.takeDropped()
		l.mu.Unlock()
		l.reportDropped(n)
	})
}

// takeDropped returns and resets the dropped count. Called with l.mu held.
func (l *pluginLog) takeDropped() int {
	n := l.dropped
	l.dropped, l.report = 0, nil
	return n
}

func (l *pluginLog) reportDropped(n int) {
	if n == 0 {
		return
	}
	l.host.Warn(fmt.Sprintf("plugin %s: %d log lines dropped (rate limit %s/s, burst %d)",
		l.name, n, strconv.FormatFloat(l.limit.Rate, 'g', -1, 64), l.limit.Burst),
		"plugin", l.name, "dropped", n)
}

// close logs a last line without a newline, reports what was dropped and stops the
// report timer; it returns once no report is running. Later writes are still logged,
// but their drops are not reported.
func (l *pluginLog) close() {
	l.mu.Lock()
	if len(l.line) > 0 || l.cut > 0 {
		l.handleLine()
	}
	l.closed = true
	if l.report != nil && l.report.Stop() {
		l.reportWG.Done() // the report will not run
	}
	n := l.takeDropped()
	l.mu.Unlock()
	l.reportDropped(n)
	l.reportWG.Wait()
}

// sawCookieNote reports whether the plugin printed go-plugin's wrong-cookie note.
func (l *pluginLog) sawCookieNote() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cookie
}
