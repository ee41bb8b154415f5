package fixtureplugin

import (
	"fmt"
	"os/exec"
	"path/filepath"
)

// Package is the import path of the fixture binary's main package.
const Package = "github.com/devicehost/devicehost/tools/fixtureplugin/cmd/fixture"

// Build compiles the fixture binary into dir (which must exist) and returns its path,
// dir/fixture. It runs `go build`, so call it once per test binary, from TestMain, with
// a dir the caller removes afterwards:
//
//	dir, _ := os.MkdirTemp("", "fixture")
//	bin, err := fixtureplugin.Build(dir)
//	...
//	code := m.Run()
//	os.RemoveAll(dir)
//	os.Exit(code)
func Build(dir string) (string, error) {
	return BuildPackage(dir, Name, Package)
}

// BuildPackage compiles the main package pkg into dir/name with `go build` and returns
// the binary's path. It is Build for other plugins (e.g. ./plugins/nvidia-example).
func BuildPackage(dir, name, pkg string) (string, error) {
	out := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-o", out, pkg)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build %s: %s: %w", pkg, b, err)
	}
	return out, nil
}
