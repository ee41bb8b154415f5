package manager

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/devicehost/devicehost/manager/supervise"
	"github.com/devicehost/devicehost/pluginloader"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

// This file is the in-process harness for the fixture plugin (tools/fixtureplugin):
// each launch is a fresh fixture configured by the plugin's ConfigJSON, served over
// go-plugin's in-process test connection, so tests of hostile plugins can run many of them cheaply.

// fixtureProc is one in-process fixture "process".
type fixtureProc struct {
	*inproc
	fx *fixtureplugin.Plugin
}

// Kill stops the fixture's exit_after timer, then the "process".
func (p *fixtureProc) Kill(ctx context.Context) {
	p.fx.Stop()
	p.inproc.Kill(ctx)
}

// fixtureLauncher launches in-process fixtures. Safe for concurrent use.
type fixtureLauncher struct {
	t        testing.TB // the test the fixtures are served for
	mu       sync.Mutex
	launches map[string][]*fixtureProc
}

// launch does what pluginloader.Launch does, in-process: start, info, config. The
// fixture's exit_after ends the "process" with "exit status 3".
func (l *fixtureLauncher) launch(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options) (supervise.Plugin, error) {
	fx := fixtureplugin.New()
	fx.Log = hclog.NewNullLogger()
	in, err := startInproc(l.t, fx)
	if err != nil {
		return nil, err
	}
	p := &fixtureProc{inproc: in, fx: fx}
	fx.Exit = func(code int) { in.exit(fmt.Sprintf("exit status %d", code)) }
	if err := in.handshake(ctx, opts.ConfigJSON); err != nil {
		p.Kill(ctx)
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.launches == nil {
		l.launches = make(map[string][]*fixtureProc)
	}
	l.launches[bin.Name] = append(l.launches[bin.Name], p)
	return p, nil
}

// startFixtures starts a manager running the given fixtures in-process and shuts it down
// in t.Cleanup.
func startFixtures(t *testing.T, cfg Config, fixtures ...fixture) (*Manager, *fixtureLauncher) {
	t.Helper()
	l := &fixtureLauncher{t: t}
	m, err := newManager(withFixtures(cfg, fixtures...), l.launch)
	if err != nil {
		t.Fatalf("newManager: %v", err)
	}
	t.Cleanup(func() { shutdown(t, m) })
	return m, l
}
