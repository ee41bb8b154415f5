package manager

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/hashicorp/go-hclog"
	goplugin "github.com/hashicorp/go-plugin"

	"github.com/devicehost/devicehost/manager/ledger"
	"github.com/devicehost/devicehost/manager/supervise"
	"github.com/devicehost/devicehost/pluginloader"
)

// This file keeps plugin processes across a crash of the host (PluginConfig.Reattach):
// the reattach record saved in the ledger, and the keeper that a supervisor uses to
// reattach, save and forget. Whether a recorded PID still is that plugin is
// pluginloader's rule (ProcessIdentity.Check).

const (
	// reattachFormat is the version of reattachRecord's JSON form.
	reattachFormat = 1
	// ledgerWriteTimeout bounds one write of a reattach record, or of device bindings
	// (the inventory's StoreTimeout).
	ledgerWriteTimeout = 5 * time.Second
	// socketDirName is the folder of StateDir that kept plugins put their sockets in.
	socketDirName = "sockets"
	// maxSocketDirLen is the longest socket dir that still fits go-plugin's socket
	// names ("plugin" and up to 10 digits) into a Unix socket path (107 bytes on Linux).
	maxSocketDirLen = 107 - len("/plugin") - 10
)

// reattachRecord is what the ledger keeps about a running plugin process so that a later
// host can reattach to it: go-plugin's ReattachConfig in a form of our own (go-plugin's
// holds a net.Addr, which does not survive JSON), plus what identifies the process.
type reattachRecord struct {
	Format          int    `json:"format"`
	Plugin          string `json:"plugin"`
	Path            string `json:"path"` // absolute path of the binary launched
	PID             int    `json:"pid"`
	StartTicks      uint64 `json:"start_ticks"` // /proc/<pid>/stat starttime: tells a reused PID
	BootID          string `json:"boot_id"`     // /proc/sys/kernel/random/boot_id at launch
	Protocol        string `json:"protocol"`    // go-plugin protocol ("grpc")
	ProtocolVersion int    `json:"protocol_version"`
	Network         string `json:"network"` // "unix" or "tcp"
	Address         string `json:"address"`
	Test            bool   `json:"test"` // go-plugin test mode: the host never kills the process
}

// newReattachRecord describes the process of a plugin just launched from path.
func newReattachRecord(plugin, path string, rc *goplugin.ReattachConfig) (reattachRecord, error) {
	if rc.Addr == nil || rc.Pid <= 0 {
		return reattachRecord{}, fmt.Errorf("incomplete reattach data (address %v, pid %d)", rc.Addr, rc.Pid)
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return reattachRecord{}, fmt.Errorf("plugin path: %w", err)
	}
	id, err := pluginloader.IdentifyProcess(rc.Pid, abs)
	if err != nil {
		return reattachRecord{}, err
	}
	return reattachRecord{
		Format:          reattachFormat,
		Plugin:          plugin,
		Path:            abs,
		PID:             rc.Pid,
		StartTicks:      id.StartTicks,
		BootID:          id.BootID,
		Protocol:        string(rc.Protocol),
		ProtocolVersion: rc.ProtocolVersion,
		Network:         rc.Addr.Network(),
		Address:         rc.Addr.String(),
		Test:            rc.Test,
	}, nil
}

// decodeReattachRecord reads a record saved by keeper.Save.
func decodeReattachRecord(data []byte) (reattachRecord, error) {
	var r reattachRecord
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return reattachRecord{}, fmt.Errorf("reattach record: %w", err)
	}
	switch {
	case r.Format != reattachFormat:
		return reattachRecord{}, fmt.Errorf("reattach record: format %d, this host reads %d", r.Format, reattachFormat)
	case r.PID <= 0, r.Path == "", r.Address == "":
		return reattachRecord{}, fmt.Errorf("reattach record: pid, path or address missing")
	}
	return r, nil
}

// config is the record as go-plugin's ReattachConfig.
func (r reattachRecord) config() (*goplugin.ReattachConfig, error) {
	var addr net.Addr
	switch r.Network {
	case "unix":
		addr = &net.UnixAddr{Name: r.Address, Net: "unix"}
	case "tcp":
		a, err := net.ResolveTCPAddr("tcp", r.Address)
		if err != nil {
			return nil, fmt.Errorf("reattach address: %w", err)
		}
		addr = a
	default:
		return nil, fmt.Errorf("reattach address: unknown network %q", r.Network)
	}
	return &goplugin.ReattachConfig{
		Protocol:        goplugin.Protocol(r.Protocol),
		ProtocolVersion: r.ProtocolVersion,
		Addr:            addr,
		Pid:             r.PID,
		Test:            r.Test,
	}, nil
}

// process is the process r names, for pluginloader's identity check.
func (r reattachRecord) process() pluginloader.ProcessIdentity {
	return pluginloader.ProcessIdentity{PID: r.PID, StartTicks: r.StartTicks, BootID: r.BootID, Path: r.Path}
}

// reattacher is a launched plugin that go-plugin can reattach to later.
// *pluginloader.Plugin is one; the in-process test plugins are not.
type reattacher interface {
	ReattachConfig() *goplugin.ReattachConfig
}

// keeper keeps one plugin's process across host crashes through its reattach record in
// the ledger. Only the plugin's supervisor goroutine uses it, after New.
type keeper struct {
	name  string
	led   *ledger.Ledger
	log   hclog.Logger
	saved *reattachRecord // found by New; used, then cleared, by the first launch
}

var _ supervise.Keeper = (*keeper)(nil)

// reattach attaches to the process the previous host left running, if the record New
// found checks out, and returns it; otherwise (or when there was no record) it returns
// nil, with the record deleted and, when the process passed the check but could not be
// reattached or was launched from another path than bin's now, that process killed.
// launch is called with opts.Reattach set; ctx bounds the whole attempt.
func (k *keeper) Reattach(ctx context.Context, bin pluginloader.Binary, opts pluginloader.Options, launch supervise.LaunchFunc) supervise.Plugin {
	rec := k.saved
	k.saved = nil
	if rec == nil {
		return nil
	}
	log := k.log.With("pid", rec.PID)
	if err := rec.process().Check(); err != nil {
		log.Info("not reattaching to the plugin process recorded by the previous host; starting the plugin afresh", "reason", err)
		k.Forget(ctx)
		return nil
	}
	abs, err := filepath.Abs(bin.Path)
	switch {
	case err != nil || abs != rec.Path:
		err = fmt.Errorf("it runs %s, the plugin is now configured as %s", rec.Path, bin.Path)
	default:
		var rc *goplugin.ReattachConfig
		if rc, err = rec.config(); err == nil {
			opts.Reattach = rc
			var p supervise.Plugin
			if p, err = launch(ctx, bin, opts); err == nil {
				log.Info("reattached to the plugin process left running by the previous host")
				return p
			}
		}
	}
	killed, kerr := rec.process().KillIfSame()
	switch {
	case kerr != nil:
		log.Error("cannot reattach to the plugin process left by the previous host, nor kill it; starting the plugin afresh beside it", "reason", err, "error", kerr)
	case killed:
		log.Warn("cannot reattach to the plugin process left by the previous host; killed it, starting the plugin afresh", "reason", err)
	default:
		log.Warn("cannot reattach to the plugin process left by the previous host, which has gone meanwhile; starting the plugin afresh", "reason", err)
	}
	k.Forget(ctx)
	return nil
}

// save records p's reattach data, so that a host started after a crash can reattach to
// it. A failure is logged: the plugin runs on, but will not be reattached.
func (k *keeper) Save(ctx context.Context, path string, p supervise.Plugin) {
	var rc *goplugin.ReattachConfig
	if r, ok := p.(reattacher); ok {
		rc = r.ReattachConfig()
	}
	if rc == nil {
		k.log.Warn("plugin gave no reattach data; it will not be kept across a host crash")
		return
	}
	rec, err := newReattachRecord(k.name, path, rc)
	if err != nil {
		k.log.Warn("cannot describe the plugin process for reattaching; it will not be kept across a host crash", "pid", rc.Pid, "error", err)
		return
	}
	data, err := json.Marshal(rec)
	if err != nil {
		k.log.Warn("cannot encode the reattach record; the plugin will not be kept across a host crash", "error", err)
		return
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ledgerWriteTimeout)
	defer cancel()
	if err := k.led.SaveReattach(wctx, k.name, data); err != nil {
		k.log.Warn("cannot save the reattach record; the plugin will not be kept across a host crash", "pid", rc.Pid, "error", err)
	}
}

// forget deletes the plugin's reattach record: its process is gone or not to be used.
func (k *keeper) Forget(ctx context.Context) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ledgerWriteTimeout)
	defer cancel()
	if err := k.led.DeleteReattach(wctx, k.name); err != nil {
		k.log.Warn("cannot delete the reattach record; the next host will check the recorded process before using it", "error", err)
	}
}

// loadReattachRecords reads the reattach records a previous host left in led. The
// records of plugins in kept are returned by name, for their keepers; every other record
// (a plugin no longer found, or no longer kept) is deleted, and its process, if it
// checks out as the recorded one, is killed: nobody will reattach to it, and it would
// hold its devices. Unreadable records are deleted with a log line. Errors are logged:
// at worst a plugin is started afresh.
func loadReattachRecords(led *ledger.Ledger, kept map[string]bool, log hclog.Logger) map[string]*reattachRecord {
	names, err := led.ReattachPlugins()
	if err != nil {
		log.Warn("cannot list reattach records; plugins will be started afresh", "error", err)
		return nil
	}
	out := make(map[string]*reattachRecord)
	for _, name := range names {
		plog := log.With("plugin", name)
		rec, err := loadReattachRecord(led, name)
		switch {
		case err != nil:
			plog.Warn("unreadable reattach record deleted; the plugin process it named, if any, is left alone", "error", err)
		case kept[name]:
			out[name] = rec
			continue
		default:
			switch killed, kerr := rec.process().KillIfSame(); {
			case kerr != nil:
				plog.Error("plugin process left by the previous host is not reattached (plugin not kept any more) and could not be killed", "pid", rec.PID, "error", kerr)
			case killed:
				plog.Warn("killed the plugin process left by the previous host: the plugin is not kept any more", "pid", rec.PID)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), ledgerWriteTimeout)
		if err := led.DeleteReattach(ctx, name); err != nil {
			plog.Warn("cannot delete reattach record", "error", err)
		}
		cancel()
	}
	return out
}

func loadReattachRecord(led *ledger.Ledger, name string) (*reattachRecord, error) {
	data, ok, err := led.LoadReattach(name)
	switch {
	case err != nil:
		return nil, err
	case !ok:
		return nil, fmt.Errorf("reattach record of plugin %q vanished", name)
	}
	rec, err := decodeReattachRecord(data)
	if err != nil {
		return nil, err
	}
	return &rec, nil
}

// socketDir prepares StateDir/sockets (mode 0700) for the sockets of kept plugins and
// returns it, or "" (with a log line) when it cannot be used: the plugins then put their
// sockets in their temp dir.
func socketDir(stateDir string, log hclog.Logger) string {
	dir, err := filepath.Abs(filepath.Join(stateDir, socketDirName))
	if err != nil {
		log.Warn("plugin socket dir unusable; kept plugins will put their sockets in their temp dir", "error", err)
		return ""
	}
	if len(dir) > maxSocketDirLen {
		log.Warn("plugin socket dir path too long for a Unix socket; kept plugins will put their sockets in their temp dir", "dir", dir, "max_len", maxSocketDirLen)
		return ""
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		log.Warn("plugin socket dir unusable; kept plugins will put their sockets in their temp dir", "error", err)
		return ""
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		log.Warn("plugin socket dir unusable; kept plugins will put their sockets in their temp dir", "error", err)
		return ""
	}
	return dir
}
