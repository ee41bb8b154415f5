// Package logtest records what a logger or a process writes, line by line, for tests
// to read and wait on. Tests in all three modules use it (root, integrations/nomad,
// integrations/dra); it imports only the standard library.
package logtest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"sync"
)

// Recorder is an io.Writer that keeps everything written to it: the Output of an
// hclog logger (which writes one line per Write), or a process's output through
// Consume. The zero value is ready to use; a Recorder is safe for concurrent use, and
// its readers never block its writers for longer than a copy.
type Recorder struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	changed chan struct{} // closed by the next Write; nil until someone waits
}

// Write keeps p. It never fails.
func (r *Recorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.buf.Write(p)
	if r.changed != nil {
		close(r.changed)
		r.changed = nil
	}
	return len(p), nil
}

// Consume writes the lines read from rd, each with its newline, until rd ends. A
// process's pipe goes through it, so that a reader never sees half a line.
func (r *Recorder) Consume(rd io.Reader) {
	sc := bufio.NewScanner(rd)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		r.Write([]byte(sc.Text() + "\n"))
	}
}

// String is everything written so far.
func (r *Recorder) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.buf.String()
}

// Lines returns the non-empty lines written so far, without their newlines.
func (r *Recorder) Lines() []string {
	var out []string
	for l := range strings.Lines(r.String()) {
		if l = strings.TrimSuffix(l, "\n"); l != "" {
			out = append(out, l)
		}
	}
	return out
}

// JSON decodes each line written so far as a JSON object, as hclog's JSONFormat
// writes them; it fails on the first line that is not one.
func (r *Recorder) JSON() ([]map[string]any, error) {
	var out []map[string]any
	for _, l := range r.Lines() {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			return out, fmt.Errorf("log line %q: %w", l, err)
		}
		out = append(out, m)
	}
	return out, nil
}

// Count is how many times substr was written (strings.Count of everything so far).
func (r *Recorder) Count(substr string) int { return strings.Count(r.String(), substr) }

// Changed returns a channel that the next Write closes.
func (r *Recorder) Changed() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.changed == nil {
		r.changed = make(chan struct{})
	}
	return r.changed
}

// Wait returns the first line that match accepts, waiting for it until ctx ends; then
// its error wraps ctx's cause.
func (r *Recorder) Wait(ctx context.Context, match func(line string) bool) (string, error) {
	for {
		changed := r.Changed()
		for _, l := range r.Lines() {
			if match(l) {
				return l, nil
			}
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return "", fmt.Errorf("no such line written: %w", context.Cause(ctx))
		}
	}
}

// Containing returns a match for Wait that accepts a line holding every one of subs.
func Containing(subs ...string) func(line string) bool {
	return func(line string) bool {
		for _, s := range subs {
			if !strings.Contains(line, s) {
				return false
			}
		}
		return true
	}
}
