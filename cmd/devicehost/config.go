package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/gohcl"
	"github.com/hashicorp/hcl/v2/hclparse"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	"github.com/zclconf/go-cty/cty"
	"github.com/zclconf/go-cty/cty/convert"

	"github.com/devicehost/devicehost/endpoint"
	"github.com/devicehost/devicehost/integrations/kubernetes/hosted"
	"github.com/devicehost/devicehost/internal/idpattern"
	"github.com/devicehost/devicehost/manager"
	"github.com/devicehost/devicehost/server"
	"github.com/devicehost/devicehost/textline"
)

// Defaults of the agent's settings. Durations and counts left zero are the manager's
// defaults.
const (
	defaultPluginDir = "/opt/devicehost/plugins"
	defaultStateDir  = "/var/lib/devicehost"
	defaultLogLevel  = "info"
)

// The least a duration in the config file may be (other than "0s", the default), beside
// stats_interval's, which is the manager's (manager.MinStatsInterval): below these the
// agent cannot do its job (a plugin cannot start or answer in time), so such a value
// stops the agent at load, with the file and line.
const (
	minReserveTimeout = 100 * time.Millisecond
	minStartTimeout   = time.Second
	minGCInterval     = time.Second
)

// agentConfig is the agent's configuration: defaults, then the config file, then flags.
// Zero durations and counts mean the manager's defaults.
type agentConfig struct {
	Listen    string
	PluginDir string
	StateDir  string
	LogLevel  string
	LogJSON   bool
	TLS       endpoint.TLS

	// MetricsListen is where Prometheus metrics are served (HTTP, /metrics); "" means
	// none. MetricsTLS holds its TLS files (Insecure is not used: see metricsTLS).
	MetricsListen string
	MetricsTLS    endpoint.TLS
	// MetricsHolderLabels puts the holder's labels on the dcgm-exporter series of held
	// devices (metrics.Options.NoHolderLabels).
	MetricsHolderLabels bool

	StatsInterval  time.Duration
	ReserveTimeout time.Duration
	StartTimeout   time.Duration
	ReadyTimeout   time.Duration

	// Garbage collection of released reservations.
	GCInterval         time.Duration
	GCMaxReservations  int
	GCParallelDestroys int

	// The audit trail's bounds: events kept (-1: none; zero: the default) and their
	// age (zero: the default).
	EventMaxCount int
	EventMaxAge   time.Duration

	// Fingerprint and Stats streams open at once, in all and per connection; zero means
	// the server's defaults.
	MaxStreams        int
	MaxStreamsPerConn int

	// MaxProcs caps the threads running the agent's Go code at once (GOMAXPROCS): zero
	// leaves it to the Go runtime (the cores, or the container's CPU limit). See
	// applyMaxProcs.
	MaxProcs int

	// Listeners are the API endpoints beside Listen, each with its grants; Grants give
	// peers more than their listener allows. Listen itself is always admin.
	Listeners []listenerSettings
	Grants    []grantSettings

	// Plugins by plugin (binary) name.
	Plugins map[string]pluginSettings
	// Bundled names plugins built into this binary to run by re-executing it
	// (`devicehost plugin <name>`); agent -dev sets it.
	Bundled []string
}

// listenerSettings is one `listener "name" { ... }` block: an API endpoint whose
// clients may do what Allow grants (server.ParseAllow's words).
type listenerSettings struct {
	Name    string
	Address string
	TLS     endpoint.TLS
	Allow   []string
	// Mode is a unix socket's file mode; zero: endpoint.SocketMode (0660).
	Mode os.FileMode
}

// grantSettings is one `grant { ... }` block: what a peer may do on every listener,
// beyond its listener's grants. Exactly one of UID, GID and Identity is set.
type grantSettings struct {
	UID, GID *uint32
	Identity string
	Allow    []string
}

// mainListener names the listener of `listen` in logs and refusals.
const mainListener = "main"

// pluginSettings is one `plugin "name" { ... }` block.
type pluginSettings struct {
	SHA256     string
	Env        []string
	InheritEnv bool
	// Reattach keeps the plugin process across an agent crash (see manager.PluginConfig).
	Reattach bool
	// ConfigJSON is the block's `config { ... }` as a JSON object; nil without one.
	ConfigJSON []byte
	// DeviceIDs pins the device IDs the plugin may report (see manager.PluginConfig).
	DeviceIDs []string
}

// fieldOf is the value of the path setting key (listen, state_dir, plugin_dir).
func (c agentConfig) fieldOf(key string) string {
	switch key {
	case "listen":
		return c.Listen
	case "state_dir":
		return c.StateDir
	case "plugin_dir":
		return c.PluginDir
	}
	return ""
}

func defaultAgentConfig() agentConfig {
	return agentConfig{
		Listen:    endpoint.DefaultAddress,
		PluginDir: defaultPluginDir,
		StateDir:  defaultStateDir,
		LogLevel:  defaultLogLevel,
		Plugins:   map[string]pluginSettings{},
		MaxProcs:  defaultMaxProcs,

		MetricsHolderLabels: true,
	}
}

// fileSchema is the top level of the config file. Every attribute is decoded as an
// *hcl.Attribute (nil when absent) so that a bad value is reported at its own line.
type fileSchema struct {
	Listen             *hcl.Attribute         `hcl:"listen,optional"`
	PluginDir          *hcl.Attribute         `hcl:"plugin_dir,optional"`
	StateDir           *hcl.Attribute         `hcl:"state_dir,optional"`
	StatsInterval      *hcl.Attribute         `hcl:"stats_interval,optional"`
	LogLevel           *hcl.Attribute         `hcl:"log_level,optional"`
	LogJSON            *hcl.Attribute         `hcl:"log_json,optional"`
	ReserveTimeout     *hcl.Attribute         `hcl:"reserve_timeout,optional"`
	StartTimeout       *hcl.Attribute         `hcl:"start_timeout,optional"`
	ReadyTimeout       *hcl.Attribute         `hcl:"ready_timeout,optional"`
	GCInterval         *hcl.Attribute         `hcl:"gc_interval,optional"`
	GCMaxReservations  *hcl.Attribute         `hcl:"gc_max_reservations,optional"`
	GCParallelDestroys *hcl.Attribute         `hcl:"gc_parallel_destroys,optional"`
	EventMaxCount      *hcl.Attribute         `hcl:"event_max_count,optional"`
	EventMaxAge        *hcl.Attribute         `hcl:"event_max_age,optional"`
	MaxStreams         *hcl.Attribute         `hcl:"max_streams,optional"`
	MaxStreamsPerConn  *hcl.Attribute         `hcl:"max_streams_per_connection,optional"`
	MaxProcs           *hcl.Attribute         `hcl:"max_procs,optional"`
	TLSCert            *hcl.Attribute         `hcl:"tls_cert,optional"`
	TLSKey             *hcl.Attribute         `hcl:"tls_key,optional"`
	TLSCA              *hcl.Attribute         `hcl:"tls_ca,optional"`
	Insecure           *hcl.Attribute         `hcl:"insecure,optional"`
	MetricsListen      *hcl.Attribute         `hcl:"metrics_listen,optional"`
	MetricsTLSCert     *hcl.Attribute         `hcl:"metrics_tls_cert,optional"`
	MetricsTLSKey      *hcl.Attribute         `hcl:"metrics_tls_key,optional"`
	MetricsTLSCA       *hcl.Attribute         `hcl:"metrics_tls_ca,optional"`
	MetricsHolderLabel *hcl.Attribute         `hcl:"metrics_holder_labels,optional"`
	Plugins            []pluginSchema         `hcl:"plugin,block"`
	KubeletPlugins     []kubeletPluginsSchema `hcl:"kubernetes_device_plugins,block"`
	Listeners          []listenerSchema       `hcl:"listener,block"`
	Grants             []grantSchema          `hcl:"grant,block"`
}

type listenerSchema struct {
	Name     string         `hcl:"name,label"`
	Address  *hcl.Attribute `hcl:"address,optional"`
	Allow    *hcl.Attribute `hcl:"allow,optional"`
	TLSCert  *hcl.Attribute `hcl:"tls_cert,optional"`
	TLSKey   *hcl.Attribute `hcl:"tls_key,optional"`
	TLSCA    *hcl.Attribute `hcl:"tls_ca,optional"`
	Insecure *hcl.Attribute `hcl:"insecure,optional"`
	Mode     *hcl.Attribute `hcl:"mode,optional"`
	DefRange hcl.Range      `hcl:",def_range"`
}

type grantSchema struct {
	UID      *hcl.Attribute `hcl:"uid,optional"`
	GID      *hcl.Attribute `hcl:"gid,optional"`
	Identity *hcl.Attribute `hcl:"identity,optional"`
	Allow    *hcl.Attribute `hcl:"allow,optional"`
	DefRange hcl.Range      `hcl:",def_range"`
}

// kubeletPluginsSchema is the `kubernetes_device_plugins { dir = "..." }` block: the
// bundled host of the kubelet's device plugins (integrations/kubernetes/hosted), run
// with the directory of its kubelet.sock.
type kubeletPluginsSchema struct {
	Dir      *hcl.Attribute `hcl:"dir,optional"`
	DefRange hcl.Range      `hcl:",def_range"`
}

type pluginSchema struct {
	Name       string         `hcl:"name,label"`
	SHA256     *hcl.Attribute `hcl:"sha256,optional"`
	Env        *hcl.Attribute `hcl:"env,optional"`
	InheritEnv *hcl.Attribute `hcl:"inherit_env,optional"`
	Reattach   *hcl.Attribute `hcl:"reattach,optional"`
	DeviceIDs  *hcl.Attribute `hcl:"device_ids,optional"`
	Config     *configSchema  `hcl:"config,block"`
	DefRange   hcl.Range      `hcl:",def_range"`
}

// decodeConfigFile parses an HCL (or, for a .json name, HCL JSON) file and decodes it
// into schema, a gohcl-tagged struct. It returns the decoding's diagnostics (an
// unknown key, a missing label), with what could be decoded in schema, so that the
// caller reports them with the problems it finds in the values: every problem of the
// file in one error. A file that cannot be read or parsed is an error (naming the
// file, line and column) and nothing is decoded.
func decodeConfigFile(path string, schema any) (hcl.Diagnostics, error) {
	parser := hclparse.NewParser()
	var file *hcl.File
	var diags hcl.Diagnostics
	if strings.HasSuffix(path, ".json") {
		file, diags = parser.ParseJSONFile(path)
	} else {
		file, diags = parser.ParseHCLFile(path)
	}
	if diags.HasErrors() {
		return nil, diagError(path, diags)
	}
	return gohcl.DecodeBody(file.Body, nil, schema), nil
}

// configSchema is a plugin's free-form config block, handed to the plugin as JSON.
type configSchema struct {
	Body hcl.Body `hcl:",remain"`
}

// loadConfigFile reads an HCL (or, for a .json name, HCL JSON) config file over cfg.
// Every problem is reported with the file, line and key.
func loadConfigFile(path string, cfg *agentConfig) error {
	_, err := loadConfig(path, cfg)
	return err
}

// pluginBlocks says where each plugin block of a config file is (its `plugin "name"`
// header), by plugin name, for errors about a block found after the file was loaded: a
// config the plugin rejects.
type pluginBlocks map[string]hcl.Range

// loadConfig is loadConfigFile, which also returns where the file's plugin blocks are.
func loadConfig(path string, cfg *agentConfig) (pluginBlocks, error) {
	var fs fileSchema
	diags, err := decodeConfigFile(path, &fs)
	if err != nil {
		return nil, err
	}
	d := decoder{diags: diags}
	d.address(fs.Listen, false, &cfg.Listen)
	d.str(fs.PluginDir, &cfg.PluginDir)
	d.str(fs.StateDir, &cfg.StateDir)
	d.logLevel(fs.LogLevel, &cfg.LogLevel)
	d.boolean(fs.LogJSON, &cfg.LogJSON)
	d.duration(fs.StatsInterval, manager.MinStatsInterval, &cfg.StatsInterval)
	d.duration(fs.ReserveTimeout, minReserveTimeout, &cfg.ReserveTimeout)
	d.duration(fs.StartTimeout, minStartTimeout, &cfg.StartTimeout)
	d.duration(fs.ReadyTimeout, 0, &cfg.ReadyTimeout)
	d.duration(fs.GCInterval, minGCInterval, &cfg.GCInterval)
	d.integer(fs.GCMaxReservations, 1, &cfg.GCMaxReservations)
	d.integer(fs.GCParallelDestroys, 1, &cfg.GCParallelDestroys)
	d.integer(fs.EventMaxCount, -1, &cfg.EventMaxCount)
	d.duration(fs.EventMaxAge, time.Minute, &cfg.EventMaxAge)
	d.integer(fs.MaxStreams, 1, &cfg.MaxStreams)
	d.integer(fs.MaxStreamsPerConn, 1, &cfg.MaxStreamsPerConn)
	d.integer(fs.MaxProcs, 0, &cfg.MaxProcs)
	d.str(fs.TLSCert, &cfg.TLS.Cert)
	d.str(fs.TLSKey, &cfg.TLS.Key)
	d.str(fs.TLSCA, &cfg.TLS.CA)
	d.boolean(fs.Insecure, &cfg.TLS.Insecure)
	d.address(fs.MetricsListen, true, &cfg.MetricsListen)
	d.str(fs.MetricsTLSCert, &cfg.MetricsTLS.Cert)
	d.str(fs.MetricsTLSKey, &cfg.MetricsTLS.Key)
	d.str(fs.MetricsTLSCA, &cfg.MetricsTLS.CA)
	d.boolean(fs.MetricsHolderLabel, &cfg.MetricsHolderLabels)

	d.access(fs.Listeners, fs.Grants, fs.Listen, cfg)

	seen := pluginBlocks{}
	for _, p := range fs.Plugins {
		if first, dup := seen[p.Name]; dup {
			d.diags = append(d.diags, &hcl.Diagnostic{
				Severity: hcl.DiagError,
				Summary:  "Duplicate plugin block",
				Detail:   fmt.Sprintf("plugin %q is already configured at line %d.", p.Name, first.Start.Line),
				Subject:  p.DefRange.Ptr(),
			})
			continue
		}
		seen[p.Name] = p.DefRange
		var ps pluginSettings
		d.sha256(p.SHA256, &ps.SHA256)
		d.env(p.Env, &ps.Env)
		d.boolean(p.InheritEnv, &ps.InheritEnv)
		d.boolean(p.Reattach, &ps.Reattach)
		d.patterns(p.DeviceIDs, &ps.DeviceIDs)
		if p.Config != nil {
			ps.ConfigJSON = d.configJSON(p.Config.Body)
		}
		cfg.Plugins[p.Name] = ps
		// Patterns of two plugins that could match one ID would let both claim it.
		for _, q := range fs.Plugins {
			if q.Name == p.Name || q.DeviceIDs == nil || p.DeviceIDs == nil {
				continue
			}
			if _, done := seen[q.Name]; !done || q.DefRange == p.DefRange {
				continue // checked when q's block is the later one
			}
			for _, a := range ps.DeviceIDs {
				for _, b := range cfg.Plugins[q.Name].DeviceIDs {
					if idpattern.Overlap(a, b) {
						d.fail(p.DeviceIDs, "Overlapping device_ids", fmt.Sprintf("pattern %q of plugin %q and pattern %q of plugin %q (line %d) can match the same device ID; give each plugin IDs of its own",
							a, p.Name, b, q.Name, q.DeviceIDs.Range.Start.Line))
					}
				}
			}
		}
	}
	d.kubeletPlugins(fs.KubeletPlugins, seen, cfg)
	if d.diags.HasErrors() {
		return nil, diagError(path, d.diags)
	}
	return seen, nil
}

// kubeletPlugins applies the kubernetes_device_plugins block: the bundled host of the
// kubelet's device plugins, run with the block's dir, as if a plugin block of its name
// were given (which, given too, is an error).
func (d *decoder) kubeletPlugins(blocks []kubeletPluginsSchema, seen pluginBlocks, cfg *agentConfig) {
	for i, b := range blocks {
		if i > 0 {
			d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: "Duplicate kubernetes_device_plugins block",
				Detail: fmt.Sprintf("kubernetes_device_plugins is already given at line %d.", blocks[0].DefRange.Start.Line), Subject: b.DefRange.Ptr()})
			continue
		}
		if first, dup := seen[hosted.Name]; dup {
			d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: "Duplicate plugin block",
				Detail:  fmt.Sprintf("kubernetes_device_plugins runs plugin %q, which a plugin block configures at line %d: give one of them.", hosted.Name, first.Start.Line),
				Subject: b.DefRange.Ptr()})
			continue
		}
		var dir string
		d.str(b.Dir, &dir)
		conf, err := json.Marshal(hosted.Config{Dir: dir})
		if err != nil {
			d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: "Invalid kubernetes_device_plugins", Detail: err.Error(), Subject: b.DefRange.Ptr()})
			continue
		}
		seen[hosted.Name] = b.DefRange
		cfg.Plugins[hosted.Name] = pluginSettings{ConfigJSON: conf}
		if !slices.Contains(cfg.Bundled, hosted.Name) {
			cfg.Bundled = append(cfg.Bundled, hosted.Name)
		}
	}
}

// decoder converts attributes to Go values, collecting diagnostics that point at the
// attribute's value and name its key.
type decoder struct {
	diags hcl.Diagnostics
}

func (d *decoder) fail(a *hcl.Attribute, summary, detail string) {
	d.diags = append(d.diags, &hcl.Diagnostic{
		Severity: hcl.DiagError,
		Summary:  summary,
		Detail:   fmt.Sprintf("%s: %s", a.Name, detail),
		Subject:  a.Expr.Range().Ptr(),
	})
}

// value evaluates a as type ty; ok is false (with a diagnostic) when it cannot.
func (d *decoder) value(a *hcl.Attribute, ty cty.Type) (cty.Value, bool) {
	v, diags := a.Expr.Value(nil)
	if diags.HasErrors() {
		d.diags = append(d.diags, diags...)
		return cty.NilVal, false
	}
	if v.IsNull() {
		d.fail(a, "Invalid value", "must not be null")
		return cty.NilVal, false
	}
	cv, err := convert.Convert(v, ty)
	if err != nil {
		d.fail(a, "Invalid value", fmt.Sprintf("want a %s: %v", ty.FriendlyName(), err))
		return cty.NilVal, false
	}
	return cv, true
}

func (d *decoder) str(a *hcl.Attribute, out *string) {
	if a == nil {
		return
	}
	if v, ok := d.value(a, cty.String); ok {
		*out = v.AsString()
	}
}

// address decodes a host API address (unix:///path.sock or tcp://host:port); with
// optional, "" too (none).
func (d *decoder) address(a *hcl.Attribute, optional bool, out *string) {
	if a == nil {
		return
	}
	v, ok := d.value(a, cty.String)
	if !ok {
		return
	}
	s := v.AsString()
	if s != "" || !optional {
		if _, err := endpoint.Parse(s); err != nil {
			d.fail(a, "Invalid address", err.Error())
			return
		}
	}
	*out = s
}

func (d *decoder) boolean(a *hcl.Attribute, out *bool) {
	if a == nil {
		return
	}
	if v, ok := d.value(a, cty.Bool); ok {
		*out = v.True()
	}
}

// duration decodes a duration of at least min; zero ("0s") is allowed too and means the
// default.
func (d *decoder) duration(a *hcl.Attribute, min time.Duration, out *time.Duration) {
	if a == nil {
		return
	}
	v, ok := d.value(a, cty.String)
	if !ok {
		return
	}
	dur, err := time.ParseDuration(v.AsString())
	switch {
	case err != nil:
		d.fail(a, "Invalid duration", fmt.Sprintf("%q is not a duration; want e.g. \"500ms\", \"1s\" or \"2m\"", v.AsString()))
	case dur < 0:
		d.fail(a, "Invalid duration", fmt.Sprintf("%q is negative", v.AsString()))
	case dur > 0 && dur < min:
		d.fail(a, "Invalid duration", fmt.Sprintf("%q is below the minimum of %v (or \"0s\" for the default)", v.AsString(), min))
	default:
		*out = dur
	}
}

// sha256Hex is a SHA-256 pin: 64 hex digits.
var sha256Hex = regexp.MustCompile(`^[0-9a-fA-F]{64}$`)

// sha256 decodes a plugin's checksum pin: 64 hex digits (sha256sum's output), stored
// in lower case. Anything else would make every launch of the plugin fail.
func (d *decoder) sha256(a *hcl.Attribute, out *string) {
	if a == nil {
		return
	}
	var s string
	d.str(a, &s)
	if s == "" {
		return
	}
	if !sha256Hex.MatchString(s) {
		d.fail(a, "Invalid checksum", fmt.Sprintf("\"%s\" is not a SHA-256: want 64 hex digits, as `sha256sum` prints them", textline.Escape(s, 80)))
		return
	}
	*out = strings.ToLower(s)
}

func (d *decoder) integer(a *hcl.Attribute, min int, out *int) {
	if a == nil {
		return
	}
	v, ok := d.value(a, cty.Number)
	if !ok {
		return
	}
	bf := v.AsBigFloat()
	n, acc := bf.Int64()
	if !bf.IsInt() || acc != big.Exact || n < int64(min) || n > math.MaxInt32 {
		d.fail(a, "Invalid number", fmt.Sprintf("%s is not a whole number of at least %d and at most %d", bf.Text('g', -1), min, math.MaxInt32))
		return
	}
	*out = int(n)
}

func (d *decoder) logLevel(a *hcl.Attribute, out *string) {
	if a == nil {
		return
	}
	var s string
	d.str(a, &s)
	if s == "" {
		return
	}
	if err := checkLogLevel(s); err != nil {
		d.fail(a, "Invalid log level", err.Error())
		return
	}
	*out = s
}

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`)

func (d *decoder) env(a *hcl.Attribute, out *[]string) {
	if a == nil {
		return
	}
	v, ok := d.value(a, cty.List(cty.String))
	if !ok {
		return
	}
	var env []string
	for i, e := range v.AsValueSlice() {
		s := e.AsString()
		if !envName.MatchString(s) {
			d.fail(a, "Invalid environment", fmt.Sprintf("entry %d (%q) is not NAME=value", i, s))
			return
		}
		env = append(env, s)
	}
	*out = env
}

// patterns decodes a plugin's device_ids: a list of at most idpattern.MaxPatterns
// patterns, each one idpattern.Check accepts.
func (d *decoder) patterns(a *hcl.Attribute, out *[]string) {
	if a == nil {
		return
	}
	v, ok := d.value(a, cty.List(cty.String))
	if !ok {
		return
	}
	vals := v.AsValueSlice()
	if len(vals) == 0 || len(vals) > idpattern.MaxPatterns {
		d.fail(a, "Invalid device_ids", fmt.Sprintf("%d patterns, want 1 to %d (leave device_ids out to pin nothing)", len(vals), idpattern.MaxPatterns))
		return
	}
	var ps []string
	for i, e := range vals {
		if err := idpattern.Check(e.AsString()); err != nil {
			d.fail(a, "Invalid device_ids", fmt.Sprintf("entry %d: %v", i, err))
			return
		}
		ps = append(ps, e.AsString())
	}
	*out = ps
}

// configJSON converts a plugin's config block to a JSON object. Its attributes may hold
// any HCL value (strings, numbers, bools, lists, objects). In the native syntax it may
// also hold nested blocks: `name { ... }` is the object `"name": { ... }`, and a name
// given as several blocks is the list of their objects, in file order (HCL's JSON form
// reads a list of objects as repeated blocks too); with labels, `name "a" { ... }` is
// `"name": {"a": { ... }}` (see labeledBlock). A name that is both an attribute and a
// block is an error at its line.
func (d *decoder) configJSON(body hcl.Body) []byte {
	var obj map[string]any
	if sb, ok := body.(*hclsyntax.Body); ok {
		obj = d.blockObject(sb)
	} else { // HCL's JSON form: objects are attributes' values already
		attrs, diags := body.JustAttributes()
		if diags.HasErrors() {
			d.diags = append(d.diags, diags...)
			return nil
		}
		obj = make(map[string]any, len(attrs))
		for name, a := range attrs {
			if v, ok := d.attrJSON(a); ok {
				obj[name] = v
			}
		}
	}
	data, err := json.Marshal(obj) // map keys are sorted: the same file gives the same JSON
	if err != nil {
		d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: "Invalid plugin config", Detail: err.Error()})
		return nil
	}
	return data
}

// attrJSON evaluates a plugin config attribute to what encoding/json marshals; ok is
// false (with a diagnostic) when it cannot.
func (d *decoder) attrJSON(a *hcl.Attribute) (any, bool) {
	v, diags := a.Expr.Value(nil)
	if diags.HasErrors() {
		d.diags = append(d.diags, diags...)
		return nil, false
	}
	gv, err := ctyToJSON(v)
	if err != nil {
		d.fail(a, "Invalid plugin config value", err.Error())
		return nil, false
	}
	return gv, true
}

// blockObject converts a native-syntax plugin config body (see configJSON).
func (d *decoder) blockObject(b *hclsyntax.Body) map[string]any {
	obj := make(map[string]any, len(b.Attributes)+len(b.Blocks))
	for name, a := range b.Attributes {
		if v, ok := d.attrJSON(a.AsHCLAttribute()); ok {
			obj[name] = v
		}
	}
	byType := map[string][]any{}
	var order []string           // block types, first seen first
	labeled := map[string]bool{} // block types given with labels
	for _, blk := range b.Blocks {
		if a, clash := b.Attributes[blk.Type]; clash {
			d.diags = append(d.diags, &hcl.Diagnostic{
				Severity: hcl.DiagError,
				Summary:  "Ambiguous plugin config",
				Detail: fmt.Sprintf("%s: given as an attribute at line %d and as a block here; write one of them "+
					"(a block is the same as %s = { ... }, several blocks the same as %[1]s = [{ ... }, ...])",
					blk.Type, a.SrcRange.Start.Line, blk.Type),
				Subject: blk.TypeRange.Ptr(),
			})
			continue
		}
		if len(blk.Labels) > 0 {
			if _, plain := byType[blk.Type]; plain {
				d.mixedBlocks(blk)
				continue
			}
			d.labeledBlock(obj, blk, labeled)
			continue
		}
		if labeled[blk.Type] {
			d.mixedBlocks(blk)
			continue
		}
		if _, seen := byType[blk.Type]; !seen {
			order = append(order, blk.Type)
		}
		byType[blk.Type] = append(byType[blk.Type], d.blockObject(blk.Body))
	}
	for _, name := range order {
		if objs := byType[name]; len(objs) == 1 {
			obj[name] = objs[0]
		} else {
			obj[name] = objs
		}
	}
	return obj
}

// labeledBlock puts a block with labels into obj: `device "fuse" { ... }` is the
// object "device": {"fuse": { ... }}, as HCL's JSON form writes it, each label one
// level deeper; blocks of one type with different labels share the object. A label
// path given twice, or a type given both with and without labels, is an error at its
// line.
func (d *decoder) labeledBlock(obj map[string]any, blk *hclsyntax.Block, labeled map[string]bool) {
	labeled[blk.Type] = true
	parent := obj
	key := blk.Type
	for i, label := range blk.Labels {
		next, _ := parent[key].(map[string]any)
		if next == nil {
			next = map[string]any{}
			parent[key] = next
		}
		parent, key = next, label
		if i == len(blk.Labels)-1 {
			if _, dup := parent[key]; dup {
				d.diags = append(d.diags, &hcl.Diagnostic{
					Severity: hcl.DiagError,
					Summary:  "Duplicate plugin config block",
					Detail:   fmt.Sprintf("%s %q is given twice; give each once", blk.Type, strings.Join(blk.Labels, `" "`)),
					Subject:  blk.LabelRanges[i].Ptr(),
				})
				return
			}
		}
	}
	parent[key] = d.blockObject(blk.Body)
}

// mixedBlocks reports a block type given both with and without labels.
func (d *decoder) mixedBlocks(blk *hclsyntax.Block) {
	d.diags = append(d.diags, &hcl.Diagnostic{
		Severity: hcl.DiagError,
		Summary:  "Mixed plugin config blocks",
		Detail:   fmt.Sprintf("%s: given both with labels (%s \"name\" { ... }) and without; use one form", blk.Type, blk.Type),
		Subject:  blk.TypeRange.Ptr(),
	})
}

// ctyToJSON converts a known cty value to what encoding/json marshals to the same JSON.
//
// It is not go-cty's own ctyjson.Marshal (cty/json): that gives the same JSON for
// strings, bools, nulls, lists, maps, objects and whole numbers below 2^64, but writes
// every other number positionally, 1.5e300 as its 301 digits and 1.5e-7 as 0.00000015,
// where plugins get 1.5e+300 and 1.5e-07 (TestPluginConfigNumbers).
func ctyToJSON(v cty.Value) (any, error) {
	if !v.IsKnown() {
		return nil, errors.New("value is not known")
	}
	if v.IsNull() {
		return nil, nil
	}
	ty := v.Type()
	switch {
	case ty == cty.String:
		return v.AsString(), nil
	case ty == cty.Bool:
		return v.True(), nil
	case ty == cty.Number:
		return jsonNumber(v.AsBigFloat()), nil
	case ty.IsListType() || ty.IsTupleType() || ty.IsSetType():
		out := []any{}
		for _, e := range v.AsValueSlice() {
			ge, err := ctyToJSON(e)
			if err != nil {
				return nil, err
			}
			out = append(out, ge)
		}
		return out, nil
	case ty.IsMapType() || ty.IsObjectType():
		out := map[string]any{}
		for k, e := range v.AsValueMap() {
			ge, err := ctyToJSON(e)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", k, err)
			}
			out[k] = ge
		}
		return out, nil
	default:
		return nil, fmt.Errorf("a %s cannot be passed to a plugin", ty.FriendlyName())
	}
}

// jsonNumber writes a cty number (a big.Float) as JSON. A whole number is written with
// all its digits (1000000, 9007199254740993), never in exponent form ("1e+06"), which
// encoding/json refuses for an integer field; other numbers in the shortest form that
// reads back the same ("0.1", "1.5e+300"). Whole numbers of 2^64 and more, which no Go
// integer holds and whose decimal digits the big.Float may not hold exactly either, are
// written that way too.
func jsonNumber(f *big.Float) json.Number {
	if f.IsInt() && f.MantExp(nil) <= 64 {
		return json.Number(f.Text('f', 0))
	}
	return json.Number(f.Text('g', -1))
}

// diagError renders diagnostics as "file:line,column: summary; detail", one per line,
// in the order of the file.
func diagError(path string, diags hcl.Diagnostics) error {
	diags = slices.Clone(diags)
	pos := func(d *hcl.Diagnostic) hcl.Pos {
		if d.Subject == nil {
			return hcl.Pos{} // the file as a whole: first
		}
		return d.Subject.Start
	}
	slices.SortStableFunc(diags, func(a, b *hcl.Diagnostic) int {
		pa, pb := pos(a), pos(b)
		if pa.Line != pb.Line {
			return pa.Line - pb.Line
		}
		return pa.Column - pb.Column
	})
	var lines []string
	for _, d := range diags {
		if d.Severity != hcl.DiagError {
			continue
		}
		where := path
		if d.Subject != nil {
			where = fmt.Sprintf("%s:%d,%d", d.Subject.Filename, d.Subject.Start.Line, d.Subject.Start.Column)
		}
		line := where + ": " + d.Summary
		if d.Detail != "" {
			line += "; " + d.Detail
		}
		lines = append(lines, line)
	}
	return fmt.Errorf("config %s:\n  %s", path, strings.Join(lines, "\n  "))
}

// checkLogLevel accepts the levels hclog knows.
func checkLogLevel(s string) error {
	if hclog.LevelFromString(s) == hclog.NoLevel {
		return fmt.Errorf("%q is not a log level; want trace, debug, info, warn or error", s)
	}
	return nil
}

// access decodes the listener and grant blocks into cfg (docs/configuration.md#access).
// listen is the file's listen attribute, for a listener block at its address.
func (d *decoder) access(listeners []listenerSchema, grantBlocks []grantSchema, listen *hcl.Attribute, cfg *agentConfig) {
	block := func(r hcl.Range, summary, detail string) {
		d.diags = append(d.diags, &hcl.Diagnostic{Severity: hcl.DiagError, Summary: summary, Detail: detail, Subject: r.Ptr()})
	}
	names := map[string]int{}
	addrs := map[string]int{}
	anyTLS := cfg.TLS.Cert != ""
	for _, l := range listeners {
		if l.Name == mainListener {
			block(l.DefRange, "Reserved listener name", fmt.Sprintf("listener %q is the listen attribute's; name this one otherwise", l.Name))
			continue
		}
		if line, dup := names[l.Name]; dup {
			block(l.DefRange, "Duplicate listener block", fmt.Sprintf("listener %q is already configured at line %d.", l.Name, line))
			continue
		}
		names[l.Name] = l.DefRange.Start.Line
		ls := listenerSettings{Name: l.Name}
		if l.Address == nil {
			block(l.DefRange, "Missing address", fmt.Sprintf("listener %q: give it an address (unix:///path.sock or tcp://host:port)", l.Name))
		} else {
			d.address(l.Address, false, &ls.Address)
		}
		if l.Allow == nil {
			block(l.DefRange, "Missing allow", fmt.Sprintf("listener %q: say what its clients may do, e.g. allow = [%q]", l.Name, server.GrantRead))
		} else {
			d.grants(l.Allow, &ls.Allow)
		}
		d.str(l.TLSCert, &ls.TLS.Cert)
		d.str(l.TLSKey, &ls.TLS.Key)
		d.str(l.TLSCA, &ls.TLS.CA)
		d.boolean(l.Insecure, &ls.TLS.Insecure)
		if ls.Address == "" {
			continue
		}
		addr, err := endpoint.Parse(ls.Address)
		if err != nil {
			continue // reported by d.address
		}
		if l.Mode != nil {
			var s string
			d.str(l.Mode, &s)
			m, err := strconv.ParseUint(s, 8, 32)
			switch {
			case err != nil || m > 0o777 || m == 0:
				d.fail(l.Mode, "Invalid mode", fmt.Sprintf("%q is not a file mode: want octal permission bits, e.g. \"0666\"", s))
			case addr.Network != "unix":
				d.fail(l.Mode, "Invalid mode", "a mode is for a unix socket; this listener is "+addr.Network)
			default:
				ls.Mode = os.FileMode(m)
			}
		}
		if err := ls.TLS.Check(addr); err != nil {
			block(l.DefRange, "Invalid listener", fmt.Sprintf("listener %q: %v", l.Name, err))
		}
		anyTLS = anyTLS || ls.TLS.Cert != ""
		key := addr.String()
		if main, err := endpoint.Parse(cfg.Listen); err == nil && main.String() == key {
			where := "the default listen address"
			if listen != nil {
				where = fmt.Sprintf("listen (line %d)", listen.Range.Start.Line)
			}
			d.fail(l.Address, "Duplicate address", fmt.Sprintf("%s is %s's; give listener %q an address of its own", key, where, l.Name))
		} else if line, dup := addrs[key]; dup {
			d.fail(l.Address, "Duplicate address", fmt.Sprintf("%s is already a listener's at line %d", key, line))
		}
		addrs[key] = l.Address.Range.Start.Line
		cfg.Listeners = append(cfg.Listeners, ls)
	}
	for _, g := range grantBlocks {
		var gs grantSettings
		set := 0
		for _, a := range []*hcl.Attribute{g.UID, g.GID, g.Identity} {
			if a != nil {
				set++
			}
		}
		if set != 1 {
			block(g.DefRange, "Invalid grant", "a grant names exactly one peer: uid = N, gid = N or identity = \"...\" (a client certificate's SAN or common name)")
			continue
		}
		for _, id := range []struct {
			a   *hcl.Attribute
			out **uint32
		}{{g.UID, &gs.UID}, {g.GID, &gs.GID}} {
			if id.a == nil {
				continue
			}
			n := -1
			d.integer(id.a, 0, &n)
			if n >= 0 {
				v := uint32(n)
				*id.out = &v
			}
		}
		if g.Identity != nil {
			d.str(g.Identity, &gs.Identity)
			if gs.Identity == "" {
				d.fail(g.Identity, "Invalid grant", "must not be empty")
			} else if !anyTLS {
				d.fail(g.Identity, "Invalid grant", "identity grants match TLS client certificates, and no listener (nor listen) has tls_cert: give one, or grant by uid or gid")
			}
		}
		if g.Allow == nil {
			block(g.DefRange, "Missing allow", fmt.Sprintf("grant: say what the peer may do, e.g. allow = [%q]", server.GrantRead))
		} else {
			d.grants(g.Allow, &gs.Allow)
		}
		cfg.Grants = append(cfg.Grants, gs)
	}
}

// grants decodes a list of grants (server.ParseAllow's words).
func (d *decoder) grants(a *hcl.Attribute, out *[]string) {
	v, ok := d.value(a, cty.List(cty.String))
	if !ok {
		return
	}
	var words []string
	for _, e := range v.AsValueSlice() {
		words = append(words, e.AsString())
	}
	if _, err := server.ParseAllow(words); err != nil {
		d.fail(a, "Invalid grant", err.Error())
		return
	}
	*out = words
}
