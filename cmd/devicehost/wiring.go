package main

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/hcl/v2"

	"github.com/devicehost/devicehost/device"
	"github.com/devicehost/devicehost/manager"
	"github.com/devicehost/devicehost/pluginloader"
)

// realManager wires the agent to the real device manager: factory builds it for the
// agent's configuration, and setPlugins hands a reload's plugin blocks to the one it
// built, which is what a reload needs of it beyond device.Manager. This is the only
// place the agent depends on package manager; the rest speaks device.Manager, so tests
// run the agent on a fake. Used from serveAgent's goroutine only: it calls factory at
// start and a reload's setPlugins between its other events.
//
// The manager reports a plugin that rejects its config (manager.Config.OnConfigRejected)
// to rejected, as a config error naming the plugin's block; serveAgent decides what it
// means (at start, the agent exits with it). That report comes from the manager's
// goroutines: it reads the plugin settings in force under mu.
type realManager struct {
	cfg      agentConfig
	onCommit func(time.Duration, int) // told of every ledger commit when set (the metrics' ObserveLedgerCommit)
	rejected *rejections              // where rejected configs are reported; nil: logged by the manager
	built    *manager.Manager         // what factory built; nil before

	mu     sync.Mutex   // guards blocks and cfg.Plugins once factory has returned
	blocks pluginBlocks // where the plugin blocks in force are in the config file
}

// factory is a device.Factory of the real manager.
func (r *realManager) factory(log hclog.Logger) (device.Manager, error) {
	var onRejected func(*manager.ConfigRejectedError)
	if r.rejected != nil {
		onRejected = func(e *manager.ConfigRejectedError) {
			r.mu.Lock()
			err := rejectedConfigError(r.blocks, r.cfg.Plugins, []*manager.ConfigRejectedError{e})
			r.mu.Unlock()
			r.rejected.add(err)
		}
	}
	m, err := newManager(r.cfg, log, r.onCommit, onRejected)
	if err != nil {
		return nil, err
	}
	r.built = m
	return m, nil
}

// setPlugins hands cfg's plugin blocks, found in the config file at blocks, to the
// manager factory built (see manager.SetPlugins). New configs the plugins reject are a
// *pluginConfigRejected naming the blocks, and nothing changes.
func (r *realManager) setPlugins(cfg agentConfig, blocks pluginBlocks) error {
	if r.built == nil {
		return errors.New("the device manager has not started")
	}
	err := r.built.SetPlugins(pluginConfigs(cfg))
	if rej := configRejections(err); len(rej) > 0 {
		return &pluginConfigRejected{rejectedConfigError(blocks, cfg.Plugins, rej)}
	}
	if err == nil {
		r.mu.Lock()
		r.blocks = blocks
		r.cfg.Plugins = cfg.Plugins
		r.mu.Unlock()
	}
	return err
}

// pluginConfigRejected is a config that plugins rejected, said as the agent's own config
// errors are.
type pluginConfigRejected struct{ error }

func (e *pluginConfigRejected) Unwrap() error { return e.error }

// configRejections are the *manager.ConfigRejectedError in err, a join of errors.
func configRejections(err error) []*manager.ConfigRejectedError {
	var out []*manager.ConfigRejectedError
	var rej *manager.ConfigRejectedError
	switch e := err.(type) {
	case nil:
	case interface{ Unwrap() []error }:
		for _, e := range e.Unwrap() {
			out = append(out, configRejections(e)...)
		}
	default:
		if errors.As(err, &rej) {
			out = append(out, rej)
		}
	}
	return out
}

// rejectedConfigError says that plugins rejected their config as the agent's own config
// errors are: "FILE:LINE,COL: Plugin config rejected; plugin "NAME": MESSAGE", with the
// plugin block's place in the file (blocks) and the plugin's own message. A plugin
// with no block in the file (-dev's default block, or none: a plugin of the plugin dir
// that needs a config) is named without a place.
func rejectedConfigError(blocks pluginBlocks, plugins map[string]pluginSettings, rej []*manager.ConfigRejectedError) error {
	var diags hcl.Diagnostics
	var path string
	var errs []error
	for _, r := range rej {
		msg := r.Err.Error()
		var ce *pluginloader.ConfigError
		if errors.As(r.Err, &ce) {
			msg = ce.Message
		}
		block, inFile := blocks[r.Plugin]
		switch _, configured := plugins[r.Plugin]; {
		case inFile:
			path = block.Filename
			subject := block
			if key, ok := configKeyRange(block.Filename, r.Plugin, msg); ok {
				subject = key // the key the plugin's message names
			}
			diags = append(diags, &hcl.Diagnostic{
				Severity: hcl.DiagError,
				Summary:  "Plugin config rejected",
				Detail:   fmt.Sprintf("plugin %q: %s", r.Plugin, msg),
				Subject:  subject.Ptr(),
			})
		case configured:
			errs = append(errs, fmt.Errorf("plugin %q rejected its config: %s", r.Plugin, msg))
		default:
			errs = append(errs, fmt.Errorf("plugin %q rejected its config (it has no plugin block; give it one with the config it needs): %s", r.Plugin, msg))
		}
	}
	if len(diags) > 0 {
		errs = append([]error{diagError(path, diags)}, errs...)
	}
	return errors.Join(errs...)
}

// configKeyRange finds where, in file, the config block of plugin's block sets the key
// a plugin's rejection msg names ("config: replicas = 99: want 2 to 64"): of the block's
// keys found in msg as words, the one named first (the longest where several start
// there). ok is false when msg names none of them, or the file no longer parses.
func configKeyRange(file, plugin, msg string) (hcl.Range, bool) {
	var fs fileSchema
	if _, err := decodeConfigFile(file, &fs); err != nil {
		return hcl.Range{}, false
	}
	for _, p := range fs.Plugins {
		if p.Name != plugin || p.Config == nil {
			continue
		}
		attrs, _ := p.Config.Body.JustAttributes()
		var found hcl.Range
		at, longest := -1, 0
		for name, a := range attrs {
			i := wordIndex(msg, name)
			if i >= 0 && (at < 0 || i < at || i == at && len(name) > longest) {
				found, at, longest = a.NameRange, i, len(name)
			}
		}
		return found, at >= 0
	}
	return hcl.Range{}, false
}

// wordIndex is the index of the first occurrence of word in s that is not part of a
// longer name (letters, digits, "_" around it), or -1.
func wordIndex(s, word string) int {
	isName := func(c byte) bool {
		return c == '_' || '0' <= c && c <= '9' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
	}
	for off := 0; ; {
		i := strings.Index(s[off:], word)
		if i < 0 {
			return -1
		}
		i += off
		end := i + len(word)
		if (i == 0 || !isName(s[i-1])) && (end == len(s) || !isName(s[end])) {
			return i
		}
		off = i + 1
	}
}

// rejections collects the errors of configs plugins rejected, reported by the manager
// from its supervisor goroutines, for serveAgent. add never blocks.
type rejections struct {
	mu     sync.Mutex
	errs   []error
	notify chan struct{} // buffer 1: a value means errs may hold some
}

func newRejections() *rejections { return &rejections{notify: make(chan struct{}, 1)} }

func (r *rejections) add(err error) {
	r.mu.Lock()
	r.errs = append(r.errs, err)
	r.mu.Unlock()
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// ready is a channel that has a value when take has errors to return; nil for a nil r,
// which never has any.
func (r *rejections) ready() <-chan struct{} {
	if r == nil {
		return nil
	}
	return r.notify
}

// take returns the errors added since the last take; none for a nil r.
func (r *rejections) take() []error {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	errs := r.errs
	r.errs = nil
	return errs
}

// pluginConfigs maps the config file's plugin blocks onto the manager's settings.
func pluginConfigs(cfg agentConfig) map[string]manager.PluginConfig {
	out := make(map[string]manager.PluginConfig, len(cfg.Plugins))
	for name, p := range cfg.Plugins {
		out[name] = manager.PluginConfig{
			ConfigJSON: p.ConfigJSON,
			SHA256:     p.SHA256,
			Env:        p.Env,
			InheritEnv: p.InheritEnv,
			Reattach:   p.Reattach,
			DeviceIDs:  p.DeviceIDs,
		}
	}
	return out
}

// newManager builds the real device manager. log is the root logger: the manager names
// its own lines "manager" and each plugin's after the plugin.
func newManager(cfg agentConfig, log hclog.Logger, onCommit func(time.Duration, int), onRejected func(*manager.ConfigRejectedError)) (*manager.Manager, error) {
	mc := manager.Config{
		Logger:           log,
		OnLedgerCommit:   onCommit,
		OnConfigRejected: onRejected,
		PluginDir:        cfg.PluginDir,
		StateDir:         cfg.StateDir,
		StatsInterval:    cfg.StatsInterval,
		ReserveTimeout:   cfg.ReserveTimeout,
		StartTimeout:     cfg.StartTimeout,
		ReadyTimeout:     cfg.ReadyTimeout,

		GCInterval:         cfg.GCInterval,
		GCMaxReservations:  cfg.GCMaxReservations,
		GCParallelDestroys: cfg.GCParallelDestroys,
		MaxEvents:          cfg.EventMaxCount,
		MaxEventAge:        cfg.EventMaxAge,

		Plugins: pluginConfigs(cfg),
	}
	if len(cfg.Bundled) > 0 {
		self, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("find this executable to run bundled plugins: %w", err)
		}
		for _, name := range cfg.Bundled {
			mc.Binaries = append(mc.Binaries, pluginloader.Binary{
				Name: name,
				Path: self,
				Args: []string{"plugin", name},
			})
		}
	}
	m, err := manager.New(mc)
	if errors.Is(err, manager.ErrNoPluginDir) {
		return nil, fmt.Errorf("plugin_dir %s (-plugin-dir) does not exist: create it, or set plugin_dir in the config file or -plugin-dir to the directory of the plugin executables", cfg.PluginDir)
	}
	return m, err
}
