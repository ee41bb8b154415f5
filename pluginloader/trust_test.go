//go:build unix

package pluginloader_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/pluginloader"
)

const nobody = 65534

// mkdir makes dir (and its parents) with mode perm, past the umask.
func mkdir(t *testing.T, dir string, perm os.FileMode) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, perm); err != nil {
		t.Fatal(err)
	}
	return dir
}

func chown(t *testing.T, path string, uid int) {
	t.Helper()
	if err := os.Lchown(path, uid, -1); err != nil {
		t.Fatal(err)
	}
}

func symlink(t *testing.T, target, link string) string {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	return link
}

// TestTrust: the rules of CheckPath, seen through Discover and Launch. Each refused
// plugin is refused alone (the trusted one beside it is still found), before it runs,
// with an error naming the path, owner, mode and fix.
func TestTrust(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: files owned by another user are made with chown")
	}
	type setup func(t *testing.T, base, plugins string) (bad string)
	tests := []struct {
		name  string
		setup setup
		want  []string // in the error, besides the bad path
	}{
		{name: "group-writable binary", want: []string{"file", "writable by its group", "mode -rwxrwxr-x", "owner uid 0", "fix: chmod g-w"},
			setup: func(t *testing.T, base, plugins string) string {
				return copyBinary(t, fixtureBin, plugins, "bad", 0o775)
			}},
		{name: "world-writable binary", want: []string{"writable by group and others", "mode -rwxrwxrwx", "fix: chmod go-w"},
			setup: func(t *testing.T, base, plugins string) string {
				return copyBinary(t, fixtureBin, plugins, "bad", 0o777)
			}},
		{name: "binary owned by another user", want: []string{"owned by uid 65534", "not by root or the agent's user uid 0", "fix: chown root"},
			setup: func(t *testing.T, base, plugins string) string {
				bad := copyBinary(t, fixtureBin, plugins, "bad", 0o755)
				chown(t, bad, nobody)
				return bad
			}},
		{name: "symlink to a binary in a dir owned by another user", want: []string{"directory", "owned by uid 65534", "fix: chown root"},
			setup: func(t *testing.T, base, plugins string) string {
				dir := mkdir(t, filepath.Join(base, "theirs"), 0o755)
				chown(t, dir, nobody)
				symlink(t, copyBinary(t, fixtureBin, dir, "bin", 0o755), filepath.Join(plugins, "bad"))
				return dir
			}},
		{name: "symlink into a 0777 dir", want: []string{"directory", "writable by group and others", "mode drwxrwxrwx", "fix: chmod go-w"},
			setup: func(t *testing.T, base, plugins string) string {
				dir := mkdir(t, filepath.Join(base, "open"), 0o777)
				symlink(t, copyBinary(t, fixtureBin, dir, "bin", 0o755), filepath.Join(plugins, "bad"))
				return dir
			}},
		{name: "symlink through a link in a 0777 dir", want: []string{"directory", "writable by group and others"},
			setup: func(t *testing.T, base, plugins string) string {
				// The final target is trusted, but the link on the way could be repointed.
				safe := copyBinary(t, fixtureBin, mkdir(t, filepath.Join(base, "safe"), 0o755), "bin", 0o755)
				open := mkdir(t, filepath.Join(base, "open"), 0o777)
				symlink(t, filepath.Join(open, "hop"), filepath.Join(plugins, "bad"))
				symlink(t, safe, filepath.Join(open, "hop"))
				return open
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := t.TempDir()
			plugins := mkdir(t, filepath.Join(base, "plugins"), 0o755)
			copyBinary(t, fixtureBin, plugins, "good", 0o755)
			bad := tt.setup(t, base, plugins)

			bins, err := pluginloader.Discover(plugins, nil)
			if got := names(bins); !slices.Equal(got, []string{"good"}) {
				t.Errorf("Discover: got %q, want [good]: only the refused plugin is left out", got)
			}
			checkRefusal(t, "Discover", err, bad, tt.want)

			_, err = pluginloader.Launch(testContext(t), pluginloader.Binary{Name: "bad", Path: filepath.Join(plugins, "bad")},
				pluginloader.Options{Logger: testLogger(t)})
			checkRefusal(t, "Launch", err, bad, tt.want)
		})
	}
}

func checkRefusal(t *testing.T, what string, err error, path string, want []string) {
	t.Helper()
	if !errors.Is(err, pluginloader.ErrInsecurePath) {
		t.Errorf("%s: got %v, want an error wrapping ErrInsecurePath", what, err)
		return
	}
	t.Logf("%s: %v", what, err)
	for _, w := range append([]string{path + " "}, want...) {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: error %q does not say %q", what, err, w)
		}
	}
}

// TestTrustPluginDir: the plugin dir and every dir above it must be trusted. A dir with
// the sticky bit (like /tmp) may be writable by others on the way, because nobody else
// can rename or remove what is in it, but not as the plugin dir itself, where anyone
// could add a plugin.
func TestTrustPluginDir(t *testing.T) {
	tests := []struct {
		name      string
		parent    os.FileMode
		dir       os.FileMode
		refused   string // "parent", "dir" or "" (accepted)
		wantInErr string
	}{
		{name: "0777 parent", parent: 0o777, dir: 0o755, refused: "parent", wantInErr: "writable by group and others"},
		{name: "group-writable parent", parent: 0o775, dir: 0o755, refused: "parent", wantInErr: "writable by its group"},
		{name: "sticky 1777 parent", parent: 0o777 | os.ModeSticky, dir: 0o755},
		{name: "sticky 1777 plugin dir", parent: 0o755, dir: 0o777 | os.ModeSticky, refused: "dir", wantInErr: "writable by group and others"},
		{name: "0775 plugin dir", parent: 0o755, dir: 0o775, refused: "dir", wantInErr: "fix: chmod g-w"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			parent := mkdir(t, filepath.Join(t.TempDir(), "parent"), 0o755)
			dir := mkdir(t, filepath.Join(parent, "plugins"), 0o755)
			copyBinary(t, fixtureBin, dir, "good", 0o755)
			mkdir(t, dir, tt.dir)
			mkdir(t, parent, tt.parent)

			bins, err := pluginloader.Discover(dir, nil)
			switch tt.refused {
			case "":
				if err != nil || !slices.Equal(names(bins), []string{"good"}) {
					t.Errorf("Discover: got %q, %v; want [good], nil", names(bins), err)
				}
				if _, err := pluginloader.CheckPath(filepath.Join(dir, "good")); err != nil {
					t.Errorf("CheckPath: %v", err)
				}
			default:
				if bins != nil {
					t.Errorf("Discover: got %q, want nothing from an untrusted dir", names(bins))
				}
				bad := map[string]string{"parent": parent, "dir": dir}[tt.refused]
				checkRefusal(t, "Discover", err, bad, []string{tt.wantInErr})
			}
		})
	}
}
