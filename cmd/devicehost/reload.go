package main

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"

	"github.com/hashicorp/go-hclog"
)

// reloadHook is how serveAgent re-reads its configuration: apply runs, in serveAgent's
// own goroutine and once its manager runs, for each value from signals (SIGHUP). The
// zero value never reloads.
//
// rejected, when set, reports plugins that rejected the config the running
// configuration gives them: one before the manager is ready is an error of the agent's
// config, which serveAgent stops with; a later one (a plugin added to the plugin dir,
// or restarted) is logged.
type reloadHook struct {
	signals  <-chan os.Signal
	apply    func()
	rejected *rejections
}

// reloader re-reads the agent's configuration on SIGHUP: the command line again (so the
// flags given keep winning over the file), the config file, and -dev's settings. What
// can change live is applied: the plugin blocks (through the manager's SetPlugins),
// log_level (on the root logger, so every logger named from it follows) and max_procs.
// The rest is logged as needing a restart and left as it runs. A file that does not load is refused
// with the same file:line message as at start, and nothing changes; so is a file whose
// plugin blocks give a plugin a config it rejects (the manager checks each new config
// before it stops the running plugin for it).
//
// Used from serveAgent's goroutine only.
type reloader struct {
	env    *cmdEnv
	args   []string // the agent's command line
	devDir string   // -dev's temporary dir; "" without -dev
	log    hclog.Logger
	cur    agentConfig // the running configuration
	// setPlugins hands plugin blocks, and where they are in the file, to the running
	// manager: realManager.setPlugins. A *pluginConfigRejected refuses the reload.
	setPlugins func(agentConfig, pluginBlocks) error
}

// reload re-reads the configuration and applies it to the running manager.
func (r *reloader) reload() {
	r.log.Info("SIGHUP: re-reading the configuration")
	a, err := parseAgentArgs(r.env, r.args)
	if err != nil {
		r.log.Error("configuration reload refused; the running configuration is kept", "error", err.Error())
		return
	}
	next := a.cfg
	if r.devDir != "" {
		devConfig(&next, a.set, r.devDir)
	}
	running := r.cur

	// The new level first, so that plugins restarted for their new settings log at it.
	if next.LogLevel != running.LogLevel {
		r.log.SetLevel(hclog.LevelFromString(next.LogLevel))
	}
	err = r.setPlugins(next, a.blocks)
	var rejected *pluginConfigRejected
	if errors.As(err, &rejected) {
		// A plugin rejected its new config: the file is refused as a whole, as one that
		// does not load is, and nothing has changed (the plugins still run).
		r.log.SetLevel(hclog.LevelFromString(running.LogLevel))
		r.log.Error("configuration reload refused; the running configuration is kept", "error", err.Error())
		return
	}
	if next.LogLevel != running.LogLevel {
		r.log.Info("log level changed", "from", running.LogLevel, "to", next.LogLevel)
		running.LogLevel = next.LogLevel
	}
	if next.MaxProcs != running.MaxProcs {
		inForce := logMaxProcs(r.log, next.MaxProcs)
		r.log.Info("max_procs changed", "from", running.MaxProcs, "to", next.MaxProcs, "gomaxprocs", inForce)
		running.MaxProcs = next.MaxProcs
	}
	if err != nil {
		r.log.Error("plugin settings not applied; the running ones are kept", "error", err)
	} else {
		running.Plugins = next.Plugins
	}
	r.cur = running

	restart := restartOnly(running, next)
	if len(restart) > 0 {
		r.log.Warn("configuration changes that need an agent restart are ignored until then", "settings", strings.Join(restart, ", "))
	}
	r.log.Info("configuration reloaded", "plugins", strings.Join(slices.Sorted(maps.Keys(running.Plugins)), ", "), "needs_restart", strings.Join(restart, ", "))
}

// restartOnly names the settings, by their config file keys, that differ between the
// running configuration and next and cannot change without a restart.
func restartOnly(running, next agentConfig) []string {
	var out []string
	check := func(key string, a, b any) {
		if fmt.Sprint(a) != fmt.Sprint(b) {
			out = append(out, key)
		}
	}
	check("listen", running.Listen, next.Listen)
	check("plugin_dir", running.PluginDir, next.PluginDir)
	check("state_dir", running.StateDir, next.StateDir)
	check("log_json", running.LogJSON, next.LogJSON)
	check("tls_cert", running.TLS.Cert, next.TLS.Cert)
	check("tls_key", running.TLS.Key, next.TLS.Key)
	check("tls_ca", running.TLS.CA, next.TLS.CA)
	check("insecure", running.TLS.Insecure, next.TLS.Insecure)
	check("stats_interval", running.StatsInterval, next.StatsInterval)
	check("reserve_timeout", running.ReserveTimeout, next.ReserveTimeout)
	check("start_timeout", running.StartTimeout, next.StartTimeout)
	check("ready_timeout", running.ReadyTimeout, next.ReadyTimeout)
	check("gc_interval", running.GCInterval, next.GCInterval)
	check("gc_max_reservations", running.GCMaxReservations, next.GCMaxReservations)
	check("gc_parallel_destroys", running.GCParallelDestroys, next.GCParallelDestroys)
	check("event_max_count", running.EventMaxCount, next.EventMaxCount)
	check("event_max_age", running.EventMaxAge, next.EventMaxAge)
	check("max_streams", running.MaxStreams, next.MaxStreams)
	check("max_streams_per_connection", running.MaxStreamsPerConn, next.MaxStreamsPerConn)
	check("metrics_listen", running.MetricsListen, next.MetricsListen)
	check("metrics_tls_cert", running.MetricsTLS.Cert, next.MetricsTLS.Cert)
	check("metrics_tls_key", running.MetricsTLS.Key, next.MetricsTLS.Key)
	check("metrics_tls_ca", running.MetricsTLS.CA, next.MetricsTLS.CA)
	check("metrics_holder_labels", running.MetricsHolderLabels, next.MetricsHolderLabels)
	check("listener", running.Listeners, next.Listeners)
	check("grant", grantsText(running.Grants), grantsText(next.Grants))
	return out
}

// grantsText renders grant blocks by value, for comparing them.
func grantsText(gs []grantSettings) []string {
	var out []string
	for _, g := range gs {
		id := "identity=" + g.Identity
		switch {
		case g.UID != nil:
			id = fmt.Sprintf("uid=%d", *g.UID)
		case g.GID != nil:
			id = fmt.Sprintf("gid=%d", *g.GID)
		}
		out = append(out, id+" "+strings.Join(g.Allow, ","))
	}
	return out
}
