package main

import (
	"slices"
	"time"

	"github.com/hashicorp/go-hclog"
)

// newLogger is the root logger of a devicehost process (the agent, the kubelet
// bridge), made from opts. It and every logger made from it (Named, With) write a
// time.Duration value as Go writes it ("2s"): hclog's text format does, but its JSON
// format would write the nanoseconds ("every":2000000000).
func newLogger(opts hclog.LoggerOptions) hclog.Logger {
	opts.SubloggerHook = func(sub hclog.Logger) hclog.Logger { return durationText{sub} }
	return durationText{hclog.New(&opts)}
}

// durationText is an hclog.Logger whose time.Duration values are logged as text.
type durationText struct {
	hclog.Logger
}

func (l durationText) Log(level hclog.Level, msg string, args ...any) {
	l.Logger.Log(level, msg, durationsAsText(args)...)
}
func (l durationText) Trace(msg string, args ...any) { l.Logger.Trace(msg, durationsAsText(args)...) }
func (l durationText) Debug(msg string, args ...any) { l.Logger.Debug(msg, durationsAsText(args)...) }
func (l durationText) Info(msg string, args ...any)  { l.Logger.Info(msg, durationsAsText(args)...) }
func (l durationText) Warn(msg string, args ...any)  { l.Logger.Warn(msg, durationsAsText(args)...) }
func (l durationText) Error(msg string, args ...any) { l.Logger.Error(msg, durationsAsText(args)...) }

// With is hclog's With; the logger it returns is a durationText (by the SubloggerHook).
func (l durationText) With(args ...any) hclog.Logger { return l.Logger.With(durationsAsText(args)...) }

// durationsAsText returns args with each time.Duration replaced by its String; args
// itself when there is none.
func durationsAsText(args []any) []any {
	var out []any
	for i, a := range args {
		if d, ok := a.(time.Duration); ok {
			if out == nil {
				out = slices.Clone(args)
			}
			out[i] = d.String()
		}
	}
	if out == nil {
		return args
	}
	return out
}
