//go:build unix

package pluginloader

import (
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// maxSymlinks bounds the symlinks followed while resolving one path, as Linux does.
const maxSymlinks = 40

// CheckPath resolves path, a plugin binary, and checks that nobody but root and the
// agent's own user could have put it there or changed it, as sshd's StrictModes does:
// the file and every directory the resolution passes through, from "/" down (the
// directories holding the symlinks followed on the way too), must be owned by root or by
// the process's effective user, and must not be writable by group or others. One
// exception: a directory with the sticky bit (like /tmp, mode 1777) may be writable by
// others, because there nobody but the owner of an entry (or of the directory, or root)
// can rename or remove that entry, and the entry the walk goes on into is itself checked
// for its owner. It returns the resolved path, which is what must be executed: the
// symlinks on the way are then no longer looked up.
//
// A refusal wraps ErrInsecurePath and names the path, its owner and its mode, and the
// command that fixes it ("chmod go-w /opt/plugins", "chown root /opt/plugins/x").
// CheckPath reads the file system only; it is safe for concurrent use.
func CheckPath(path string) (string, error) {
	return checkPath(path, false)
}

// checkDir is CheckPath for the plugin dir, whose entries Discover runs: no sticky-bit
// exception for the dir itself (anyone could add a plugin to it).
func checkDir(path string) (string, error) {
	return checkPath(path, true)
}

func checkPath(path string, isDir bool) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	fi, err := os.Lstat("/")
	if err != nil {
		return "", err
	}
	if err := checkTrusted("/", fi, true); err != nil {
		return "", err
	}
	cur, queue, hops := "/", splitPath(abs), 0
	for len(queue) > 0 {
		name := queue[0]
		queue = queue[1:]
		if name == ".." {
			cur = filepath.Dir(cur) // cur has no symlink in it: ".." is its parent
			continue
		}
		next := filepath.Join(cur, name)
		fi, err := os.Lstat(next)
		if err != nil {
			return "", err
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			if hops++; hops > maxSymlinks {
				return "", fmt.Errorf("%s: more than %d symlinks: %w", path, maxSymlinks, syscall.ELOOP)
			}
			target, err := os.Readlink(next)
			if err != nil {
				return "", err
			}
			if filepath.IsAbs(target) {
				cur = "/"
			}
			queue = append(splitPath(target), queue...)
			continue
		}
		switch {
		case fi.IsDir():
			if err := checkTrusted(next, fi, true); err != nil {
				return "", err
			}
		case len(queue) > 0:
			return "", fmt.Errorf("%s: %w", next, syscall.ENOTDIR)
		}
		cur = next
	}
	// The end of the walk: the binary, or the plugin dir, by the strict rule.
	fi, err = os.Lstat(cur)
	if err != nil {
		return "", err
	}
	if isDir && !fi.IsDir() {
		return "", fmt.Errorf("%s: not a directory", cur)
	}
	if err := checkTrusted(cur, fi, false); err != nil {
		return "", err
	}
	return cur, nil
}

// splitPath splits a path into its names, without empty ones and ".".
func splitPath(p string) []string {
	var out []string
	for _, n := range strings.Split(p, "/") {
		if n != "" && n != "." {
			out = append(out, n)
		}
	}
	return out
}

// checkTrusted checks fi, the file or directory at path: owned by root or the agent's
// user, and not writable by group or others (unless stickyOK and it is a directory with
// the sticky bit).
func checkTrusted(path string, fi os.FileInfo, stickyOK bool) error {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("%s: no owner information: %w", path, ErrInsecurePath)
	}
	kind := "file"
	if fi.IsDir() {
		kind = "directory"
	}
	if euid := uint32(os.Geteuid()); st.Uid != 0 && st.Uid != euid {
		return fmt.Errorf("%s %s is owned by %s (mode %s), not by root or the agent's user %s; fix: chown root %s: %w",
			kind, path, userName(st.Uid), fi.Mode(), userName(euid), path, ErrInsecurePath)
	}
	w := fi.Mode().Perm() & 0o022
	if w == 0 || (stickyOK && fi.IsDir() && fi.Mode()&os.ModeSticky != 0) {
		return nil
	}
	who, fix := "group and others", "go-w"
	switch w {
	case 0o020:
		who, fix = "its group", "g-w"
	case 0o002:
		who, fix = "others", "o-w"
	}
	return fmt.Errorf("%s %s is writable by %s (mode %s, owner %s); fix: chmod %s %s: %w",
		kind, path, who, fi.Mode(), userName(st.Uid), fix, path, ErrInsecurePath)
}

// userName is "uid 65534 (nobody)", or "uid N" when the name is not known.
func userName(uid uint32) string {
	id := strconv.FormatUint(uint64(uid), 10)
	if u, err := user.LookupId(id); err == nil && u.Username != "" {
		return "uid " + id + " (" + u.Username + ")"
	}
	return "uid " + id
}
