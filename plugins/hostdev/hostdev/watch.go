package hostdev

import (
	"errors"
	"io/fs"
	"os"
	"path"
	"path/filepath"

	"github.com/fsnotify/fsnotify"
	"github.com/hashicorp/go-hclog"
	"google.golang.org/protobuf/proto"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// watchDirs are the directories whose entries make the blocks' devices: each path's
// directory under the dev root; for USB, /dev/bus/usb and its bus directories (a
// device's node comes and goes there when it is plugged in and out; sysfs itself
// sends no events), /dev (its interfaces' nodes) and the sysfs device list (a scratch
// tree's does).
func watchDirs(s settings) []string {
	var dirs []string
	usb := false
	for _, t := range s.types {
		if t.usb != nil {
			usb = true
			continue
		}
		for _, p := range t.paths {
			dirs = append(dirs, hostPath(s.devRoot, path.Dir(p)))
		}
	}
	if usb {
		// The dev root too: an interface's node (a ttyUSB) is made there, maybe after
		// the device's own node.
		bus := hostPath(s.devRoot, "/dev/bus/usb")
		dirs = append(dirs, s.devRoot, bus, filepath.Join(s.sysRoot, usbDevicesDir))
		if names, _, err := readDirNames(bus); err == nil {
			for _, n := range names {
				dirs = append(dirs, filepath.Join(bus, n))
			}
		}
	}
	return dirs
}

// updateWatches makes w watch dirs and nothing else. A directory that does not exist
// yet (/dev/net before the tun module loads) is watched through its nearest existing
// parent, so its creation is seen and it is watched on the scan that follows. Every
// directory is added again on every call: a directory removed and made again loses
// its watch in the kernel, and adding a watched one changes nothing.
// watched holds every directory tried, true when it is watched. added says whether a
// directory is watched now that was not: what changed in it before its watch began
// was seen by no event, so the caller scans again.
func updateWatches(w *fsnotify.Watcher, watched map[string]bool, dirs []string, logger hclog.Logger) (added bool) {
	want := map[string]bool{}
	for _, d := range dirs {
		want[existingAncestor(d)] = true
	}
	for d, ok := range watched {
		if !want[d] {
			if ok {
				_ = w.Remove(d) // gone with its directory, or no longer configured
			}
			delete(watched, d)
		}
	}
	for d := range want {
		err := w.Add(d)
		if err != nil {
			if ok, tried := watched[d]; ok || !tried { // said once per failure
				logger.Warn("cannot watch a device directory; its changes are seen by the periodic scan", "dir", d, "error", err)
			}
		}
		added = added || err == nil && !watched[d]
		watched[d] = err == nil
	}
	return added
}

// existingAncestor is dir, or its nearest parent that exists.
func existingAncestor(dir string) string {
	for {
		if _, err := os.Stat(dir); err == nil || !errors.Is(err, fs.ErrNotExist) {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return dir
		}
		dir = parent
	}
}

// equalFingerprint reports whether two inventories are the same.
func equalFingerprint(a, b *pb.FingerprintResponse) bool { return proto.Equal(a, b) }
